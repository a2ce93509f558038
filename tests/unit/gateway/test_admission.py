"""Admission in the live gateway: the error mapping and every path a request can take.

The error mapping is checked on values (``admission_error`` of each ``Reject``); the paths through
real HTTP: a gateway in front of fake replicas whose answers a test can hold back (the emulator
cannot be told to wait for a test). Replicas with no hardware stated have no step model, so
admission lets ``unmodelled_max_in_flight`` requests onto each and holds the rest: that gives the
queue paths without depending on forecast numbers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.admission import (
    AdmissionSettings,
    Blocker,
    ClassSettings,
    Outcome,
    Reject,
    RejectReason,
    RetryAfterPolicy,
    RetryAfterSettings,
    ShadowSettings,
    engine,
)
from gateway.admission.live import ADMISSION
from gateway.admission.retry_after import RefusalReason
from gateway.config.settings import Settings
from gateway.http.errors import SHOULD_RETRY, AdmissionRejected, admission_error, error_response
from gateway.keys import HEALTH, REGISTRY, SCRAPER
from gateway.observability.outcome import RequestOutcome
from gateway.replicas.config import HealthSettings, ScrapeSettings
from gateway.replicas.registry import ReplicaState
from tests.unit.gateway.conftest import StartGateway, StartReplica
from tests.unit.gateway.fakes import (
    H100_LLAMA3_8B,
    MODEL,
    FakeReplica,
    gateway_settings,
    make_app,
    wait_for,
)

CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}

# -- the error mapping: one Reject -> status, headers, body ----------------------------------------

_RETRY = RetryAfterPolicy(RetryAfterSettings(jitter_fraction=0.0), random.Random(0))


def _reject(reason: RejectReason, retry_s: float | None) -> Reject:
    retry = None if retry_s is None else _RETRY.after(retry_s)
    return Reject(reason, retry, None, f"refused: {reason.value}", Blocker.TTFT)


@pytest.mark.parametrize(
    ("reject", "status", "error_type", "headers"),
    [
        pytest.param(
            _reject(RejectReason.OVERLOADED, 2.5),
            429,
            "overloaded",
            {"Retry-After": "3", "retry-after-ms": "2500"},
            id="overloaded",
        ),
        pytest.param(
            _reject(RejectReason.SLO_UNATTAINABLE, 0.25),
            429,
            "slo_unattainable",
            {"Retry-After": "1", "retry-after-ms": "250"},
            id="slo-unattainable",
        ),
        pytest.param(
            _reject(RejectReason.SLO_UNATTAINABLE, None),
            400,  # not load: a configuration mismatch; the SDKs raise BadRequestError, never retry
            "invalid_request_error",
            {SHOULD_RETRY: "false"},
            id="slo-unattainable-hopeless",
        ),
        pytest.param(
            _reject(RejectReason.DEADLINE_EXCEEDED, 61.0),
            429,
            "deadline_exceeded",
            {"Retry-After": "60", "retry-after-ms": "60000"},
            id="deadline-exceeded-capped-at-60s",
        ),
        pytest.param(
            _reject(RejectReason.PROMPT_TOO_LARGE, None),
            400,
            "invalid_request_error",
            {SHOULD_RETRY: "false"},
            id="prompt-too-large",
        ),
        pytest.param(
            _reject(RejectReason.NO_HEALTHY_REPLICA, 2.0),
            503,
            "service_unavailable_error",
            {"Retry-After": "2", "retry-after-ms": "2000"},
            id="no-healthy-replica",
        ),
    ],
)
def test_each_reason_maps_to_status_headers_and_body(
    reject: Reject, status: int, error_type: str, headers: dict[str, str]
) -> None:
    err = admission_error(reject)
    response = error_response(err)
    assert response.status == status
    assert {k: v for k, v in response.headers.items() if k != "Content-Type"} == headers
    assert response.body is not None
    body = json.loads(bytes(response.body))  # type: ignore[arg-type]
    assert body == {
        "error": {
            "message": reject.message,
            "type": error_type,
            "param": body["error"]["param"],
            "code": reject.reason.value,
        }
    }


def test_the_rejection_types_carry_what_the_outcome_records() -> None:
    err = admission_error(_reject(RejectReason.OVERLOADED, 1.5))
    assert isinstance(err, AdmissionRejected)
    assert err.retry_after_s == pytest.approx(1.5)
    assert (
        admission_error(_reject(RejectReason.PROMPT_TOO_LARGE, None)).reason == RefusalReason.PROMPT_TOO_LARGE
    )


# -- the handler paths --------------------------------------------------------------------------------


class Gate:
    """Fake replica handler: answers only once ``open`` is set; counts the requests it holds."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.holding = 0

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        self.holding += 1
        try:
            await self.open.wait()
        finally:
            self.holding -= 1
        return web.json_response(
            {
                "id": "x",
                "object": "chat.completion",
                "model": MODEL,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
            }
        )


