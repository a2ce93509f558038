"""A live gateway's 429 tells one story, and a one-token request is never refused on its TPOT.

One emulated vLLM replica (``simulator.server.build_app``, in this process, on a real socket)
behind a real gateway that knows its hardware (a roofline prior: forecasts from the first
request). The class sets only its targets, and a TPOT target below any decode step of the
replica: every request of two or more output tokens is refused on its TPOT, hopelessly; a
one-token request has no TPOT and goes through. Nothing asserts on elapsed time.
"""

from __future__ import annotations

import re
from typing import Any

import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.admission.config import AdmissionSettings
from gateway.app import build_app
from gateway.config.settings import ServerSettings, Settings
from gateway.config.store import SettingsStore
from gateway.keys import OUTCOME_LISTENERS
from gateway.observability.outcome import RequestOutcome
from gateway.replicas.config import HardwareSettings, HealthSettings, ReplicaSettings
from simulator.profile import load_profile
from simulator.server import build_app as build_emulator

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

PROFILE = "llama3-8b-h100"
HARDWARE = HardwareSettings(
    gpu="H100-SXM", model="Llama-3-8B", max_num_seqs=1024, max_num_batched_tokens=8192
)
#: Targets only; 1 ms per output token is below an idle decode step of the replica (~7 ms).
PLAIN = AdmissionSettings.model_validate(
    {"classes": {"plain": {"ttft_target_s": 2.0, "tpot_target_s": 0.001}}, "default_class": "plain"}
)


async def gateway(aiohttp_server: Any, aiohttp_client: Any) -> TestClient[web.Request, web.Application]:
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
    client: TestClient[web.Request, web.Application] = await aiohttp_client(build_app(store))
    return client


async def test_one_token_goes_through_and_a_tpot_refusal_cites_the_headers_tpot(
    aiohttp_server: Any, aiohttp_client: Any
) -> None:
    client = await gateway(aiohttp_server, aiohttp_client)
    model = str((await (await client.get("/v1/models")).json())["data"][0]["id"])

    hi = await client.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1})
    assert hi.status == 200, await hi.text()
    assert hi.headers["x-sluice-admission"] == "admitted"

    refused = await client.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 16})
    # Hopeless (even an idle replica misses the target): not a 429 but a 400 the SDKs never retry.
    assert refused.status == 400, await refused.text()
    error = (await refused.json())["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "slo_unattainable")
    assert refused.headers["x-sluice-admission-reason"] == "slo_unattainable"
    # The body names the forecast that failed with its target, in the header's numbers.
    found = re.search(r"time per output token ([0-9.]+) ms exceeds the 1 ms TPOT target", error["message"])
    assert found is not None, error["message"]
    assert found.group(1) == refused.headers["x-sluice-predicted-tpot-ms"]
    assert "idle replica" in error["message"]  # hopeless: retrying cannot help
    assert "admission.classes.plain.tpot_target_s" in error["message"]  # what to change
    assert "r0" not in error["message"]  # the replica's name is the operator's
    assert refused.headers.get("x-should-retry") == "false"
    assert "Retry-After" not in refused.headers


async def test_the_sdk_raises_a_hopeless_refusal_at_once_and_names_what_to_change(
    aiohttp_server: Any, aiohttp_client: Any
) -> None:
    """The real ``openai`` SDK (default retries) gets ``BadRequestError`` and sends it once."""
    client = await gateway(aiohttp_server, aiohttp_client)
    seen: list[RequestOutcome] = []
    client.app[OUTCOME_LISTENERS].append(seen.append)
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=2)
    model = (await sdk.models.list()).data[0].id

    with pytest.raises(openai.BadRequestError) as refused:
        await sdk.completions.create(model=model, prompt="hi", max_tokens=16)

    assert refused.value.code == "slo_unattainable"
    assert refused.value.response.headers["x-should-retry"] == "false"
    assert "1 ms TPOT target" in refused.value.message
    assert "admission.classes.plain.tpot_target_s" in refused.value.message
    assert [(o.status, o.reason) for o in seen] == [(400, "slo_unattainable")]  # never retried
    await sdk.close()
