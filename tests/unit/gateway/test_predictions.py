"""The live prediction wiring: forecast headers on every proxied response, the scraper and the
prediction service following the fleet, the admin view, and scrapes that never hold requests up.

Fake replicas answer ``/metrics`` with a 404, garbage, a real vLLM scrape, or not at all, and their
completion routes with streams, bodies or errors; the emulator cannot be told to misbehave so.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.pytest_plugin import AiohttpClient

from gateway.keys import PREDICTION_SERVICE, PREDICTIONS, REGISTRY, SCRAPER
from gateway.prediction import PredictionService
from gateway.prediction.live import (
    PREDICTED_TPOT_HEADER,
    PREDICTED_TTFT_HEADER,
    PREDICTION_HEADER,
    REPLICA_HEADER,
    forecast_headers,
)
from gateway.replicas.config import HardwareSettings, ReplicaSettings, ScrapeSettings
from predictor import Forecast, ForecastReason
from tests.unit.gateway.conftest import StartGateway, StartReplica
from tests.unit.gateway.fakes import (
    H100_LLAMA3_8B,
    MODEL,
    FakeReplica,
    Gateway,
    chat_chunk,
    gateway_settings,
    make_app,
    sse,
    wait_for,
)
from tests.unit.scrape.scrapes import REAL_032, fixture_text

CHAT: dict[str, Any] = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hello " * 50}],
    "stream": True,
    "max_tokens": 32,
}
TTFT_FORMAT = re.compile(r"^\d+\.\d$")
TPOT_FORMAT = re.compile(r"^\d+\.\d\d$")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _status(code: int) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "nope"}}, status=code)

    return handler


async def _cut_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(sse(chat_chunk("a")))
    assert request.transport is not None
    request.transport.close()
    return response


# -- headers ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("handler", "body", "status"),
    [
        pytest.param(None, CHAT, 200, id="stream"),
        pytest.param(None, {**CHAT, "stream": False}, 200, id="non-stream"),
        pytest.param(None, {"model": MODEL, "prompt": "hi", "max_tokens": 8}, 200, id="completions-endpoint"),
        pytest.param(_status(400), CHAT, 400, id="replica-4xx-relayed"),
        pytest.param(_status(500), {**CHAT, "stream": False}, 502, id="replica-5xx-as-502"),
        pytest.param(_status(503), {**CHAT, "stream": False}, 429, id="replica-overloaded-as-429"),
        pytest.param(_cut_stream, CHAT, 200, id="stream-cut-midway"),
    ],
)
@pytest.mark.parametrize(
    ("hardware", "prediction", "numbers"),
    [
        pytest.param(H100_LLAMA3_8B, "ok", True, id="known-hardware"),
        pytest.param(HardwareSettings(), ForecastReason.NO_STEP_MODEL.value, False, id="nothing-known"),
    ],
)
async def test_every_proxied_response_carries_the_forecast(
    start_replica: StartReplica,
    start_gateway: StartGateway,
    handler: Handler | None,
    body: dict[str, Any],
    status: int,
    hardware: HardwareSettings,
    prediction: str,
    numbers: bool,
) -> None:
    """Fake replicas answering normally, with errors, or breaking the stream; their /metrics is a
    real vLLM scrape, scraped once. Known hardware gives a roofline forecast from the first
    minute; with nothing known there is no step model until the fit has observations."""
    _, url = await start_replica(FakeReplica(handler=handler, metrics_text=fixture_text(REAL_032)))
    gw = await start_gateway(settings=gateway_settings({"r1": url}, hardware=hardware))
    await gw.app[SCRAPER].scrape_once("r1")
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"

    resp = await gw.client.post(path, json=body)
    await resp.read()

    assert resp.status == status
    assert resp.headers[REPLICA_HEADER] == "r1"
    assert resp.headers[PREDICTION_HEADER] == prediction
    if status == 429:  # the replica's refusal: admission's headers say why this one was refused
        assert resp.headers["x-sluice-admission"] == "rejected"
        assert resp.headers["x-sluice-admission-reason"] == "replicas_saturated"
    if numbers:
        assert TTFT_FORMAT.match(resp.headers[PREDICTED_TTFT_HEADER])
        assert TPOT_FORMAT.match(resp.headers[PREDICTED_TPOT_HEADER])
        assert float(resp.headers[PREDICTED_TTFT_HEADER]) > 0
        assert float(resp.headers[PREDICTED_TPOT_HEADER]) > 0
    else:
        assert PREDICTED_TTFT_HEADER not in resp.headers
        assert PREDICTED_TPOT_HEADER not in resp.headers


@pytest.mark.parametrize(
    ("body", "status"),
    [
        pytest.param({**CHAT, "model": "no-such-model"}, 404, id="unknown-model"),
        pytest.param({"model": MODEL}, 400, id="invalid-request"),
    ],
)
async def test_requests_never_sent_to_a_replica_carry_no_forecast(
    start_replica: StartReplica, start_gateway: StartGateway, body: dict[str, Any], status: int
) -> None:
    _, url = await start_replica(FakeReplica())
    gw = await start_gateway({"r1": url})

    resp = await gw.client.post("/v1/chat/completions", json=body)

    assert resp.status == status
    assert REPLICA_HEADER not in resp.headers
    assert PREDICTION_HEADER not in resp.headers


NAN = math.nan


@pytest.mark.parametrize(
    ("forecast", "expected"),
    [
        pytest.param(
            Forecast(0.01234, 0.007891, 0.0, True, None, 64.0, 0.5),
            {PREDICTION_HEADER: "ok", PREDICTED_TTFT_HEADER: "12.3", PREDICTED_TPOT_HEADER: "7.89"},
            id="valid",
        ),
        pytest.param(
            Forecast(1.5, 0.02, 0.0, False, ForecastReason.STALE_STATE, 64.0, 0.5),
            {
                PREDICTION_HEADER: "stale_state",
                PREDICTED_TTFT_HEADER: "1500.0",
                PREDICTED_TPOT_HEADER: "20.00",
            },
            id="stale-keeps-numbers",
        ),
        pytest.param(
            Forecast(NAN, NAN, NAN, False, ForecastReason.NO_STEP_MODEL, 64.0, 0.5),
            {PREDICTION_HEADER: "no_step_model"},
            id="no-step-model",
        ),
        pytest.param(
            Forecast(NAN, NAN, NAN, False, ForecastReason.EXCEEDS_MAX_MODEL_LEN, 64.0, 0.5),
            {PREDICTION_HEADER: "exceeds_max_model_len"},
            id="too-long",
        ),
        pytest.param(None, {PREDICTION_HEADER: "internal_error"}, id="service-failed"),
    ],
)
def test_forecast_headers(forecast: Forecast | None, expected: dict[str, str]) -> None:
    assert forecast_headers("r1", forecast) == {REPLICA_HEADER: "r1", **expected}


class BrokenService(PredictionService):
    """A prediction service whose every entry point raises: the gateway must serve regardless."""

    def forecast(self, *args: Any, **kwargs: Any) -> Forecast:
        raise RuntimeError("forecast exploded")

    def on_finished(self, **kwargs: Any) -> None:
        raise RuntimeError("on_finished exploded")

    def estimate_prompt_tokens(self, model: str, prompt_chars: int, tenant: str | None = None) -> int:
        raise RuntimeError("estimate exploded")

    def fewest_prompt_tokens(self, prompt_chars: int) -> int:
        raise RuntimeError("fewest exploded")


async def test_a_failing_prediction_service_never_fails_a_request(
    start_replica: StartReplica, aiohttp_client: AiohttpClient
) -> None:
    _, url = await start_replica(FakeReplica())
    app, _, outcomes = make_app(gateway_settings({"r1": url}, hardware=H100_LLAMA3_8B))
    app[PREDICTION_SERVICE] = BrokenService()
    client = await aiohttp_client(app)

    for stream in (True, False):
        resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        await resp.read()
        assert resp.status == 200
        # Admission forecasts with the step model itself; the service's own forecast is not needed.
        assert resp.headers[PREDICTION_HEADER] in {"ok", "stale_state"}
    assert [o.status for o in outcomes] == [200, 200]


# -- following the fleet ----------------------------------------------------------------------------


def service_facts(gw: Gateway, name: str) -> dict[str, Any]:
    replicas = gw.app[PREDICTION_SERVICE].describe()["replicas"]
    assert isinstance(replicas, dict)
    facts: dict[str, Any] = replicas[name]["facts"]
    return facts


async def test_replica_facts_come_from_settings_and_the_model_list(
    start_replica: StartReplica, start_gateway: StartGateway
) -> None:
    """A fake replica whose /v1/models gives max_model_len 4096."""
    _, url = await start_replica(FakeReplica())
    hardware = HardwareSettings(gpu="NVIDIA H100 80GB HBM3", model="Llama-3-8B", max_num_seqs=64)
    gw = await start_gateway(settings=gateway_settings({"r1": url}, hardware=hardware))

    assert service_facts(gw, "r1") == {
        "gpu": "H100-SXM",
        "model": "Llama-3-8B",
        "tensor_parallel": 1,
        "max_num_seqs": 64,
        "max_num_batched_tokens": 8192,  # not stated: the service's default
        "max_model_len": 4096,
    }


async def test_reload_adds_removes_and_updates_replicas(
    start_replica: StartReplica, start_gateway: StartGateway
) -> None:
    """Two fake replicas; a reload removes one, adds another and changes the first's hardware."""
    _, url_a = await start_replica(FakeReplica())
    _, url_b = await start_replica(FakeReplica())
    _, url_c = await start_replica(FakeReplica())
    gw = await start_gateway({"a": url_a, "b": url_b})
    scraper, service = gw.app[SCRAPER], gw.app[PREDICTION_SERVICE]
    a_before = gw.app[REGISTRY].get("a")
    assert scraper.replicas() == ["a", "b"]
    assert service.replicas() == ("a", "b")

    new_replicas = [
        ReplicaSettings(name="a", url=url_a, hardware=H100_LLAMA3_8B),
        ReplicaSettings(name="c", url=url_c),
    ]
    gw.store.swap(gw.store.current.model_copy(update={"replicas": new_replicas}))

    assert scraper.replicas() == ["a", "c"]
    assert set(service.replicas()) == {"a", "c"}
    assert gw.app[REGISTRY].get("a") is a_before  # hardware alone: same object, same health
    assert service_facts(gw, "a")["gpu"] == "H100-SXM"
    assert (await scraper.scrape_once("c")).name == "c"


