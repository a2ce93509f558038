"""The proxy runs an exchange in the handler's own task and ends it by cancelling that task at
most once: ``stop_all`` twice stops it once, the handler then answers normally (503 with
``server_shutting_down``, one outcome), and the gateway goes on serving on the same connection.
(Client disconnects: ``test_disconnect.py``.)
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
from aiohttp import web

from gateway.proxy.forward import PROXY
from tests.unit.gateway.conftest import StartReplica
from tests.unit.gateway.fakes import MODEL, FakeReplica, gateway_settings, make_app, wait_for


@asynccontextmanager
async def served(app: web.Application) -> AsyncIterator[int]:
    """Serve ``app`` as ``web.run_app`` does (no handler cancellation); yields its port."""
    runner = web.AppRunner(app)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    site = web.SockSite(runner, sock)
    await site.start()
    try:
        yield sock.getsockname()[1]
    finally:
        await runner.cleanup()


class Stalled:
    """Fake replica handler that takes the request and never answers (until cancelled)."""

    def __init__(self) -> None:
        self.started = asyncio.Event()

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        self.started.set()
        await asyncio.sleep(30)
        raise AssertionError("not reached")


async def test_stop_all_ends_an_exchange_once_and_the_gateway_serves_on(start_replica: StartReplica) -> None:
    stalled = Stalled()
    replica = FakeReplica(handler=stalled)
    _, url = await start_replica(replica)
    app, _, outcomes = make_app(gateway_settings({"r1": url}))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    async with served(app) as port, aiohttp.ClientSession() as client:
        base = f"http://127.0.0.1:{port}/v1/chat/completions"
        pending = asyncio.create_task(client.post(base, json=body))
        await asyncio.wait_for(stalled.started.wait(), timeout=10)
        proxy = app[PROXY]
        assert proxy.stop_all() == 1
        assert proxy.stop_all() == 0  # already being ended: not cancelled twice
        resp = await asyncio.wait_for(pending, timeout=10)
        assert resp.status == 503
        assert (await resp.json())["error"]["code"] == "server_shutting_down"
        await wait_for(lambda: len(outcomes) == 1)
        assert outcomes[0].error == "server_shutting_down"
        # The same connection and the same gateway answer the next request normally.
        replica.handler = None
        again = await client.post(base, json=body)
        assert again.status == 200
        assert (await again.json())["choices"][0]["message"]["content"] == "Hello there!"
        await wait_for(lambda: len(outcomes) == 2)
        assert outcomes[1].status == 200
        assert outcomes[1].error is None
