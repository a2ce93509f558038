"""The gateway app over real HTTP: routing, streaming as it arrives, reload, /v1/models, /readyz.

Fake replicas are used where a test must hold a request open or flip a replica's health at will,
which the emulator cannot be told to do.
"""

from __future__ import annotations

import asyncio
import gc
import json
import sys
from typing import Any

import pytest
from aiohttp import web

from gateway import serve
from gateway.config.settings import Settings
from gateway.config.store import SettingsStore
from gateway.http import parse_errors
from gateway.keys import HEALTH, REGISTRY
from gateway.replicas.config import ReplicaSettings
from gateway.replicas.registry import ReplicaState
from gateway.serve import GC_THRESHOLD, GIL_SWITCH_INTERVAL_S, _quiet_gc
from tests.unit.gateway.conftest import StartGateway, StartReplica
from tests.unit.gateway.fakes import MODEL, FakeReplica, chat_chunk, sse, wait_for

CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}


class HeldStream:
    """Fake replica handler: sends one event, then holds the stream open until released (a
    non-streaming request gets its JSON answer at once)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.arrived = 0

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        self.arrived += 1
        if not (await request.json()).get("stream"):
            return web.json_response({"id": "c1", "object": "chat.completion", "choices": []})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(sse(chat_chunk("first")))
        await self.release.wait()
        await response.write(sse(chat_chunk("", finish="stop")) + sse("[DONE]"))
        return response


async def test_events_are_relayed_as_they_arrive_not_at_the_end(
    start_replica: StartReplica, start_gateway: StartGateway
) -> None:
    """The replica withholds the rest of its stream until the client has seen the first event: a
    buffering gateway would deadlock here."""
    held = HeldStream()
    _, url = await start_replica(FakeReplica(handler=held))
    gw = await start_gateway({"r1": url})

    resp = await gw.client.post("/v1/chat/completions", json=CHAT)
    first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), timeout=5)
    assert json.loads(first.removeprefix(b"data: "))["choices"][0]["delta"]["content"] == "first"
    held.release.set()
    rest = await resp.read()
    assert rest.endswith(b"data: [DONE]\n\n")


async def test_requests_go_to_the_replica_with_fewest_outstanding_until_streams_end(
    start_replica: StartReplica, start_gateway: StartGateway
) -> None:
    """Two fake replicas hold their streams open, so outstanding counts stay up while we look."""
    held_a, held_b = HeldStream(), HeldStream()
    _, url_a = await start_replica(FakeReplica(handler=held_a))
    _, url_b = await start_replica(FakeReplica(handler=held_b))
    gw = await start_gateway({"a": url_a, "b": url_b})
    a, b = gw.app[REGISTRY].replicas()

    streams = []
    for _ in range(4):
        resp = await gw.client.post("/v1/chat/completions", json=CHAT)
        await resp.content.readuntil(b"\n\n")  # dispatched and streaming
        streams.append(resp)

    assert (held_a.arrived, held_b.arrived) == (2, 2)
    assert (a.outstanding, b.outstanding) == (2, 2)
    held_a.release.set()
    await asyncio.gather(*(s.read() for s in streams[::2]))  # a's streams (a got 1st and 3rd)
    await wait_for(lambda: a.outstanding == 0)
    assert b.outstanding == 2  # still streaming: counted until the stream ends

    resp = await gw.client.post("/v1/chat/completions", json={**CHAT, "stream": False})
    assert resp.status == 200
    assert (held_a.arrived, held_b.arrived) == (3, 2)  # the idle one got it
    held_b.release.set()
    await asyncio.gather(*(s.read() for s in streams[1::2]))
    await wait_for(lambda: b.outstanding == 0)


async def test_reload_adds_and_drains_replicas_keeping_counts(
    start_replica: StartReplica, start_gateway: StartGateway
) -> None:
    """A fake replica holds a stream open across the reload that removes it."""
    held = HeldStream()
    _, url_a = await start_replica(FakeReplica(handler=held))
    _, url_b = await start_replica(FakeReplica())
    gw = await start_gateway({"a": url_a})
    registry = gw.app[REGISTRY]
    (a,) = registry.replicas()
    stream = await gw.client.post("/v1/chat/completions", json=CHAT)
    await stream.content.readuntil(b"\n\n")

    gw.store.swap(gw.store.current.model_copy(update={"replicas": [ReplicaSettings(name="b", url=url_b)]}))
    await gw.app[HEALTH].check_all()  # the new replica's first check (normally the next round)

    assert [r.name for r in registry.replicas()] == ["b"]
    assert registry.draining() == [a]
    resp = await gw.client.post("/v1/chat/completions", json={**CHAT, "stream": False})
    assert resp.status == 200
    assert gw.outcomes[-1].replica == "b"
    held.release.set()
    assert (await stream.read()).endswith(b"[DONE]\n\n")  # the old replica finished its request
    await wait_for(lambda: registry.draining() == [])


async def test_models_is_the_union_of_healthy_replicas(
    start_replica: StartReplica, start_gateway: StartGateway
) -> None:
    """Fake replicas serving different model lists; one of them then fails its checks."""
    one = FakeReplica(models=[{"id": "m1", "max_model_len": 8192}, {"id": "shared", "max_model_len": 4096}])
    two = FakeReplica(models=[{"id": "m2", "max_model_len": 2048}, {"id": "shared", "max_model_len": 1024}])
    _, url_1 = await start_replica(one)
    _, url_2 = await start_replica(two)
    gw = await start_gateway({"one": url_1, "two": url_2})

    resp = await gw.client.get("/v1/models")
    body = await resp.json()
    assert body["object"] == "list"
    assert {m["id"]: m["max_model_len"] for m in body["data"]} == {"m1": 8192, "shared": 1024, "m2": 2048}

    two.health_status = 503
    for _ in range(2):  # unhealthy_after = 2
        await gw.app[HEALTH].check_all()
    body = await (await gw.client.get("/v1/models")).json()
    assert sorted(m["id"] for m in body["data"]) == ["m1", "shared"]


async def test_readyz_follows_replica_health_and_healthz_stays_up(
    start_replica: StartReplica, start_gateway: StartGateway
) -> None:
    """A fake replica whose /health flips between 503 and 200 on command."""
    replica = FakeReplica(health_status=503)
    _, url = await start_replica(replica)
    gw = await start_gateway({"r1": url})

    resp = await gw.client.get("/readyz")
    assert resp.status == 503
    body = await resp.json()
    assert body["ready"] is False
    assert body["replicas"][0]["name"] == "r1"
    assert body["replicas"][0]["state"] == "unhealthy"
    assert "503" in body["replicas"][0]["error"]
    assert (await gw.client.get("/healthz")).status == 200

    replica.health_status = 200
    await gw.app[HEALTH].check_all()
    resp = await gw.client.get("/readyz")
    assert resp.status == 200
    assert (await resp.json())["replicas"][0]["state"] == "healthy"
    assert gw.app[REGISTRY].replicas()[0].state == ReplicaState.HEALTHY


async def test_a_replica_without_a_model_list_does_not_become_healthy(
    start_replica: StartReplica, start_gateway: StartGateway
) -> None:
    """A fake replica whose /health is fine but whose /v1/models is malformed."""
    replica = FakeReplica(models="not a list")  # type: ignore[arg-type]
    _, url = await start_replica(replica)
    gw = await start_gateway({"r1": url})

    (described,) = (await (await gw.client.get("/readyz")).json())["replicas"]
    assert described["state"] == "unhealthy"
    assert "/v1/models" in described["error"]


async def test_connections_to_a_replica_are_reused_after_complete_answers(
    start_replica: StartReplica, start_gateway: StartGateway
) -> None:
    """A fake replica records the client port of each request: one port = one kept-alive
    connection (closing it after every answer would cost a TCP handshake per request)."""
    replica = FakeReplica()
    ports: list[int] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        ports.append(request.transport.get_extra_info("peername")[1])
        return await replica.default_completion(request)

    replica.handler = handler
    _, url = await start_replica(replica)
    gw = await start_gateway({"r1": url})

    for stream in (True, False, True, False):
        resp = await gw.client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        await resp.read()

    assert len(set(ports)) == 1


async def test_a_replicas_cookies_reach_the_client_and_are_never_sent_for_anyone_else(
    start_replica: StartReplica, start_gateway: StartGateway
) -> None:
    """A replica's ``Set-Cookie`` (a sticky-session load balancer's, say) is the client's to keep:
    it is relayed to that client, and the gateway's shared upstream session must not store it and
    send it on every later request, other tenants' included. The replica is addressed by host name
    (``localhost``): aiohttp's default cookie jar ignores cookies of IP addresses, not of names."""
    replica = FakeReplica()

    async def handler(request: web.Request) -> web.StreamResponse:
        response = await replica.default_completion(request)
        response.set_cookie("affinity", f"session-{len(replica.seen)}")
        return response

    replica.handler = handler
    _, url = await start_replica(replica)
    gw = await start_gateway({"r1": url.replace("127.0.0.1", "localhost")})

    first = await gw.client.post("/v1/chat/completions", json={**CHAT, "stream": False})
    assert first.status == 200, await first.text()
    assert "affinity=session-1" in first.headers.getall("Set-Cookie", [])[0]
    # The test client keeps cookies as a browser would; these requests stand for other clients.
    gw.client.session.cookie_jar.clear()
    second = await gw.client.post(
        "/v1/chat/completions", json={**CHAT, "stream": False}, headers={"Cookie": "mine=1"}
    )
    assert second.status == 200, await second.text()
    gw.client.session.cookie_jar.clear()
    third = await gw.client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    await third.read()

    assert [seen.headers.get("cookie") for seen in replica.seen] == [None, "mine=1", None]


