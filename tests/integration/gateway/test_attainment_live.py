"""The attainment controller, live: the admin view and /metrics show each class's margin and
the attainment measured on its replica.

One emulated vLLM replica (``simulator.server.build_app``, in this process, on a real socket)
behind a real gateway. A class with targets no request here comes near: every request is
admitted and meets them, so the controller measures attainment 1 and, refusing nothing, keeps
the configured margin.
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
from simulator.profile import load_profile
from simulator.server import build_app as build_emulator
from tests.support.speed import scaled

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

PROFILE = "llama3-8b-h100"
HARDWARE = HardwareSettings(
    gpu="H100-SXM", model="Llama-3-8B", max_num_seqs=1024, max_num_batched_tokens=8192
)
LOOSE = AdmissionSettings.model_validate(
    {"classes": {"plain": {"ttft_target_s": 30.0, "tpot_target_s": 5.0}}, "default_class": "plain"}
)
REQUESTS = 8

Client = TestClient[web.Request, web.Application]


async def test_admin_view_and_metrics_show_margin_and_attainment(
    aiohttp_server: Any, aiohttp_client: Any
) -> None:
    emulator: TestServer = await aiohttp_server(build_emulator(load_profile(PROFILE), seed=1))
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
    model = str((await (await client.get("/v1/models")).json())["data"][0]["id"])
    async with asyncio.timeout(scaled(60.0)):
        for _ in range(REQUESTS):
            body = {"model": model, "prompt": "word " * 50, "max_tokens": 8, "stream": True}
            resp = await client.post("/v1/completions", json=body)
            await resp.read()
            assert resp.status == 200

    view = await (await client.get("/sluice/v1/replicas")).json()
    (state,) = view["admission"]["attainment"]
    assert (state["class"], state["replica"]) == ("plain", "r0")
    assert state["samples"] == REQUESTS
    assert state["attainment"] == 1.0
    assert state["margin"] == LOOSE.forecast_margin
    assert state["target"] == 0.95
    # Admission by prompt-size quartile, per model and class: every request admitted.
    (by_class,) = view["admission"]["size_shares"].values()
    shares = by_class["plain"]
    assert sum(shares["offered"]) == sum(shares["admitted"]) == REQUESTS
    assert shares["protected_bands"] == []

    text = await (await client.get("/metrics")).text()
    assert 'sluice_admission_margin{class="plain",replica="r0"} 0.15' in text
    assert 'sluice_admission_attainment_ratio{class="plain",replica="r0"} 1.0' in text
    assert 'sluice_admission_prompt_quartile_decided{class="plain",quartile="1"}' in text