def settings_with(url: str, admission: AdmissionSettings, *, known: bool = False) -> Settings:
    base = gateway_settings({"r1": url}, hardware=H100_LLAMA3_8B if known else None)
    return base.model_copy(update={"admission": admission})


def one_in_flight(**interactive: Any) -> AdmissionSettings:
    """An unmodelled replica takes one request at a time; the interactive class as given."""
    return AdmissionSettings(
        unmodelled_max_in_flight=1,
        retry_after=RetryAfterSettings(no_replica_s=0.2),
        classes={"interactive": ClassSettings(**interactive)},
    )


def admission_headers(resp: aiohttp.ClientResponse) -> dict[str, str]:
    return {k.lower(): v for k, v in resp.headers.items() if k.lower().startswith("x-sluice-")}


async def test_admitted_request_goes_to_the_chosen_replica_with_its_prediction(
    start_replica: StartReplica, start_gateway: StartGateway
) -> None:
    _, url = await start_replica(FakeReplica())
    gw = await start_gateway(settings=settings_with(url, AdmissionSettings(), known=True))

    resp = await gw.client.post("/v1/chat/completions", json=CHAT)
    await resp.read()

    assert resp.status == 200
    headers = admission_headers(resp)
    assert headers["x-sluice-admission"] == "admitted"
    assert headers["x-sluice-admission-reason"] == "ok"
    assert headers["x-sluice-class"] == "interactive"
    assert headers["x-sluice-replica"] == "r1"
    assert float(headers["x-sluice-predicted-ttft-ms"]) > 0
    (outcome,) = gw.outcomes
    assert (outcome.decision, outcome.reason, outcome.request_class) == ("admitted", "ok", "interactive")
    assert outcome.queue_wait_s == 0.0
    assert outcome.ttft_target_s == 2.0
    assert outcome.tpot_target_s == 0.1
    assert outcome.predicted_ttft_s is not None
    assert outcome.predicted_ttft_s > 0


async def test_queued_request_is_dispatched_when_a_request_finishes(
    start_replica: StartReplica, start_gateway: StartGateway
) -> None:
    gate = Gate()
    _, url = await start_replica(FakeReplica(handler=gate))
    gw = await start_gateway(settings=settings_with(url, one_in_flight(max_queue_wait_s=10.0)))

    first = asyncio.create_task(gw.client.post("/v1/chat/completions", json=CHAT))
    await wait_for(lambda: gate.holding == 1)
    second = asyncio.create_task(gw.client.post("/v1/chat/completions", json=CHAT))
    admission = gw.app[ADMISSION]
    await wait_for(lambda: admission.queued() == 1)
    assert gate.holding == 1  # the second waits in Sluice, not on the replica

    gate.open.set()
    responses = [await first, await second]

    assert [r.status for r in responses] == [200, 200]
    queued = [o for o in gw.outcomes if o.queue_wait_s]
    assert len(queued) == 1
    assert queued[0].decision == "admitted"
    assert admission.stats.count(outcome=Outcome.QUEUED) == 1
    assert admission.stats.count(outcome=Outcome.DISPATCHED) == 1
    assert admission.queued() == 0


