"""A request leaves no reference cycle behind: everything it made is freed by reference counting
when its handler returns, not left for the cycle collector.

Why it matters: ``sluice serve`` freezes what lives from start-up on (``gc.freeze``) and runs the
young generation's collection only every 10,000 net allocations (``gateway.app._quiet_gc``). That
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
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.app import OUTCOME_LISTENERS, build_app
from gateway.observability.logs import RequestOutcome
from gateway.settings import Settings
from gateway.store import SettingsStore
from gateway.tenants import hash_api_key
from simulator.profile import load_profile
from simulator.server import build_app as build_emulator

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

PROFILE = "llama3-8b-h100"
MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"  # the profile's served_model_name
KEY, THROTTLED_KEY = "sk-cycles-1", "sk-cycles-2"
T = TypeVar("T")


def _settings(replica_url: str) -> Settings:
    roomy = {"tokens_per_minute": 1.0e9, "requests_per_minute": 1.0e6, "max_concurrent": 10_000}
    return Settings.model_validate(
        {
            "server": {"port": 0},
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
        async with client.post("/v1/chat/completions", data=b"{not json", headers=headers) as resp:
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