async def test_a_new_url_gets_a_fresh_scrape_target(
    start_replica: StartReplica, start_gateway: StartGateway
) -> None:
    """A reload moves replica ``a`` to another fake replica: it must be scraped there."""
    old, new = FakeReplica(), FakeReplica()
    _, url_old = await start_replica(old)
    _, url_new = await start_replica(new)
    gw = await start_gateway({"a": url_old})

    gw.store.swap(gw.store.current.model_copy(update={"replicas": [ReplicaSettings(name="a", url=url_new)]}))
    before = new.metrics_scrapes
    await gw.app[SCRAPER].scrape_once("a")

    assert new.metrics_scrapes == before + 1


# -- scrapes that fail never hold requests up -------------------------------------------------------


@pytest.mark.parametrize(
    ("metrics_text", "gate", "reason"),
    [
        pytest.param(None, False, "answered 404", id="not-found"),
        pytest.param("this is { not prometheus", False, "not Prometheus text", id="garbage"),
        pytest.param(None, True, "timed out", id="hangs"),
    ],
)
async def test_failing_scrapes_mark_stale_and_requests_go_on(
    start_replica: StartReplica,
    start_gateway: StartGateway,
    metrics_text: str | None,
    gate: bool,
    reason: str,
) -> None:
    """A fake replica whose /metrics is missing, garbage, or never answers (scrape timeout 0.2 s)."""
    replica = FakeReplica(metrics_text=metrics_text, metrics_gate=asyncio.Event() if gate else None)
    _, url = await start_replica(replica)
    scrape = ScrapeSettings(interval_s=0.25, timeout_s=0.2, window_s=1.0)
    gw = await start_gateway(settings=gateway_settings({"r1": url}, hardware=H100_LLAMA3_8B, scrape=scrape))

    await wait_for(lambda: (s := gw.app[SCRAPER].latest("r1")) is not None and s.stale, timeout_s=10)
    snapshot = gw.app[SCRAPER].latest("r1")
    assert snapshot is not None
    assert snapshot.stale_reason is not None
    assert reason in snapshot.stale_reason
    for stream in (True, False):
        resp = await gw.client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        await resp.read()
        assert resp.status == 200
        assert resp.headers[PREDICTION_HEADER] in {"ok", "stale_state"}
    if replica.metrics_gate is not None:
        replica.metrics_gate.set()