async def test_queued_request_past_its_deadline_gets_429_deadline_exceeded(
    start_replica: StartReplica, start_gateway: StartGateway
) -> None:
    gate = Gate()
    _, url = await start_replica(FakeReplica(handler=gate))
    gw = await start_gateway(settings=settings_with(url, one_in_flight(max_queue_wait_s=0.3)))

    first = asyncio.create_task(gw.client.post("/v1/chat/completions", json=CHAT))
    await wait_for(lambda: gate.holding == 1)
    resp = await gw.client.post("/v1/chat/completions", json=CHAT)  # held, then expired by the timer
    body = await resp.json()
    gate.open.set()
    await (await first).read()

    assert resp.status == 429
    assert body["error"]["code"] == "deadline_exceeded"
    assert body["error"]["type"] == "deadline_exceeded"
    assert int(resp.headers["Retry-After"]) >= 1
    assert int(resp.headers["retry-after-ms"]) >= 1
    assert admission_headers(resp)["x-sluice-admission"] == "rejected"
    rejected = [o for o in gw.outcomes if o.status == 429]
    assert len(rejected) == 1
    assert rejected[0].decision == "rejected"
    assert rejected[0].reason == "deadline_exceeded"
    assert rejected[0].queue_wait_s is not None
    assert rejected[0].queue_wait_s >= 0.3
    assert rejected[0].retry_after_s is not None
    assert rejected[0].finished_at is not None


@contextlib.asynccontextmanager
async def served(settings: Settings) -> AsyncIterator[tuple[str, web.Application, list[RequestOutcome]]]:
    """The gateway as ``run_gateway`` serves it (handlers not cancelled on disconnect)."""
    app, _, outcomes = make_app(settings)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", app, outcomes
    finally:
        await runner.cleanup()


async def test_client_gone_while_queued_is_dropped_from_the_queue(start_replica: StartReplica) -> None:
    gate = Gate()
    _, url = await start_replica(FakeReplica(handler=gate))
    async with (
        served(settings_with(url, one_in_flight(max_queue_wait_s=30.0))) as (base, app, outcomes),
        aiohttp.ClientSession() as session,
    ):
        first = asyncio.create_task(session.post(f"{base}/v1/chat/completions", json=CHAT))
        await wait_for(lambda: gate.holding == 1)
        admission = app[ADMISSION]
        leaving = asyncio.create_task(session.post(f"{base}/v1/chat/completions", json=CHAT))
        await wait_for(lambda: admission.queued() == 1)
        leaving.cancel()  # the client closes its connection
        with contextlib.suppress(asyncio.CancelledError):
            await leaving
        await wait_for(lambda: admission.queued() == 0, timeout_s=5.0)
        await wait_for(lambda: any(o.error == "client_disconnected" for o in outcomes))
        gate.open.set()
        async with await first as resp:
            assert resp.status == 200

    assert admission.stats.count(outcome=Outcome.CANCELLED) == 1
    assert gate.holding == 0
    gone = [o for o in outcomes if o.error == "client_disconnected"]
    assert gone[0].replica is None  # it never reached the replica
    assert (gone[0].decision, gone[0].reason) == ("cancelled", "client_disconnected")


@pytest.mark.parametrize(
    ("admission", "body", "decision", "reason"),
    [
        pytest.param(
            AdmissionSettings(
                shadow=ShadowSettings(prompt_size=True),
                classes={"interactive": ClassSettings(max_prompt_tokens=1)},
            ),
            {**CHAT, "messages": [{"role": "user", "content": "a long prompt " * 20}]},
            "shadow_rejected",
            "prompt_too_large",
            id="shadow-prompt-size",
        ),
        pytest.param(
            AdmissionSettings(policy="admit_all", classes={"interactive": ClassSettings()}),
            CHAT,
            "admitted",
            "ok",
            id="admit-all-baseline",
        ),
    ],
)
async def test_shadow_mode_decides_and_counts_but_admits(
    start_replica: StartReplica,
    start_gateway: StartGateway,
    admission: AdmissionSettings,
    body: dict[str, Any],
    decision: str,
    reason: str,
) -> None:
    replica = FakeReplica()
    _, url = await start_replica(replica)
    gw = await start_gateway(settings=settings_with(url, admission, known=True))

    resp = await gw.client.post("/v1/chat/completions", json=body)
    await resp.read()

    assert resp.status == 200
    assert len(replica.seen) == 1
    (outcome,) = gw.outcomes
    assert (outcome.decision, outcome.reason) == (decision, reason)
    if decision.startswith("shadow"):
        assert admission_headers(resp)["x-sluice-admission"] == "shadow"
        assert gw.app[ADMISSION].stats.count(enforced=False) == 1


