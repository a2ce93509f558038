"""A live gateway under ``admission.policy: concurrency_cap`` queues and refuses as configured, and
a hot switch of policy releases its queue.

One emulated vLLM replica (``simulator.server.build_app``, in this process, on a real socket)
behind a real gateway. The cap is one request in flight; the interactive class queues at most two.
Nothing asserts on elapsed time: a queued request's fate follows from which request it waits
behind, and the long request it waits behind outlasts the TTL several times over. Which requests
find the queue with room is set by the test (it fills the queue first), not by the scheduler.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.admission.config import AdmissionSettings
from gateway.admission.live import ADMISSION
from gateway.app import build_app
from gateway.config.settings import ServerSettings, Settings
from gateway.config.store import SettingsStore
from gateway.keys import OUTCOME_LISTENERS
from gateway.observability.outcome import RequestOutcome
from gateway.replicas.config import HealthSettings, ReplicaSettings
from simulator.profile import load_profile
from simulator.server import build_app as build_emulator
from tests.support.speed import scaled

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

PROFILE = "llama3-8b-h100"
MODEL_BODY = {"prompt": "Tell me a story", "stream": True}
#: Decodes for seconds (hundreds of engine steps): every other request waits behind it.
LONG = {**MODEL_BODY, "max_tokens": 2000, "ignore_eos": True}
SHORT = {**MODEL_BODY, "max_tokens": 4}


def admission(policy: str, *, queue_ttl_s: float = 30.0) -> AdmissionSettings:
    data = AdmissionSettings().model_dump()
    data["policy"] = policy
    data["concurrency_cap"] = {"max_in_flight": 1, "queue_ttl_s": queue_ttl_s}
    # The class's own queue deadline is far: under concurrency_cap only the TTL applies.
    data["classes"]["interactive"].update(queue_capacity=2, max_queue_wait_s=30.0, ttft_target_s=30.0)
    return AdmissionSettings.model_validate(data)


async def gateway(
    aiohttp_server: Any, aiohttp_client: Any, settings: AdmissionSettings
) -> tuple[TestClient[web.Request, web.Application], SettingsStore, list[RequestOutcome]]:
    emulator: TestServer = await aiohttp_server(build_emulator(load_profile(PROFILE), seed=1))
    url = str(emulator.make_url("")).rstrip("/")
    store = SettingsStore(
        Settings(
            replicas=[ReplicaSettings(name="r0", url=url)],
            health=HealthSettings(interval_s=30.0, timeout_s=5.0),
            server=ServerSettings(port=0),
            admission=settings,
        )
    )
    app = build_app(store)
    outcomes: list[RequestOutcome] = []
    app[OUTCOME_LISTENERS].append(outcomes.append)
    return await aiohttp_client(app), store, outcomes


async def model_of(client: TestClient[web.Request, web.Application]) -> str:
    resp = await client.get("/v1/models")
    return str((await resp.json())["data"][0]["id"])


async def post(client: TestClient[web.Request, web.Application], body: dict[str, Any]) -> tuple[int, Any]:
    resp = await client.post("/v1/completions", json=body)
    text = await resp.text()
    return resp.status, (json.loads(text) if resp.status != 200 else text)


async def hold_the_slot(client: TestClient[web.Request, web.Application], body: dict[str, Any]) -> Any:
    """Start the long stream and wait for its first chunk: it holds the replica's one slot."""
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200
    assert (await resp.content.readline()).startswith(b"data:")
    return resp


async def test_concurrency_cap_queues_up_to_capacity_and_refuses_past_the_ttl(
    aiohttp_server: Any, aiohttp_client: Any
) -> None:
    # The TTL outlasts sending the two requests that find the queue full (milliseconds), however
    # busy the host; the long stream (seconds of decoding) outlasts the TTL.
    client, _, outcomes = await gateway(
        aiohttp_server, aiohttp_client, admission("concurrency_cap", queue_ttl_s=scaled(1.0))
    )
    live = client.app[ADMISSION]
    model = await model_of(client)
    long = await hold_the_slot(client, {**LONG, "model": model})
    try:
        # Two fill the queue first; the two sent then find it full. Sent all at once, a queued
        # request's TTL could pass before the last ones arrived, and they would find room.
        queued = [asyncio.create_task(post(client, {**SHORT, "model": model})) for _ in range(2)]
        async with asyncio.timeout(60):
            while live.engine.queued() < 2:  # noqa: ASYNC110 (no event says a request was queued)
                await asyncio.sleep(0.01)
        full = await asyncio.wait_for(
            asyncio.gather(*(post(client, {**SHORT, "model": model}) for _ in range(2))), timeout=20
        )
        waited = await asyncio.wait_for(asyncio.gather(*queued), timeout=20)
    finally:
        long.close()
    answers = [*waited, *full]
    codes = sorted(body["error"]["code"] for status, body in answers if status == 429)
    assert [status for status, _ in answers] == [429] * 4, answers
    # Two waited (queue capacity 2) and were refused when their TTL passed; two found it full.
    assert [body["error"]["code"] for _, body in waited] == ["deadline_exceeded"] * 2, waited
    assert [body["error"]["code"] for _, body in full] == ["overloaded"] * 2, full
    reasons = sorted(o.reason or "" for o in outcomes if o.status == 429)
    assert reasons == codes


async def test_a_hot_switch_to_no_admission_releases_the_queue(
    aiohttp_server: Any, aiohttp_client: Any
) -> None:
    client, store, _ = await gateway(aiohttp_server, aiohttp_client, admission("concurrency_cap"))
    live = client.app[ADMISSION]
    model = await model_of(client)
    long = await hold_the_slot(client, {**LONG, "model": model})
    try:
        waiting = [asyncio.create_task(post(client, {**SHORT, "model": model})) for _ in range(2)]
        async with asyncio.timeout(60):
            while live.engine.queued() < 2:  # noqa: ASYNC110 (no event says a request was queued)
                await asyncio.sleep(0.01)
        assert not any(t.done() for t in waiting), "capped at one: they wait behind the long stream"
        # Hot reload to no admission: the queue is re-decided at once, while the long one still runs.
        store.swap(store.current.model_copy(update={"admission": admission("none")}))
        answers = await asyncio.wait_for(asyncio.gather(*waiting), timeout=60)
        assert [status for status, _ in answers] == [200, 200], answers
        assert not long.content.at_eof(), "served before the slot freed: the switch released them"
    finally:
        long.close()
