"""The controller: counting every outcome (shadow ones apart), prediction headers, hot reload."""

from __future__ import annotations

import pytest

from gateway.admission import (
    AdmissionSettings,
    Admit,
    Outcome,
    Queue,
    Reject,
    RejectReason,
    ShadowSettings,
    decision_headers,
)
from tests.unit.admission.fleet import SETTINGS, controller, request, settings, state, streams, view

NOW = 1000.0
IDLE = [view("a", state())]
SATURATED = [view("a", state(8, queued=[8192] * 8))]
BLOCKED = [view("a", state(32), streams(32, tpot_s=0.1, generated=100, expected=102))]


def test_every_outcome_is_counted_by_class_and_reason() -> None:
    ctl = controller()
    assert isinstance(ctl.submit(request(arrival=NOW), IDLE, NOW), Admit)
    assert isinstance(ctl.submit(request(arrival=NOW), SATURATED, NOW), Reject)
    assert isinstance(ctl.submit(request(arrival=NOW, request_class="batch"), BLOCKED, NOW), Queue)
    stats = ctl.stats
    assert stats.decisions[("interactive", Outcome.ADMITTED, "ok", True)] == 1
    assert stats.decisions[("interactive", Outcome.REJECTED, "slo_unattainable", True)] == 1
    assert stats.decisions[("batch", Outcome.QUEUED, "streams_tpot", True)] == 1
    assert stats.queue_depth == {"interactive": 0, "batch": 1}
    waits, retries = stats.drain_observations()
    assert waits == []
    assert [reason for reason, _ in retries] == ["slo_unattainable"]
    assert stats.drain_observations() == ([], [])


def test_shadow_mode_counts_what_it_would_have_done_and_admits() -> None:
    ctl = controller(settings(shadow={"slo": True}))
    decision = ctl.submit(request(arrival=NOW), SATURATED, NOW)
    assert isinstance(decision, Reject)
    assert decision.admits
    assert decision.replica == "a"
    assert ctl.stats.decisions[("interactive", Outcome.REJECTED, "slo_unattainable", False)] == 1
    assert ctl.stats.count(enforced=True) == 0
    assert ctl.stats.retry_after_s == []  # nobody was told to retry
    assert len(ctl.queue) == 0


def test_shadowed_queue_decision_is_not_queued() -> None:
    config = SETTINGS.model_copy(update={"shadow": ShadowSettings(protect_streams=True)})
    ctl = controller(config)
    decision = ctl.submit(request(arrival=NOW), BLOCKED, NOW)
    assert isinstance(decision, Queue)
    assert decision.admits
    assert decision.entry_id is None
    assert len(ctl.queue) == 0
    assert ctl.stats.decisions[("interactive", Outcome.QUEUED, "streams_tpot", False)] == 1


@pytest.mark.parametrize(
    ("views", "expected"),
    [
        pytest.param(
            IDLE, {"x-sluice-admission": "admitted", "x-sluice-admission-reason": "ok"}, id="admitted"
        ),
        pytest.param(
            SATURATED,
            {"x-sluice-admission": "rejected", "x-sluice-admission-reason": "slo_unattainable"},
            id="rejected",
        ),
        pytest.param(
            BLOCKED,
            {"x-sluice-admission": "queued", "x-sluice-admission-reason": "streams_tpot"},
            id="queued",
        ),
    ],
)
def test_prediction_headers(views, expected: dict[str, str]) -> None:
    decision = controller().submit(request(arrival=NOW), views, NOW)
    headers = decision_headers(decision, "interactive", SETTINGS)
    assert headers["x-sluice-class"] == "interactive"
    assert {k: headers[k] for k in expected} == expected
    assert decision.forecast is not None
    assert headers["x-sluice-predicted-ttft-ms"] == f"{decision.forecast.ttft_s * 1e3:.1f}"
    assert headers["x-sluice-predicted-tpot-ms"] == f"{decision.forecast.tpot_s * 1e3:.2f}"


def test_prediction_headers_can_be_turned_off_and_mark_shadow() -> None:
    decision = controller(settings(shadow={"slo": True})).submit(request(arrival=NOW), SATURATED, NOW)
    assert (
        decision_headers(decision, "interactive", settings(shadow={"slo": True}))["x-sluice-admission"]
        == "shadow"
    )
    assert decision_headers(decision, "interactive", settings(expose_prediction_headers=False)) == {}


def test_no_replica_rejection_has_no_prediction() -> None:
    decision = controller().submit(request(arrival=NOW), [view("a", state(), healthy=False)], NOW)
    assert isinstance(decision, Reject)
    assert decision.reason == RejectReason.NO_HEALTHY_REPLICA
    headers = decision_headers(decision, "interactive", SETTINGS)
    assert "x-sluice-predicted-ttft-ms" not in headers


def test_reconfigure_applies_new_targets_and_keeps_the_queue() -> None:
    ctl = controller()
    queued = ctl.submit(request(arrival=NOW, request_class="batch"), BLOCKED, NOW)
    assert isinstance(queued, Queue)
    assert isinstance(ctl.submit(request(arrival=NOW), SATURATED, NOW), Reject)
    data = SETTINGS.model_dump()
    data["classes"]["interactive"]["ttft_target_s"] = 10.0
    ctl.reconfigure(AdmissionSettings.model_validate(data))
    assert isinstance(ctl.submit(request(arrival=NOW), SATURATED, NOW), Admit)
    assert len(ctl.queue) == 1
    assert [e.request.request_class for e, _ in ctl.reevaluate(NOW + 0.3, IDLE).dispatched] == ["batch"]


def test_a_class_removed_by_reload_is_judged_as_the_default() -> None:
    ctl = controller(settings(classes={"interactive": {}}, default_class="interactive"))
    decision = ctl.submit(request(arrival=NOW, request_class="batch"), IDLE, NOW)
    assert isinstance(decision, Admit)
    assert ctl.stats.decisions[("interactive", Outcome.ADMITTED, "ok", True)] == 1