async def test_shadow_queue_sends_at_once(start_replica: StartReplica, start_gateway: StartGateway) -> None:
    gate = Gate()
    _, url = await start_replica(FakeReplica(handler=gate))
    admission = one_in_flight(max_queue_wait_s=10.0).model_copy(update={"shadow": ShadowSettings(slo=True)})
    gw = await start_gateway(settings=settings_with(url, admission))

    first = asyncio.create_task(gw.client.post("/v1/chat/completions", json=CHAT))
    await wait_for(lambda: gate.holding == 1)
    second = asyncio.create_task(gw.client.post("/v1/chat/completions", json=CHAT))
    await wait_for(lambda: gate.holding == 2)  # both on the replica: the queue was only shadowed
    gate.open.set()
    assert [(await t).status for t in (first, second)] == [200, 200]
    assert sorted(o.decision or "" for o in gw.outcomes) == ["admitted", "shadow_queued"]
    assert gw.app[ADMISSION].queued() == 0


@pytest.mark.parametrize(
    ("admission", "headers", "body", "status", "code", "retry"),
    [
        pytest.param(
            AdmissionSettings(classes={"interactive": ClassSettings(max_prompt_tokens=2)}),
            {},
            {**CHAT, "messages": [{"role": "user", "content": "a long prompt " * 20}]},
            400,
            "prompt_too_large",
            False,
            id="prompt-too-large",
        ),
        pytest.param(
            AdmissionSettings(),
            {"x-sluice-deadline-ms": "0"},
            CHAT,
            400,  # even an idle replica misses it: retrying cannot help (BadRequestError in the SDKs)
            "deadline_exceeded",
            False,
            id="client-deadline-unreachable",
        ),
        pytest.param(
            AdmissionSettings(),
            {"x-sluice-deadline-ms": "soon"},
            CHAT,
            400,
            None,
            None,
            id="malformed-deadline-header",
        ),
        pytest.param(
            AdmissionSettings(),
            {},
            {**CHAT, "max_tokens": 100_000},
            400,
            "context_length_exceeded",
            False,
            id="over-every-replicas-context",
        ),
    ],
)
async def test_requests_refused_before_dispatch_reach_no_replica_and_are_recorded(
    start_replica: StartReplica,
    start_gateway: StartGateway,
    admission: AdmissionSettings,
    headers: dict[str, str],
    body: dict[str, Any],
    status: int,
    code: str | None,
    retry: bool | None,
) -> None:
    replica = FakeReplica()
    _, url = await start_replica(replica)
    gw = await start_gateway(settings=settings_with(url, admission, known=True))

    resp = await gw.client.post("/v1/chat/completions", json=body, headers=headers)
    payload = await resp.json()

    assert resp.status == status
    assert replica.seen == []
    if code is not None:
        assert payload["error"]["code"] == code
        assert "Retry-After" not in resp.headers
        assert resp.headers[SHOULD_RETRY] == ("true" if retry else "false")
        # A request over the context is admission's prompt_too_large, told as OpenAI tells it.
        reason = "prompt_too_large" if code == "context_length_exceeded" else code
        assert admission_headers(resp)["x-sluice-admission-reason"] == reason
    if code == "context_length_exceeded":
        assert payload["error"]["param"] == "max_tokens"
        assert "maximum context length is 4096 tokens" in payload["error"]["message"]
    (outcome,) = gw.outcomes
    assert outcome.status == status
    assert outcome.replica is None
    assert outcome.finished_at is not None


