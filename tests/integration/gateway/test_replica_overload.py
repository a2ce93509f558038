"""A replica's own overload refusal never reaches the client: Sluice retries elsewhere or answers its
own 429 with a Retry-After.

The replicas are real emulated TGI servers (``simulator.server.build_app(engine="tgi")``, in this
process, on real sockets) whose router refuses past ``max_concurrent_requests`` exactly as TGI's
does: 429 ``{"error": "Model is overloaded", "error_type": "overloaded"}`` for a plain request, a
200 stream whose only event is that error for a stream. Admission is ``admit_all`` so that Sluice's
own forecast does not hold requests back before the replica gets to refuse them.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.admission.config import AdmissionSettings
from gateway.app import build_app
from gateway.config.settings import ServerSettings, Settings
from gateway.config.store import SettingsStore
from gateway.keys import OUTCOME_LISTENERS, REGISTRY
from gateway.observability.outcome import RequestOutcome
from gateway.proxy.forward import MAX_PLACEMENTS
from gateway.replicas.config import HealthSettings, ReplicaSettings
from simulator.profile import load_profile
from simulator.server import build_app as build_emulator

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

PROFILE = "llama3-8b-h100"
#: Long enough that concurrent requests overlap on the replica.
BODY = {"inputs": "Tell me a story", "parameters": {"max_new_tokens": 48}}


async def tgi_replica(aiohttp_server: Any, limit: int, seed: int) -> str:
    app = build_emulator(load_profile(PROFILE), seed=seed, engine="tgi", max_concurrent_requests=limit)
    server: TestServer = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/")


async def gateway(
    aiohttp_client: Any, replicas: dict[str, str]
) -> tuple[TestClient[web.Request, web.Application], list[RequestOutcome], web.Application]:
    settings = Settings(
        replicas=[ReplicaSettings(name=name, url=url, backend="tgi") for name, url in replicas.items()],
        health=HealthSettings(interval_s=30.0, timeout_s=5.0),
        server=ServerSettings(port=0),
        admission=AdmissionSettings(policy="admit_all"),
    )
    app = build_app(SettingsStore(settings))
    outcomes: list[RequestOutcome] = []
    app[OUTCOME_LISTENERS].append(outcomes.append)
    return await aiohttp_client(app), outcomes, app


async def burst(
    client: TestClient[web.Request, web.Application], path: str, n: int
) -> list[tuple[int, str, Any]]:
    async def one() -> tuple[int, str, Any]:
        resp = await client.post(path, json=BODY)
        return resp.status, await resp.text(), resp.headers

    return await asyncio.gather(*(one() for _ in range(n)))


@pytest.mark.parametrize("path", ["/generate", "/generate_stream"])
async def test_refused_requests_are_placed_on_another_replica(
    aiohttp_server: Any, aiohttp_client: Any, path: str
) -> None:
    small = await tgi_replica(aiohttp_server, limit=1, seed=1)
    large = await tgi_replica(aiohttp_server, limit=64, seed=2)
    client, outcomes, app = await gateway(aiohttp_client, {"small": small, "large": large})

    answers = await burst(client, path, 8)

    assert [status for status, _, _ in answers] == [200] * 8, answers
    assert not any("Model is overloaded" in text for _, text, _ in answers)
    served = [o for o in outcomes if o.path == path]
    assert all(o.error is None and o.completion_tokens for o in served)
    assert {o.replica for o in served} == {"small", "large"}, "both took some: the burst overlapped"
    small_replica = app[REGISTRY].get("small")
    assert small_replica is not None
    assert small_replica.saturated_until > 0, "the refusal was noticed"


@pytest.mark.parametrize("path", ["/generate", "/generate_stream"])
async def test_when_every_replica_refuses_the_client_gets_sluices_429(
    aiohttp_server: Any, aiohttp_client: Any, path: str
) -> None:
    only = await tgi_replica(aiohttp_server, limit=1, seed=3)
    client, outcomes, _ = await gateway(aiohttp_client, {"only": only})

    answers = await burst(client, path, 6)

    statuses = sorted(status for status, _, _ in answers)
    assert 200 in statuses, answers
    refused = [(text, headers) for status, text, headers in answers if status != 200]
    assert refused, "the burst overlapped on a replica that takes one request at a time"
    for text, headers in refused:
        assert "Model is overloaded" not in text, "never the replica's raw refusal"
        error = json.loads(text)["error"]
        assert (error["type"], error["code"]) == ("overloaded", "overloaded")
        assert int(headers["Retry-After"]) >= 1
        assert int(headers["retry-after-ms"]) > 0
    assert sorted(o.status or 0 for o in outcomes if o.path == path) == statuses


async def test_a_request_every_replica_refuses_in_turn_gets_sluices_429(
    aiohttp_server: Any, aiohttp_client: Any
) -> None:
    """As many replicas as a request may be placed on, each taking one request at a time and held
    busy by a long stream of its own (sent to it directly, not through Sluice): one request tries
    each in turn, then gets Sluice's own 429 (the out-of-placements path, not the "every replica
    saturated" answer of a later placement), and its outcome names the last replica it tried."""
    names = [f"r{i}" for i in range(MAX_PLACEMENTS)]
    replicas = {name: await tgi_replica(aiohttp_server, limit=1, seed=i) for i, name in enumerate(names)}
    client, outcomes, _ = await gateway(aiohttp_client, replicas)
    hold = {"inputs": "Hold the only permit", "parameters": {"max_new_tokens": 4000}}
    async with aiohttp.ClientSession() as direct:
        holders = [await direct.post(url + "/generate_stream", json=hold) for url in replicas.values()]
        try:
            for holder in holders:
                assert holder.status == 200
                assert b"data:" in await holder.content.readline()  # streaming: the permit is held

            resp = await client.post("/generate", json=BODY)
            error = (await resp.json())["error"]
        finally:
            for holder in holders:
                holder.close()

    assert resp.status == 429
    assert (error["type"], error["code"]) == ("overloaded", "overloaded")
    assert "are overloaded right now" in error["message"], error
    assert int(resp.headers["Retry-After"]) >= 1
    (outcome,) = [o for o in outcomes if o.path == "/generate"]
    assert (outcome.status, outcome.error) == (429, "overloaded")
    assert outcome.replica in names


async def test_an_auto_replica_found_to_run_tgi_serves_the_native_routes(
    aiohttp_server: Any, aiohttp_client: Any
) -> None:
    """``backend: auto``: the scraper detects TGI from its ``/metrics``; native requests then reach it."""
    url = await tgi_replica(aiohttp_server, limit=64, seed=4)
    settings = Settings(
        replicas=[ReplicaSettings(name="found", url=url, backend="auto")],
        health=HealthSettings(interval_s=30.0, timeout_s=5.0),
        server=ServerSettings(port=0),
        admission=AdmissionSettings(policy="admit_all"),
    )
    app = build_app(SettingsStore(settings))
    client = await aiohttp_client(app)
    found = app[REGISTRY].get("found")
    assert found is not None
    for _ in range(100):  # the first scrape comes within a scrape interval (1 s)
        if found.engine is not None:
            break
        await asyncio.sleep(0.1)

    assert found.engine == "tgi"
    resp = await client.post("/generate", json=BODY)
    assert resp.status == 200, await resp.text()
    assert isinstance((await resp.json())["generated_text"], str)