async def test_a_real_scrape_feeds_the_service(
    start_replica: StartReplica, start_gateway: StartGateway
) -> None:
    """A fake replica serving a real vLLM 0.32 scrape: the snapshot is fresh and the service has it."""
    _, url = await start_replica(FakeReplica(metrics_text=fixture_text(REAL_032)))
    gw = await start_gateway(settings=gateway_settings({"r1": url}, hardware=H100_LLAMA3_8B))

    snapshot = await gw.app[SCRAPER].scrape_once("r1")

    assert not snapshot.stale
    assert snapshot.num_running is not None
    described = gw.app[PREDICTION_SERVICE].describe()["replicas"]
    assert isinstance(described, dict)
    assert described["r1"]["snapshots"] >= 1
    assert described["r1"]["stale"] is False


# -- the admin view -----------------------------------------------------------------------------------


async def test_admin_view_lists_replicas_snapshots_and_fits(
    start_replica: StartReplica, start_gateway: StartGateway
) -> None:
    """One fake replica with a real scrape, one whose /metrics is a 404."""
    _, url_good = await start_replica(FakeReplica(metrics_text=fixture_text(REAL_032)))
    _, url_bad = await start_replica(FakeReplica())
    gw = await start_gateway(
        settings=gateway_settings({"good": url_good, "bad": url_bad}, hardware=H100_LLAMA3_8B)
    )
    await gw.app[SCRAPER].scrape_once("good")
    await gw.app[SCRAPER].scrape_once("bad")

    resp = await gw.client.get("/sluice/v1/replicas")
    body = await resp.json()

    assert resp.status == 200
    by_name = {r["name"]: r for r in body["replicas"]}
    assert set(by_name) == {"good", "bad"}
    assert by_name["good"]["state"] == "healthy"
    assert by_name["good"]["in_flight"] == 0
    assert by_name["good"]["metrics"]["stale"] is False
    assert by_name["good"]["metrics"]["age_s"] >= 0
    assert by_name["bad"]["metrics"]["stale"] is True
    assert "404" in by_name["bad"]["metrics"]["stale_reason"]
    # The KV cache as scraped (``sluice plan --from-gateway`` reads it).
    assert by_name["good"]["metrics"]["kv_capacity_tokens"] > 0
    assert by_name["good"]["metrics"]["block_size"] > 0
    fits = body["prediction"]["replicas"]
    assert set(fits) == {"good", "bad"}
    assert fits["good"]["fit"]["params"]
    assert gw.app[PREDICTIONS].describe()["replicas"][0]["name"] == "good"