async def test_overloaded_answer_carries_a_retry_after_and_the_prediction_headers(
    start_replica: StartReplica, start_gateway: StartGateway
) -> None:
    gate = Gate()
    _, url = await start_replica(FakeReplica(handler=gate))
    gw = await start_gateway(settings=settings_with(url, one_in_flight(max_queue_wait_s=0.0)))

    first = asyncio.create_task(gw.client.post("/v1/chat/completions", json=CHAT))
    await wait_for(lambda: gate.holding == 1)
    resp = await gw.client.post("/v1/chat/completions", json=CHAT)
    body = await resp.json()
    gate.open.set()
    await (await first).read()

    assert resp.status == 429
    assert body["error"]["type"] == body["error"]["code"] == "overloaded"
    millis = int(resp.headers["retry-after-ms"])
    assert 200 <= millis <= 300  # no_replica_s 0.2 s, jittered by up to 50 %
    assert resp.headers["Retry-After"] == "1"
    assert admission_headers(resp)["x-sluice-admission"] == "rejected"
    rejected = [o for o in gw.outcomes if o.status == 429]
    assert rejected[0].retry_after_s == pytest.approx(millis / 1000, abs=1e-3)


async def test_prediction_headers_can_be_turned_off(
    start_replica: StartReplica, start_gateway: StartGateway
) -> None:
    _, url = await start_replica(FakeReplica())
    off = AdmissionSettings(expose_prediction_headers=False)
    gw = await start_gateway(settings=settings_with(url, off, known=True))

    ok = await gw.client.post("/v1/chat/completions", json=CHAT)
    await ok.read()
    refused = await gw.client.post("/v1/chat/completions", json=CHAT, headers={"x-sluice-deadline-ms": "0"})
    await refused.read()

    assert (ok.status, refused.status) == (200, 400)
    assert admission_headers(ok) == {}
    assert admission_headers(refused) == {}


async def test_the_class_header_is_honoured_for_configured_classes(
    start_replica: StartReplica, start_gateway: StartGateway
) -> None:
    _, url = await start_replica(FakeReplica())
    gw = await start_gateway(settings=settings_with(url, AdmissionSettings(), known=True))

    for value in ("batch", "no-such-class"):
        resp = await gw.client.post("/v1/chat/completions", json=CHAT, headers={"x-sluice-class": value})
        await resp.read()
        assert resp.status == 200

    assert [o.request_class for o in gw.outcomes] == ["batch", "interactive"]
    assert gw.outcomes[0].ttft_target_s == 60.0


@pytest.mark.parametrize(
    ("deadline_ms", "ttft_target_s"),
    [
        pytest.param(None, 2.0, id="class-target"),
        pytest.param("500", 0.5, id="client-tightens"),
        pytest.param("600000", 2.0, id="client-cannot-loosen"),
    ],
)
async def test_the_deadline_header_tightens_the_ttft_target_and_never_loosens_it(
    start_replica: StartReplica, start_gateway: StartGateway, deadline_ms: str | None, ttft_target_s: float
) -> None:
    _, url = await start_replica(FakeReplica())
    gw = await start_gateway(settings=settings_with(url, AdmissionSettings(), known=True))

    headers = {} if deadline_ms is None else {"x-sluice-deadline-ms": deadline_ms}
    resp = await gw.client.post("/v1/chat/completions", json=CHAT, headers=headers)
    await resp.read()

    assert resp.status == 200
    (outcome,) = gw.outcomes
    assert outcome.ttft_target_s == pytest.approx(ttft_target_s)


async def _refuse_for_a_minute(request: web.Request) -> web.StreamResponse:
    """A replica's own overload refusal asking for the most a Retry-After may say (60 s)."""
    return web.json_response(
        {"error": {"message": "Model is overloaded"}}, status=429, headers={"Retry-After": "60"}
    )


