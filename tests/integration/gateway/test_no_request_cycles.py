"""A request leaves no reference cycle behind: everything it made is freed by reference counting
when its handler returns, not left for the cycle collector.

Why it matters: ``sluice serve`` freezes what lives from start-up on (``gc.freeze``) and runs the
young generation's collection only every 10,000 net allocations (``gateway.serve._quiet_gc``). That
holds the collector's work near zero only while requests make no cyclic garbage. Before
2026-12-02 every request did (``Proxy._forward``'s ``end`` closure and the exchange it closed
over): its task, coroutine, aiohttp request, exchange, outcome and reservation (~35 objects) all
waited for the collector, and collections took ~5 % of the gateway's CPU at 1,500 requests/s
(``docs/benchmarks.md``, "Garbage collection").

The real gateway (``build_app``, in this process) with everything on: an API key, the in-memory
token buckets, SLO admission with prediction headers, the access log; in front of an emulated
vLLM replica (``simulator.server.build_app``, in this process, on a real socket). With the
collector off and ``gc.DEBUG_SAVEALL`` on, it serves plain and streamed chat completions,
concurrently, the answers refused before dispatch (a tenant over its request budget, a missing
key, a malformed body) and a stream its client drops after the first chunk; then one
collection: nothing it finds may be an object of Sluice's own (``gateway.*``). Objects of
aiohttp's, the emulator's and the test client's own are not judged here.

The failed exchanges too: a replica that answers 500 (Sluice's 502), one that cuts a stream
after its first event (an SSE error event), one that refuses with its own 429 (Sluice's 429 once
no replica is left to try) and one that says nothing past the upstream read timeout (502). The
faults are the emulator's answers to a test header (a middleware added to it here): a replica
cannot be made to fail one request on cue any other way.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from aiohttp.typedefs import Handler

from gateway.app import build_app
from gateway.config.settings import Settings
from gateway.config.store import SettingsStore
from gateway.keys import OUTCOME_LISTENERS
from gateway.observability.outcome import RequestOutcome
from gateway.tenants import hash_api_key
from simulator.profile import load_profile
from simulator.server import build_app as build_emulator

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

PROFILE = "llama3-8b-h100"
MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"  # the profile's served_model_name
KEY, THROTTLED_KEY = "sk-cycles-1", "sk-cycles-2"
T = TypeVar("T")


#: The test header the faulty emulator answers to (``_faulty``), and its faults.
FAULT = "x-cycle-fault"
#: The gateway's upstream read timeout in this test (seconds): the emulator's hang outlasts it.
READ_TIMEOUT_S = 0.5


def _settings(replica_url: str) -> Settings:
    roomy = {"tokens_per_minute": 1.0e9, "requests_per_minute": 1.0e6, "max_concurrent": 10_000}
    return Settings.model_validate(
        {
            "server": {"port": 0, "upstream_read_timeout_s": READ_TIMEOUT_S},
            "replicas": [
                {
                    "name": "emulated",
                    "url": replica_url,
                    "backend": "vllm",
                    "hardware": {
                        "gpu": "H100-SXM",
                        "model": "Llama-3-8B",
                        "max_num_seqs": 256,
                        "max_num_batched_tokens": 8192,
                    },
                }
            ],
            "health": {"interval_s": 30.0, "timeout_s": 5.0},
            "admission": {"policy": "slo", "expose_prediction_headers": True},
            "logging": {"level": "INFO", "access_log": True},
            "tenants": {
                "tenants": {
                    "roomy": {"api_keys": [hash_api_key(KEY)], "limits": roomy},
                    # One request a minute: the second is refused by its bucket (429).
                    "throttled": {
                        "api_keys": [hash_api_key(THROTTLED_KEY)],
                        "limits": {"requests_per_minute": 1},
                    },
                }
            },
            "limits": {"backend": "memory"},
        }
    )


@pytest.fixture
def collector_off() -> Iterator[None]:
    """The cycle collector off for the test (its own ``gc.collect()`` calls still run); restored,
    with ``gc.DEBUG_SAVEALL`` off and ``gc.garbage`` emptied, afterwards."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was_enabled:
            gc.enable()


async def _garbage_made_by(work: Callable[[], Awaitable[T]]) -> tuple[T, list[object]]:
    """What ``work()`` returns, and every object the cycle collector then finds (kept alive by
    ``DEBUG_SAVEALL`` rather than freed). Garbage made before is freed first."""
    gc.collect()  # earlier garbage (the app's start-up, the warm-up) really freed
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        result = await work()
        gc.collect()
        return result, list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def _sluice_objects(objects: list[object]) -> list[str]:
    names = {f"{type(o).__module__}.{type(o).__qualname__}" for o in objects}
    return sorted(n for n in names if n.startswith("gateway."))