async def test_quiet_gc_freezes_what_lives_and_raises_the_young_threshold() -> None:
    """``sluice serve``'s last start-up step (its effect on a served process: the stack test
    ``test_serving_leaves_the_cycle_collector_idle``)."""
    threshold = gc.get_threshold()
    gc.unfreeze()
    try:
        await _quiet_gc(web.Application())
        assert gc.get_freeze_count() > 10_000  # modules, classes, functions: all of them
        assert gc.get_threshold() == GC_THRESHOLD
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


def test_sluice_serve_lets_the_event_loop_take_the_gil_within_a_millisecond(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``run_gateway`` sets the interpreter's switch interval before it serves, so that a worker
    thread (a big body being decoded) holds the loop for at most ``GIL_SWITCH_INTERVAL_S``."""
    seen: list[float] = []
    monkeypatch.setattr(web, "run_app", lambda app, **_: seen.append(sys.getswitchinterval()))
    monkeypatch.setattr(parse_errors, "_server_header", parse_errors._server_header)
    before = sys.getswitchinterval()
    try:
        serve.run_gateway(
            SettingsStore(Settings(replicas=[ReplicaSettings(name="r", url="http://127.0.0.1:9")]))
        )
    finally:
        sys.setswitchinterval(before)
    assert seen == [pytest.approx(GIL_SWITCH_INTERVAL_S)]
    assert before > GIL_SWITCH_INTERVAL_S  # CPython's 5 ms
