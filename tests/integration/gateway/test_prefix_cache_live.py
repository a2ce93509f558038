"""Prefix-cache-aware admission, live: two emulated vLLM replicas behind a real gateway.

The emulators (``simulator.server.build_app``, in this process, on real sockets) cache prefixes
as vLLM does and report ``usage.prompt_tokens_details.cached_tokens``. Requests sharing a long
system prompt go to the replica that holds it, are forecast with the hit (lower TTFT than the same
prompt sent cold, ``x-sluice-predicted-cached-tokens``), and the hit the forecast took is close to
the one the replica reports. A prompt nobody sent before is forecast with no hit. Sequential
requests, behaviour only: nothing here depends on how busy the host is.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.app import build_app
from gateway.config.settings import ServerSettings, Settings
from gateway.config.store import SettingsStore
from gateway.replicas.config import HardwareSettings, HealthSettings, ReplicaSettings
from simulator.profile import load_profile
from simulator.server import build_app as build_emulator
from tests.support.speed import scaled

pytestmark = [pytest.mark.timeout(180)]

PROFILE = "llama3-8b-h100"
HARDWARE = HardwareSettings(gpu="H100-SXM", model="Llama-3-8B", max_num_seqs=256, max_num_batched_tokens=8192)
#: A system prompt of 3,000 words (one emulator token each): about 190 of vLLM's 16-token blocks.
SYSTEM = " ".join(f"rule{i % 97} applies to case{i}." for i in range(750))

Client = TestClient[web.Request, web.Application]


async def gateway(aiohttp_server: Any, aiohttp_client: Any) -> Client:
    replicas = []
    for i in range(2):
        emulator: TestServer = await aiohttp_server(
            build_emulator(load_profile(PROFILE), seed=i, enable_prompt_tokens_details=True)
        )
        url = str(emulator.make_url("")).rstrip("/")
        replicas.append(ReplicaSettings(name=f"r{i}", url=url, hardware=HARDWARE))
    store = SettingsStore(
        Settings(
            replicas=replicas,
            health=HealthSettings(interval_s=30.0, timeout_s=5.0),
            server=ServerSettings(port=0),
        )
    )
    client: Client = await aiohttp_client(build_app(store))
    async with asyncio.timeout(scaled(30.0)):
        while True:  # the first scrape of both gives them their step models
            view = await (await client.get("/sluice/v1/replicas")).json()
            if all(r["metrics"] is not None for r in view["replicas"]):
                return client
            await asyncio.sleep(0.2)


async def chat(client: Client, model: str, question: str) -> tuple[dict[str, str], dict[str, Any]]:
    body = {
        "model": model,
        "max_tokens": 4,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
    }
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200, await resp.text()
    return dict(resp.headers), await resp.json()


def cached(answer: dict[str, Any]) -> int:
    details = answer["usage"]["prompt_tokens_details"]
    return int(details["cached_tokens"]) if details else 0


async def test_shared_prefixes_are_routed_to_their_cache_and_forecast_with_the_hit(
    aiohttp_server: Any, aiohttp_client: Any
) -> None:
    client = await gateway(aiohttp_server, aiohttp_client)
    model = str((await (await client.get("/v1/models")).json())["data"][0]["id"])

    cold_headers, cold = await chat(client, model, "What is case 1?")
    home = cold_headers["x-sluice-replica"]
    assert cached(cold) == 0
    assert "x-sluice-predicted-cached-tokens" not in cold_headers

    prompt = int(cold["usage"]["prompt_tokens"])
    for i in range(2, 6):
        headers, answer = await chat(client, model, f"And what is case {i}?")
        # Both replicas are idle and meet the targets: the one holding the prefix wins.
        assert headers["x-sluice-replica"] == home, headers
        expected = int(headers["x-sluice-predicted-cached-tokens"])
        reported = cached(answer)
        assert reported > prompt // 2, answer["usage"]
        # The index's estimate (text blocks, a learned characters-per-token) against the
        # replica's own count: within a tenth of the prompt.
        assert abs(expected - reported) <= prompt // 10, (expected, reported)
        assert float(headers["x-sluice-predicted-ttft-ms"]) < float(
            cold_headers["x-sluice-predicted-ttft-ms"]
        )

    # The same size of prompt, all new: no hit expected anywhere.
    novel = " ".join(f"other{i % 89} text for item{i}." for i in range(750))
    body = {"model": model, "max_tokens": 4, "messages": [{"role": "system", "content": novel}]}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200
    assert "x-sluice-predicted-cached-tokens" not in resp.headers

    view = await (await client.get("/sluice/v1/replicas")).json()
    indexes = view["admission"]["prefix_cache"]["replicas"]
    assert indexes[home]["blocks"] > 0, indexes
    assert 0.5 < indexes[home]["delivered_share"] <= 1.0, indexes