async def _traffic(
    client: TestClient[web.Request, web.Application], outcomes: list[RequestOutcome]
) -> list[int]:
    headers = {"Authorization": f"Bearer {KEY}"}

    async def chat(stream: bool, key_headers: dict[str, str] = headers) -> int:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Tell me about reference counting."}],
            "max_tokens": 8,
            "stream": stream,
        }
        async with client.post("/v1/chat/completions", json=body, headers=key_headers) as resp:
            await resp.read()
            return resp.status

    async def malformed() -> int:
        sent = {**headers, "Content-Type": "application/json"}
        async with client.post("/v1/chat/completions", data=b"{not json", headers=sent) as resp:
            await resp.read()
            return resp.status

    async def dropped() -> int:
        """A long stream the client closes after its first chunk; returns once the gateway has
        ended it (its outcome reported), so that its objects are garbage or freed by then."""
        before = len(outcomes)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Go on."}], "max_tokens": 2000}
        resp = await client.post("/v1/chat/completions", json={**body, "stream": True}, headers=headers)
        await resp.content.readline()
        resp.close()
        for _ in range(300):  # the disconnect monitor looks every 0.1 s
            if any(o.error == "client_disconnected" for o in outcomes[before:]):
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # the handler unwinds after its outcome is reported, the settle runs
        return resp.status

    served = await asyncio.gather(*(chat(stream=i % 2 == 1) for i in range(16)))
    throttled = {"Authorization": f"Bearer {THROTTLED_KEY}"}
    refused = [await chat(False, throttled), await chat(False, throttled)]
    refused += [await chat(False, {}), await malformed()]
    return [*served, *refused, await dropped()]


async def test_requests_leave_no_cyclic_garbage(
    aiohttp_server: Any, aiohttp_client: Any, collector_off: None
) -> None:
    replica: TestServer = await aiohttp_server(build_emulator(load_profile(PROFILE), seed=1))
    app = build_app(SettingsStore(_settings(str(replica.make_url("")).rstrip("/"))))
    outcomes: list[RequestOutcome] = []
    app[OUTCOME_LISTENERS].append(outcomes.append)
    client: TestClient[web.Request, web.Application] = await aiohttp_client(app)
    # Warm-up: the first scrape, the first request of each kind (the throttled tenant's first
    # request is still within its budget).
    assert await _traffic(client, outcomes) == [200] * 16 + [200, 429, 401, 400, 200]

    statuses, garbage = await _garbage_made_by(lambda: _traffic(client, outcomes))

    assert statuses == [200] * 16 + [429, 429, 401, 400, 200]
    assert [o.error for o in outcomes].count("client_disconnected") == 2
    assert _sluice_objects(garbage) == []


@web.middleware
async def _faulty(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The emulator's answer to ``FAULT``: ``500``, ``429`` (vLLM-style overload refusal), ``cut``
    (one SSE event, then the connection reset) or ``hang`` (silence past the gateway's read
    timeout); no header: the emulator itself."""
    fault = request.headers.get(FAULT)
    if fault == "500":
        return web.json_response({"error": {"message": "boom", "type": "InternalError"}}, status=500)
    if fault == "429":
        body = {"error": {"message": "too many requests", "type": "TooManyRequests"}}
        return web.json_response(body, status=429, headers={"Retry-After": "1"})
    if fault == "cut":
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n')
        assert request.transport is not None
        request.transport.abort()
        return response
    if fault == "hang":
        await asyncio.sleep(READ_TIMEOUT_S * 6)
    return await handler(request)


async def _failed_exchanges(client: TestClient[web.Request, web.Application]) -> list[tuple[int, bool]]:
    """(status, whether the body names an error) of each faulty exchange, in order."""

    async def chat(fault: str, stream: bool) -> tuple[int, bool]:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi."}],
            "max_tokens": 8,
            "stream": stream,
        }
        # A connection per exchange: a cut stream ends with the connection (a reused one would fail).
        headers = {"Authorization": f"Bearer {KEY}", FAULT: fault, "Connection": "close"}
        async with client.post("/v1/chat/completions", json=body, headers=headers) as resp:
            text = b""
            try:  # a cut stream ends with an error event, then the connection (no last chunk)
                async for line in resp.content:
                    text += line
            except aiohttp.ClientPayloadError:
                pass
            return resp.status, b'"error"' in text

    results = [await chat("500", stream=False), await chat("cut", stream=True)]
    results.append(await chat("429", stream=False))
    await asyncio.sleep(1.2)  # Sluice routed around the replica for its Retry-After (1 s)
    # Last: a second read timeout ejects the replica (after its own request has failed).
    results.append(await chat("hang", stream=False))
    await asyncio.sleep(0.2)  # the settles run
    return results


async def test_failed_exchanges_leave_no_cyclic_garbage(
    aiohttp_server: Any, aiohttp_client: Any, collector_off: None
) -> None:
    emulator = build_emulator(load_profile(PROFILE), seed=1)
    emulator.middlewares.append(_faulty)
    replica: TestServer = await aiohttp_server(emulator)
    app = build_app(SettingsStore(_settings(str(replica.make_url("")).rstrip("/"))))
    client: TestClient[web.Request, web.Application] = await aiohttp_client(app)
    expected = [(502, True), (200, True), (429, True), (502, True)]
    assert await _failed_exchanges(client) == expected  # warm-up: every path once

    results, garbage = await _garbage_made_by(lambda: _failed_exchanges(client))

    assert results == expected
    assert _sluice_objects(garbage) == []