async def test_retry_after_for_replicas_that_refused_as_overloaded_never_exceeds_60s(
    start_replica: StartReplica, start_gateway: StartGateway
) -> None:
    """Every replica said it is overloaded for 60 s: Sluice's own 429 is spread with jitter, but
    like every Retry-After it sends it stays within 60 s (the ``openai`` SDKs ignore larger ones)."""
    replica = FakeReplica(handler=_refuse_for_a_minute)
    _, url = await start_replica(replica)
    gw = await start_gateway(settings=settings_with(url, AdmissionSettings()))

    answers = []
    for _ in range(8):
        resp = await gw.client.post("/v1/chat/completions", json=CHAT)
        answers.append((resp.status, (await resp.json())["error"]["code"], dict(resp.headers)))

    assert len(replica.seen) == 1  # then it is left alone while it said so
    for status, code, headers in answers:
        assert (status, code) == (429, "overloaded")
        # The first was admitted, then refused by the replica; the rest never reached it: each
        # says so, as every response carries admission's outcome.
        assert headers["x-sluice-admission"] == "rejected", headers
        assert headers["x-sluice-admission-reason"] == "replicas_saturated", headers
        assert headers["x-sluice-class"] == "interactive", headers
        assert 1 <= int(headers["Retry-After"]) <= 60, headers
        assert 1 <= int(headers["retry-after-ms"]) <= 60_000, headers
    delays = [int(headers["retry-after-ms"]) for _, _, headers in answers]
    assert len(set(delays)) > 1, "clients refused together are spread"


# -- what re-evaluates the queue: a request finishing, a scrape arriving -------------------------------

#: One scrape at startup, then none for a minute: only the scrapes a test asks for arrive.
QUIET_SCRAPES = ScrapeSettings(interval_s=60.0, timeout_s=1.0, window_s=120.0)


