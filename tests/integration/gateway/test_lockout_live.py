"""No lock-out, live: after a burst saturates a replica, it admits within seconds of going idle.

One emulated vLLM replica (``simulator.server.build_app``, in this process, on a real socket)
behind a real gateway that knows its hardware and scrapes its ``/metrics`` every second. The
class sets only its two targets. A burst of long prompts (several times what the replica takes
within the targets) is mostly refused; once the replica is idle (its metrics: nothing running or
waiting; nothing of the gateway in flight) short requests must be admitted again within 5 s
(stretched by the host's speed factor).

What a burst can leave behind differs from run to run on a shared host: a prefill share that an
idle window cannot lower (reset by the prediction service on an idle scrape), or a step fit made
slow by a host too busy to step at speed (probed by the admitter, ``SloAdmitter._probe``). Either
refused every request for good before.
"""

from __future__ import annotations

import asyncio
import time
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

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

PROFILE = "llama3-8b-h100"
HARDWARE = HardwareSettings(
    gpu="H100-SXM", model="Llama-3-8B", max_num_seqs=1024, max_num_batched_tokens=8192
)
PLAIN = AdmissionSettings.model_validate(
    {"classes": {"plain": {"ttft_target_s": 2.0, "tpot_target_s": 0.05}}, "default_class": "plain"}
)
#: The burst: 300 prompts of ~3000 tokens, 30 output tokens each, one every 10 ms: about twice
#: the prefill the replica does within the TTFT target, so most are refused however fast the
#: forecasts find its slots free again (150 every 20 ms saturated it only on a quick host, or
#: while its forecasts overstated the wait).
BURST = 300
BURST_EVERY_S = 0.01
#: Admission back within this long after the replica went idle (seconds), before the host's
#: speed factor.
BACK_WITHIN_S = 5.0

Client = TestClient[web.Request, web.Application]


async def gateway(aiohttp_server: Any, aiohttp_client: Any) -> Client:
    emulator: TestServer = await aiohttp_server(build_emulator(load_profile(PROFILE), seed=1))
    url = str(emulator.make_url("")).rstrip("/")
    store = SettingsStore(
        Settings(
            replicas=[ReplicaSettings(name="r0", url=url, hardware=HARDWARE)],
            health=HealthSettings(interval_s=30.0, timeout_s=5.0),
            server=ServerSettings(port=0),
            admission=PLAIN,
        )
    )
    client: Client = await aiohttp_client(build_app(store))
    return client


async def replica_idle(client: Client) -> bool:
    """The replica's latest scrape says nothing runs or waits there."""
    view = await (await client.get("/sluice/v1/replicas")).json()
    metrics = view["replicas"][0]["metrics"]
    return metrics is not None and metrics["num_running"] == 0 and metrics.get("num_waiting") == 0


async def test_an_idle_replica_admits_within_seconds_of_a_burst(
    aiohttp_server: Any, aiohttp_client: Any
) -> None:
    client = await gateway(aiohttp_server, aiohttp_client)
    model = str((await (await client.get("/v1/models")).json())["data"][0]["id"])
    statuses: list[int] = []

    async def send(body: dict[str, Any]) -> int:
        resp = await client.post("/v1/completions", json={"model": model, **body})
        await resp.read()
        return resp.status

    async def burst_one(i: int) -> None:
        # Each prompt its own from the first token: the replica caches prefixes (as vLLM does),
        # and a shared one would be prefilled once instead of saturating it.
        prompt = f"burst {i} " + "word " * 3000
        statuses.append(await send({"prompt": prompt, "max_tokens": 30, "ignore_eos": True}))

    tasks = []
    for i in range(BURST):
        tasks.append(asyncio.create_task(burst_one(i)))
        await asyncio.sleep(BURST_EVERY_S)
    await asyncio.gather(*tasks)
    assert statuses.count(429) > BURST // 2, "the burst must saturate the replica"

    async with asyncio.timeout(scaled(60.0)):
        while not await replica_idle(client):  # noqa: ASYNC110 (a scrape is the event)
            await asyncio.sleep(0.1)
    idle_at = time.monotonic()
    answers: list[tuple[float, int]] = []
    while time.monotonic() - idle_at < scaled(BACK_WITHIN_S) + 1.0:
        answers.append((round(time.monotonic() - idle_at, 2), await send({"prompt": "hi", "max_tokens": 8})))
        if answers[-1][1] == 200:
            break
        await asyncio.sleep(0.25)
    assert answers[-1][1] == 200, answers
