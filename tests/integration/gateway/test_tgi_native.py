"""TGI's native API through the gateway, in front of a mixed fleet of real emulator processes.

Two emulators run the same profile (so they serve the same model id): one imitates vLLM, one TGI
(``sluice sim --engine tgi``). The OpenAI routes may use either; ``/generate``,
``/generate_stream`` and TGI's compat ``POST /`` must reach the TGI one only, with the same
admission and usage accounting as the OpenAI routes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from gateway.app import build_app
from gateway.config.settings import Settings
from gateway.config.store import SettingsStore
from gateway.keys import OUTCOME_LISTENERS
from gateway.observability.outcome import RequestOutcome
from gateway.replicas.config import EmulatorSettings, HealthSettings
from tests.support.procs import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

PROFILE = "llama3-8b-h100"


@dataclass
class Fleet:
    client: TestClient[web.Request, web.Application]
    outcomes: list[RequestOutcome]
    model: str


@pytest.fixture
async def fleet(aiohttp_client: Any) -> Fleet:
    settings = Settings(
        emulators=[
            EmulatorSettings(name="vl", port=free_port(), profile=PROFILE, seed=1),
            EmulatorSettings(name="tg", port=free_port(), profile=PROFILE, seed=2, engine="tgi"),
        ],
        health=HealthSettings(interval_s=30.0, timeout_s=5.0),
    )
    app = build_app(SettingsStore(settings))
    outcomes: list[RequestOutcome] = []
    app[OUTCOME_LISTENERS].append(outcomes.append)
    client = await aiohttp_client(app)
    models = (await (await client.get("/v1/models")).json())["data"]
    (model,) = models
    return Fleet(client, outcomes, model["id"])


def sse_payloads(body: str) -> list[Any]:
    return [json.loads(line[6:]) for line in body.split("\n") if line.startswith("data: ")]


async def test_generate_goes_to_tgi_and_is_accounted(fleet: Fleet) -> None:
    for _ in range(4):
        resp = await fleet.client.post(
            "/generate", json={"inputs": "Hello there", "parameters": {"max_new_tokens": 5}}
        )
        body = await resp.json()
        assert resp.status == 200, body
        assert isinstance(body["generated_text"], str)
        assert "details" not in body, "Sluice asked for details; the client did not, so they are removed"

    served = [o for o in fleet.outcomes if o.path == "/generate"]
    assert [o.replica for o in served] == ["tg"] * 4
    assert all(o.completion_tokens is not None and 1 <= o.completion_tokens <= 5 for o in served)
    assert all(o.decision == "admitted" for o in served)


async def test_generate_with_details_keeps_them(fleet: Fleet) -> None:
    resp = await fleet.client.post(
        "/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 3, "details": True}}
    )
    body = await resp.json()

    assert resp.status == 200, body
    (outcome,) = fleet.outcomes
    assert body["details"]["generated_tokens"] == outcome.completion_tokens
    assert 1 <= body["details"]["generated_tokens"] <= 3


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        pytest.param("/generate_stream", {}, id="generate_stream"),
        pytest.param("/", {"stream": True}, id="compat-root-stream"),
    ],
)
async def test_stream_counts_every_token_event(fleet: Fleet, path: str, extra: dict[str, Any]) -> None:
    resp = await fleet.client.post(
        path, json={"inputs": "Hello", "parameters": {"max_new_tokens": 6}, **extra}
    )
    body = await resp.text()

    assert resp.status == 200, body
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = sse_payloads(body)
    assert events, body
    assert all(isinstance(e["token"], dict) for e in events)
    assert [e["generated_text"] is not None for e in events] == [False] * (len(events) - 1) + [True]
    (outcome,) = fleet.outcomes
    assert (outcome.replica, outcome.stream, outcome.error) == ("tg", True, None)
    assert outcome.completion_tokens == len(events)
    assert outcome.ttft_s is not None
    assert outcome.tokens_streamed == len(events)


async def test_compat_root_without_stream_is_one_json_answer(fleet: Fleet) -> None:
    resp = await fleet.client.post("/", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}})
    body = await resp.json()

    assert resp.status == 200, body
    assert isinstance(body["generated_text"], str)
    (outcome,) = fleet.outcomes
    assert (outcome.replica, outcome.stream) == ("tg", False)


async def test_openai_routes_still_use_the_whole_fleet(fleet: Fleet) -> None:
    replicas = set()
    for _ in range(6):
        resp = await fleet.client.post(
            "/v1/completions", json={"model": fleet.model, "prompt": "Hello", "max_tokens": 2}
        )
        assert resp.status == 200, await resp.text()
        replicas.add(fleet.outcomes[-1].replica)
    assert replicas <= {"vl", "tg"}
    assert replicas, "served somewhere"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        pytest.param({}, "inputs", id="no-inputs"),
        pytest.param(
            {"inputs": "x", "parameters": {"max_new_tokens": "ten"}},
            "parameters.max_new_tokens",
            id="bad-cap",
        ),
    ],
)
async def test_bad_native_body_is_a_400_before_any_replica(
    fleet: Fleet, body: dict[str, Any], param: str
) -> None:
    resp = await fleet.client.post("/generate", json=body)
    payload = await resp.json()

    assert resp.status == 400
    assert payload["error"]["param"] == param
    assert [o.replica for o in fleet.outcomes] == [None]