@pytest.fixture
def no_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The queue's timer ticks only past every queue deadline below (30 s): a queued request then
    leaves the queue early only if an event re-evaluates it."""
    monkeypatch.setattr(engine, "MIN_TICK_S", 120.0)
    monkeypatch.setattr(engine, "MAX_TICK_S", 120.0)


@pytest.mark.usefixtures("no_timer")
async def test_a_request_finishing_re_evaluates_the_queue_at_once(
    start_replica: StartReplica, start_gateway: StartGateway
) -> None:
    gate = Gate()
    _, url = await start_replica(FakeReplica(handler=gate))
    settings = gateway_settings({"r1": url}, scrape=QUIET_SCRAPES).model_copy(
        update={"admission": one_in_flight(max_queue_wait_s=30.0)}
    )
    gw = await start_gateway(settings=settings)
    admission = gw.app[ADMISSION]

    first = asyncio.create_task(gw.client.post("/v1/chat/completions", json=CHAT))
    await wait_for(lambda: gate.holding == 1)
    second = asyncio.create_task(gw.client.post("/v1/chat/completions", json=CHAT))
    await wait_for(lambda: admission.queued() == 1)
    gate.open.set()  # the first finishes: its replica has room again
    await wait_for(lambda: admission.queued() == 0, timeout_s=5.0)

    assert [(await t).status for t in (first, second)] == [200, 200]
    assert admission.stats.count(outcome=Outcome.DISPATCHED) == 1


@pytest.mark.usefixtures("no_timer")
async def test_a_replica_back_to_health_re_evaluates_the_queue_at_once(
    start_replica: StartReplica, start_gateway: StartGateway
) -> None:
    """r1 holds its one request; r2 is down, so the second request waits. The health check that
    finds r2 back sends it there at once, while r1 still holds the first."""
    gate = Gate()
    _, url1 = await start_replica(FakeReplica(handler=gate))
    down = FakeReplica(health_status=503)
    _, url2 = await start_replica(down)
    health = HealthSettings(interval_s=300.0, timeout_s=2.0, unhealthy_after=1, healthy_after=1)
    settings = gateway_settings({"r1": url1, "r2": url2}, health=health, scrape=QUIET_SCRAPES).model_copy(
        update={"admission": one_in_flight(max_queue_wait_s=30.0)}
    )
    gw = await start_gateway(settings=settings)
    admission = gw.app[ADMISSION]
    r2 = gw.app[REGISTRY].get("r2")
    assert r2 is not None
    assert r2.state == ReplicaState.UNHEALTHY

    first = asyncio.create_task(gw.client.post("/v1/chat/completions", json=CHAT))
    await wait_for(lambda: gate.holding == 1)
    second = asyncio.create_task(gw.client.post("/v1/chat/completions", json=CHAT))
    await wait_for(lambda: admission.queued() == 1)
    down.health_status = 200
    await gw.app[HEALTH].check(r2)
    await wait_for(lambda: admission.queued() == 0, timeout_s=5.0)
    resp = await asyncio.wait_for(second, timeout=5.0)
    await resp.read()
    assert resp.status == 200
    assert len(down.seen) == 1  # sent to r2 ...
    assert gate.holding == 1  # ... while r1 still held the first
    gate.open.set()
    assert (await first).status == 200


def vllm_metrics(running: int, kv_usage: float) -> str:
    """A vLLM scrape: ``running`` requests of other clients holding ``kv_usage`` of 400K KV tokens."""
    labels = f'{{model_name="{MODEL}"}}'
    return (
        f"vllm:num_requests_running{labels} {running}\n"
        f"vllm:num_requests_waiting{labels} 0\n"
        f"vllm:kv_cache_usage_perc{labels} {kv_usage}\n"
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="25000"} 1\n'
    )


@pytest.mark.usefixtures("no_timer")
async def test_a_scrape_re_evaluates_the_queue_at_once(
    start_replica: StartReplica, start_gateway: StartGateway
) -> None:
    """Other clients' 128 streams (seen in the scrape) put the decode step at ~29 ms, over a 20 ms
    TPOT target: the request waits in Sluice's queue. The next scrape shows them gone (an idle step
    is ~8 ms): that scrape alone sends it."""
    replica = FakeReplica(metrics_text=vllm_metrics(128, 0.9))
    _, url = await start_replica(replica)
    admission_settings = AdmissionSettings(
        classes={"interactive": ClassSettings(ttft_target_s=30.0, max_queue_wait_s=30.0, tpot_target_s=0.02)}
    )
    settings = gateway_settings({"r1": url}, hardware=H100_LLAMA3_8B, scrape=QUIET_SCRAPES).model_copy(
        update={"admission": admission_settings}
    )
    gw = await start_gateway(settings=settings)
    admission = gw.app[ADMISSION]
    await gw.app[SCRAPER].scrape_once("r1")

    pending = asyncio.create_task(gw.client.post("/v1/chat/completions", json=CHAT))
    await wait_for(lambda: admission.queued() == 1)
    assert admission.stats.count(outcome=Outcome.QUEUED) == 1
    assert replica.seen == []
    replica.metrics_text = vllm_metrics(0, 0.0)
    await gw.app[SCRAPER].scrape_once("r1")
    resp = await asyncio.wait_for(pending, timeout=5.0)
    await resp.read()

    assert resp.status == 200
    assert len(replica.seen) == 1
    (outcome,) = gw.outcomes
    assert (outcome.decision, outcome.reason) == ("admitted", "ok")
    assert outcome.queue_wait_s is not None
    assert 0.0 < outcome.queue_wait_s < 5.0


async def test_stale_metrics_are_logged_once_per_transition_not_per_request(
    start_replica: StartReplica, start_gateway: StartGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """The replica's /metrics answers 404 (stale: admission judges it by its own accounting), then
    a good scrape (fresh again): one line each, whatever the number of requests in between."""
    replica = FakeReplica(metrics_text=None)
    _, url = await start_replica(replica)
    settings = gateway_settings({"r1": url}, hardware=H100_LLAMA3_8B, scrape=QUIET_SCRAPES)
    gw = await start_gateway(settings=settings)

    def lines(text: str) -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == "sluice.admission" and text in r.getMessage()]

    with caplog.at_level(logging.INFO, logger="sluice.admission"):
        assert (await gw.app[SCRAPER].scrape_once("r1")).stale
        for _ in range(4):
            resp = await gw.client.post("/v1/chat/completions", json=CHAT)
            await resp.read()
            assert resp.status == 200
        replica.metrics_text = vllm_metrics(0, 0.0)
        assert not (await gw.app[SCRAPER].scrape_once("r1")).stale
        for _ in range(4):
            resp = await gw.client.post("/v1/chat/completions", json=CHAT)
            await resp.read()
            assert resp.status == 200

    assert len(lines("metrics stale")) == 1
    assert lines("metrics stale")[0].levelno == logging.WARNING
    assert len(lines("metrics fresh again")) == 1
