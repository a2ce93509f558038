"""The gateway's in-flight view of each replica (``Replica.in_flight()``), over real HTTP.

Fake replicas hold their streams open at chosen points (after N tokens, before the usage chunk),
which the emulator cannot be told to do, so the test can look at the view mid-request. Every exit
path (success, client gone, replica 4xx/5xx, a cut stream, a refused connection) must take the
request out of the view again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.keys import REGISTRY, SCRAPER
from gateway.replicas.registry import LiveRequest, Replica
from tests.unit.gateway.conftest import StartGateway, StartReplica
from tests.unit.gateway.fakes import MODEL, FakeReplica, chat_chunk, sse, usage_chunk, wait_for

PROMPT = "x" * 400
CHAT: dict[str, Any] = {
    "model": MODEL,
    "messages": [{"role": "user", "content": PROMPT}],
    "stream": True,
    "max_tokens": 50,
}
ROLE = {**chat_chunk(""), "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}


class Held:
    """Fake replica handler: a role chunk, ``tokens`` content chunks, optionally the usage chunk,
    then holds the stream until ``release`` is set; then a finish chunk and ``[DONE]``."""

    def __init__(self, tokens: int, *, usage_before_hold: bool = False) -> None:
        self.tokens = tokens
        self.usage_before_hold = usage_before_hold
        self.release = asyncio.Event()
        self.holding = asyncio.Event()

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(sse(ROLE))
        for i in range(self.tokens):
            await response.write(sse(chat_chunk(f"t{i}")))
        if self.usage_before_hold:
            await response.write(sse(usage_chunk(123, self.tokens)))
        self.holding.set()
        await self.release.wait()
        await response.write(sse(chat_chunk("", finish="stop")) + sse("[DONE]"))
        return response


async def read_events(resp: aiohttp.ClientResponse, count: int) -> None:
    for _ in range(count):
        await asyncio.wait_for(resp.content.readuntil(b"\n\n"), timeout=5)


def only_replica(app: web.Application) -> Replica:
    (replica,) = app[REGISTRY].replicas()
    return replica


async def test_counts_rise_and_fall_with_requests(
    start_replica: StartReplica, start_gateway: StartGateway
) -> None:
    """Two streams held open by the fake replica, then released one after the other."""
    held = Held(tokens=1)
    _, url = await start_replica(FakeReplica(handler=held))
    gw = await start_gateway({"r1": url})
    replica = only_replica(gw.app)
    assert replica.in_flight() == ()

    first = await gw.client.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "req-a"})
    await read_events(first, 2)
    second = await gw.client.post(
        "/v1/chat/completions", json={**CHAT, "max_tokens": 7}, headers={"x-request-id": "req-b"}
    )
    await read_events(second, 2)

    view = replica.in_flight()
    assert [r.request_id for r in view] == ["req-a", "req-b"]  # oldest dispatch first
    assert [r.max_tokens for r in view] == [50, 7]
    assert all(r.prompt_tokens >= 1 for r in view)
    assert view[0].started_at <= view[1].started_at
    assert replica.in_flight_count == 2

    held.release.set()
    await first.read()
    await second.read()
    await wait_for(lambda: replica.in_flight() == ())
    assert replica.outstanding == 0


@pytest.mark.parametrize("tokens", [0, 1, 5, 40], ids=["no-token-yet", "one", "five", "forty"])
async def test_tokens_streamed_counts_content_events_only(
    start_replica: StartReplica, start_gateway: StartGateway, tokens: int
) -> None:
    """The fake replica sends a role chunk (no token) and ``tokens`` content chunks, then holds."""
    held = Held(tokens=tokens)
    _, url = await start_replica(FakeReplica(handler=held))
    gw = await start_gateway({"r1": url})
    replica = only_replica(gw.app)

    resp = await gw.client.post("/v1/chat/completions", json=CHAT)
    await asyncio.wait_for(held.holding.wait(), timeout=5)
    await read_events(resp, 1 + tokens)  # the gateway counted them before relaying them

    (live,) = replica.in_flight()
    assert live.tokens_streamed == tokens
    assert (live.last_token_at is None) == (tokens == 0)
    if live.last_token_at is not None:
        assert live.last_token_at >= live.started_at
    held.release.set()
    await resp.read()


async def test_usage_replaces_the_prompt_estimate(
    start_replica: StartReplica, start_gateway: StartGateway
) -> None:
    """The fake replica sends its usage chunk (prompt 123 tokens) before holding the stream."""
    held = Held(tokens=2, usage_before_hold=True)
    _, url = await start_replica(FakeReplica(handler=held))
    gw = await start_gateway({"r1": url})
    replica = only_replica(gw.app)

    resp = await gw.client.post("/v1/chat/completions", json=CHAT)
    await asyncio.wait_for(held.holding.wait(), timeout=5)
    await wait_for(lambda: replica.in_flight()[0].prompt_tokens == 123)
    assert replica.in_flight()[0].tokens_streamed == 2  # the usage-only chunk is no token
    held.release.set()
    await resp.read()


def _status(code: int) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "nope"}}, status=code)

    return handler


async def _cut_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(sse(chat_chunk("a")) + sse(chat_chunk("b")))
    assert request.transport is not None
    request.transport.close()
    return response


@pytest.mark.parametrize(
    ("handler", "body", "status"),
    [
        pytest.param(None, CHAT, 200, id="stream-success"),
        pytest.param(None, {**CHAT, "stream": False}, 200, id="non-stream-success"),
        pytest.param(_status(400), CHAT, 400, id="replica-4xx"),
        pytest.param(_status(500), CHAT, 502, id="replica-5xx"),
        pytest.param(_cut_stream, CHAT, 200, id="stream-cut-midway"),
    ],
)
async def test_request_leaves_the_view_on_every_exit(
    start_replica: StartReplica,
    start_gateway: StartGateway,
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]] | None,
    body: dict[str, Any],
    status: int,
) -> None:
    """Fake replicas answering normally, with an error status, or breaking the stream."""
    _, url = await start_replica(FakeReplica(handler=handler))
    gw = await start_gateway({"r1": url})
    replica = only_replica(gw.app)

    resp = await gw.client.post("/v1/chat/completions", json=body)
    await resp.read()

    assert resp.status == status
    await wait_for(lambda: replica.in_flight() == () and replica.outstanding == 0)


async def test_request_leaves_the_view_when_the_replica_refuses_connections(
    start_replica: StartReplica, start_gateway: StartGateway
) -> None:
    """A fake replica that is healthy at startup, then its port is closed."""
    server, url = await start_replica(FakeReplica())
    gw = await start_gateway({"r1": url})
    replica = only_replica(gw.app)
    await server.close()

    resp = await gw.client.post("/v1/chat/completions", json=CHAT)

    assert resp.status == 502
    assert replica.in_flight() == ()
    assert replica.outstanding == 0


async def test_request_leaves_the_view_when_the_client_disconnects(
    start_replica: StartReplica, start_gateway: StartGateway
) -> None:
    """The fake replica holds the stream; the client closes its connection mid-stream."""
    held = Held(tokens=3)
    _, url = await start_replica(FakeReplica(handler=held))
    gw = await start_gateway({"r1": url})
    replica = only_replica(gw.app)

    resp = await gw.client.post("/v1/chat/completions", json=CHAT)
    await read_events(resp, 4)
    assert replica.in_flight_count == 1
    resp.close()  # drops the connection

    await wait_for(lambda: replica.in_flight() == () and replica.outstanding == 0)
    assert gw.outcomes[-1].error == "client_disconnected"


def test_a_live_request_freezes_into_in_flight() -> None:
    live = LiveRequest("r", prompt_tokens=10, started_at=5.0, max_tokens=20)
    live.tokens_streamed += 3
    live.last_token_at = 6.0
    frozen = live.freeze()
    assert (frozen.request_id, frozen.prompt_tokens, frozen.tokens_streamed) == ("r", 10, 3)
    assert (frozen.started_at, frozen.max_tokens, frozen.last_token_at) == (5.0, 20, 6.0)
    live.tokens_streamed += 1
    assert frozen.tokens_streamed == 3  # a snapshot, not a view


async def test_in_flight_requests_reach_the_scraped_snapshots(
    start_replica: StartReplica, start_gateway: StartGateway
) -> None:
    """A scrape taken while a stream is held open carries it (the fake replica's /metrics is a
    404, so the snapshot is stale, but its in-flight list is always current)."""
    held = Held(tokens=2)
    _, url = await start_replica(FakeReplica(handler=held))
    gw = await start_gateway({"r1": url})

    resp = await gw.client.post("/v1/chat/completions", json=CHAT)
    await asyncio.wait_for(held.holding.wait(), timeout=5)
    await read_events(resp, 3)
    snapshot = await gw.app[SCRAPER].scrape_once("r1")

    assert snapshot.stale
    assert [r.tokens_streamed for r in snapshot.in_flight] == [2]
    held.release.set()
    await resp.read()
