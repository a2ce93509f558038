"""A client that goes away mid-stream makes the gateway close its upstream request within 1 s.

The fake replica streams a token every 20 ms for up to 30 s and records when it sees its
connection drop; the emulator cannot report that moment to a test. The gateway is served by a
plain ``web.AppRunner``, as ``run_gateway`` serves it (no handler cancellation on disconnect), and
for comparison by aiohttp's test server, which does cancel handlers on disconnect.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.keys import REGISTRY
from tests.support import speed
from tests.unit.gateway.conftest import StartReplica
from tests.unit.gateway.fakes import MODEL, FakeReplica, chat_chunk, gateway_settings, make_app, sse, wait_for

TOKEN_INTERVAL_S = 0.02
#: Bound (seconds) from the client's disconnect to the replica seeing its drop (the
#: disconnect monitor looks every 0.1 s), scaled by the host-speed factor: a sanity bound.
BOUND_S = speed.scaled(1.0)


class EndlessStream:
    """Fake replica handler: one token every 20 ms; records when its connection drops."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.dropped: asyncio.Future[float] = asyncio.get_running_loop().create_future()

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            for _ in range(1500):  # 30 s at most
                await response.write(sse(chat_chunk("tok")))
                self.started.set()
                await asyncio.sleep(TOKEN_INTERVAL_S)
        except (ConnectionResetError, asyncio.CancelledError):
            if not self.dropped.done():
                self.dropped.set_result(time.monotonic())
            raise
        return response


ServeGateway = Callable[[web.Application], Awaitable[str]]


@asynccontextmanager
async def production_runner(app: web.Application) -> AsyncIterator[str]:
    """Serve ``app`` the way ``web.run_app`` does (handler_cancellation off); yields its URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    site = web.SockSite(runner, sock)
    await site.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def aiohttp_test_server(app: web.Application) -> AsyncIterator[str]:
    """aiohttp's TestServer, which cancels handlers when their client disconnects."""
    server = TestServer(app)
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


@pytest.mark.parametrize(
    "serve",
    [
        pytest.param(production_runner, id="app-runner-like-run_app"),
        pytest.param(aiohttp_test_server, id="test-server-with-handler-cancellation"),
    ],
)
async def test_client_disconnect_mid_stream_closes_upstream_within_one_second(
    start_replica: StartReplica, serve: Callable[[web.Application], object]
) -> None:
    """Fake replica streaming a token every 20 ms (``EndlessStream``): it records the moment its
    connection drops, which the emulator cannot report."""
    stream = EndlessStream()
    _, url = await start_replica(FakeReplica(handler=stream))
    app, _, outcomes = make_app(gateway_settings({"r1": url}))
    async with serve(app) as gateway_url, aiohttp.ClientSession() as client:  # type: ignore[attr-defined]
        resp = await client.post(
            gateway_url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True},
        )
        assert resp.status == 200
        await resp.content.readuntil(b"\n\n")  # the first token reached the client
        disconnected_at = time.monotonic()
        resp.close()  # drop the connection, like a user pressing Stop

        dropped_at = await asyncio.wait_for(stream.dropped, timeout=10)

        assert dropped_at - disconnected_at < BOUND_S
        replica = app[REGISTRY].get("r1")
        assert replica is not None
        await wait_for(lambda: replica.outstanding == 0 and len(outcomes) == 1)
        assert outcomes[0].error == "client_disconnected"


class SilentReplica:
    """Fake replica handler that takes the request and then stays silent (a long prefill or a full
    queue), optionally after sending stream headers; records when its connection drops."""

    def __init__(self, *, send_headers: bool) -> None:
        self.send_headers = send_headers
        self.started = asyncio.Event()
        self.dropped: asyncio.Future[float] = asyncio.get_running_loop().create_future()

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        try:
            if self.send_headers:
                await response.prepare(request)
            self.started.set()
            await asyncio.sleep(30)
        except (ConnectionResetError, asyncio.CancelledError):
            # The fake's own server cancels this handler when the gateway drops the connection.
            if not self.dropped.done():
                self.dropped.set_result(time.monotonic())
            raise
        return response


@pytest.mark.parametrize(
    "stream",
    [pytest.param(True, id="stream-before-first-token"), pytest.param(False, id="non-stream-waiting")],
)
async def test_disconnect_while_the_replica_is_silent_is_noticed_by_the_monitor(
    start_replica: StartReplica, stream: bool
) -> None:
    """No write to the client fails here (nothing to write), so only the disconnect monitor can
    notice; the gateway runs as ``run_gateway`` runs it (no handler cancellation)."""
    silent = SilentReplica(send_headers=stream)
    _, url = await start_replica(FakeReplica(handler=silent))
    app, _, outcomes = make_app(gateway_settings({"r1": url}))
    async with production_runner(app) as gateway_url, aiohttp.ClientSession() as client:
        request = asyncio.create_task(
            client.post(
                gateway_url + "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream},
            )
        )
        await asyncio.wait_for(silent.started.wait(), timeout=10)
        if stream:
            resp = await request  # headers arrived; no event ever will
            disconnected_at = time.monotonic()
            resp.close()
        else:
            disconnected_at = time.monotonic()
            request.cancel()  # the client gives up while waiting for the answer
            with pytest.raises(asyncio.CancelledError):
                await request

        dropped_at = await asyncio.wait_for(silent.dropped, timeout=10)

        assert dropped_at - disconnected_at < BOUND_S
        await wait_for(lambda: len(outcomes) == 1)
        assert outcomes[0].error == "client_disconnected"
        replica = app[REGISTRY].get("r1")
        assert replica is not None
        assert replica.outstanding == 0
