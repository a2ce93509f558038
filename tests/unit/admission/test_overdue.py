"""A replica whose queue runs behind its forecasts now: the longest that one of the gateway's
requests there has waited for its first token past the TTFT admission held it to is added to a
newcomer's TTFT at once, and nothing once they have their tokens (no state to unlearn, so no
lock-out)."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from gateway.admission import AdmissionSettings, Admit, Queue, Reject, RetryAfterPolicy, SloAdmitter
from gateway.admission.engine import AdmissionEngine
from gateway.admission.views import TrackedStream, overdue_s
from gateway.replicas.registry import LiveRequest
from gateway.replicas.snapshot import InFlight
from tests.unit.admission.fleet import request, state, view
from tests.unit.admission.test_policies import Fleet, Predictions, new_entry, policy_settings, submit

NOW = 1000.0
PLAIN = AdmissionSettings.model_validate(
    {
        "classes": {"plain": {"ttft_target_s": 2.0, "tpot_target_s": 0.05, "max_queue_wait_s": 0.0}},
        "default_class": "plain",
    }
)


def waiting(
    sent_at: float, ttft_s: float, *, streamed: bool = True, first_token_at: float | None = None
) -> TrackedStream[InFlight]:
    """A request sent at ``sent_at`` with a forecast TTFT of ``ttft_s`` (its first token at
    ``first_token_at``, ``None``: not yet)."""
    live = LiveRequest("r", 100, sent_at, streamed=streamed)
    live.first_token_at = first_token_at
    return TrackedStream(live, "plain", 50.0, 0.02, ttft_s)


def test_no_request_waiting_past_its_forecast_is_nothing_overdue() -> None:
    assert overdue_s([], NOW) == 0.0
    assert overdue_s([waiting(NOW - 1.0, 2.0), waiting(NOW - 0.1, 0.5)], NOW) == 0.0


def test_the_most_overdue_request_sets_it_in_seconds() -> None:
    streams = [waiting(NOW - 3.0, 2.0), waiting(NOW - 4.0, 1.0), waiting(NOW - 0.5, 0.1)]
    assert overdue_s(streams, NOW) == pytest.approx(3.0)  # 4 s after it was sent, forecast at 1 s
    assert overdue_s([streams[0], streams[2]], NOW) == pytest.approx(1.0)
    # A tiny forecast missed by a little is a little overdue, not many times late.
    assert overdue_s([waiting(NOW - 0.05, 0.01)], NOW) == pytest.approx(0.04)


def test_only_requests_whose_first_token_would_be_seen_and_that_have_a_forecast_count() -> None:
    answered = waiting(NOW - 10.0, 1.0, first_token_at=NOW - 2.0)
    unseen = waiting(NOW - 10.0, 1.0, streamed=False)
    unforecast = waiting(NOW - 10.0, math.nan)
    assert overdue_s([answered, unseen, unforecast], NOW) == 0.0
    assert overdue_s([answered, unseen, unforecast, waiting(NOW - 3.0, 2.0)], NOW) == pytest.approx(1.0)


def decide(overdue: float) -> Admit | Queue | Reject:
    """A plain request on a busy replica whose queue runs ``overdue`` seconds behind."""
    admitter = SloAdmitter(PLAIN, RetryAfterPolicy(PLAIN.retry_after, random.Random(3)))
    replica = replace(view("r1", state(decodes=8, queued=[3000] * 6)), overdue_s=overdue)
    newcomer = request(500, 16.0, request_class="plain", arrival=NOW, max_tokens=64)
    return admitter.decide(newcomer, [replica], NOW)


def test_a_queue_running_behind_adds_as_much_to_the_newcomers_ttft() -> None:
    on_time = decide(0.0)
    assert isinstance(on_time, Admit)
    assert on_time.forecast is not None
    ttft = on_time.forecast.ttft_s
    assert 0.0 < ttft < 2.0
    # Behind by just less than its room under the 2 s target: admitted, its forecast saying so.
    fits = decide(0.95 * (2.0 - ttft))
    assert isinstance(fits, Admit)
    assert fits.forecast is not None
    assert fits.forecast.ttft_s == pytest.approx(ttft + 0.95 * (2.0 - ttft))
    # By more: not admitted.
    assert not isinstance(decide(1.05 * (2.0 - ttft)), Admit)


@pytest.mark.parametrize("on", [True, False], ids=["on", "off"])
def test_admission_overdue_ttft_turns_it_on_and_a_reload_turns_it_over(on: bool) -> None:
    fleet = Fleet(["r0"])
    engine = AdmissionEngine(
        policy_settings("slo", overdue_ttft=on),
        fleet,
        Predictions(),
        rng=random.Random(5),
        new_entry=new_entry,
    )
    decision = submit(engine, 1, NOW)[0].decision
    assert isinstance(decision, Admit)
    assert decision.forecast is not None
    later = NOW + decision.forecast.ttft_s + 1.5  # no first token yet

    def seen() -> float:
        (view,) = engine.view_cache.views_for("m", fleet.replicas(), later)
        return view.overdue_s

    assert seen() == pytest.approx(1.5 if on else 0.0)
    engine.reconfigure(policy_settings("slo", overdue_ttft=not on))
    assert seen() == pytest.approx(0.0 if on else 1.5)
