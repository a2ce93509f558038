"""Forecasts corrected by measurement, live: the admin view shows a replica's correction learned.

One emulated vLLM replica (``simulator.server.build_app``, in this process, on a real socket) that
models its API server's work on the engine's CPU (docs/emulator.md, the measured CPU row scaled
up, which the step model fitted from ``/metrics`` cannot see), behind a real gateway that scrapes
it every second. After a few dozen streamed requests ``GET /sluice/v1/replicas`` shows the
correction's samples and a TTFT factor away from 1, and the forecasts as corrected closer to what
the gateway measured than the uncorrected ones. The bounds are generous: the host's own load adds
to every latency the gateway measures.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.admission.config import AdmissionSettings
from gateway.app import build_app
from gateway.config.settings import ServerSettings, Settings
from gateway.config.store import SettingsStore
from gateway.replicas.config import HardwareSettings, HealthSettings, ReplicaSettings
from simulator.apiserver import ApiServerCosts
from simulator.profile import load_profile
from simulator.server import build_app as build_emulator
from tests.support.speed import scaled

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PROFILE = "llama3-8b-h100"
HARDWARE = HardwareSettings(
    gpu="H100-SXM", model="Llama-3-8B", max_num_seqs=1024, max_num_batched_tokens=8192
)
#: Targets no request here comes near: everything is admitted, and measured.
LOOSE = AdmissionSettings.model_validate(
    {"classes": {"plain": {"ttft_target_s": 30.0, "tpot_target_s": 5.0}}, "default_class": "plain"}
)
#: The measured vLLM-on-CPU costs, ten times: tens of milliseconds an H100 step model never sees.
COSTS = ApiServerCosts(
    per_request_s=0.045,
    per_prompt_token_s=3e-5,
    per_step_s=6e-3,
    per_output_token_s=7e-4,
    contention="shared",
)
REQUESTS = 48
AT_ONCE = 4

Client = TestClient[web.Request, web.Application]


async def gateway(aiohttp_server: Any, aiohttp_client: Any) -> Client:
    profile = load_profile(PROFILE).with_api_server(COSTS)
    emulator: TestServer = await aiohttp_server(build_emulator(profile, seed=1))
    url = str(emulator.make_url("")).rstrip("/")
    store = SettingsStore(
        Settings(
            replicas=[ReplicaSettings(name="r0", url=url, hardware=HARDWARE)],
            health=HealthSettings(interval_s=30.0, timeout_s=5.0),
            server=ServerSettings(port=0),
            admission=LOOSE,
        )
    )
    client: Client = await aiohttp_client(build_app(store))
    return client


async def test_the_admin_view_shows_the_correction_learned(aiohttp_server: Any, aiohttp_client: Any) -> None:
    client = await gateway(aiohttp_server, aiohttp_client)
    model = str((await (await client.get("/v1/models")).json())["data"][0]["id"])
    # The first scrape gives the replica its step model (forecasts need one).
    async with asyncio.timeout(scaled(30.0)):
        while True:
            view = await (await client.get("/sluice/v1/replicas")).json()
            if view["replicas"][0]["metrics"] is not None:
                break
            await asyncio.sleep(0.2)

    statuses: list[int] = []

    async def one(i: int) -> None:
        body = {"model": model, "prompt": "word " * (100 + 200 * (i % 4)), "max_tokens": 16}
        resp = await client.post("/v1/completions", json={**body, "stream": True, "ignore_eos": True})
        await resp.read()
        statuses.append(resp.status)

    async with asyncio.timeout(scaled(120.0)):
        for start in range(0, REQUESTS, AT_ONCE):
            await asyncio.gather(*(one(i) for i in range(start, start + AT_ONCE)))
            await asyncio.sleep(0.2)
    assert statuses.count(200) == REQUESTS, statuses

    view = await (await client.get("/sluice/v1/replicas")).json()
    correction = view["prediction"]["replicas"]["r0"]["correction"]
    assert correction["enabled"] is True
    ttft = correction["ttft"]
    assert ttft["samples_total"] >= REQUESTS // 2, ttft
    assert ttft["regimes"], ttft
    # The factor a request's regime gets has moved off 1; the step model alone forecast low.
    assert max(r["factor"] for r in ttft["regimes"]) >= 1.2, ttft
    residuals = ttft["residuals"]
    assert residuals["before_median"] > 0.2, residuals
    assert abs(residuals["after_median"]) < abs(residuals["before_median"]), residuals
