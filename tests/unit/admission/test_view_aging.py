"""A view used after it was built, inside the engine step it was built in, decides as a fresh view.

The live gateway keeps a replica's view until the step in progress when it was built is predicted
to end (``ReplicaView.usable_until``), and the admitter takes the time elapsed since off the step
wait (``ReplicaView.step_elapsed_s``). Each case decides one request on an aged view at ``now``
and on the view a rebuild at ``now`` would give (the same state, its step wait shorter by the time
elapsed, never below 0): the decisions must agree (kind, replica, reason) and their forecasts must
be equal to float rounding. A timeless view (``built_at`` NaN, as virtual-time replays and tests
build them) is used as built.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from gateway.admission import Admit, Decision, ReplicaView
from gateway.admission.retry_after import RetryAfterPolicy
from gateway.admission.slo_admitter import SloAdmitter
from predictor import ReplicaState
from tests.unit.admission.fleet import MODEL, SETTINGS, request, state, streams

BUILT_AT = 1000.0
#: The step in progress when the view was built had this long to go (seconds).
STEP_LEFT_S = 0.008


class _Zero:
    """Retry-After jitter that draws the same every time (both decisions alike)."""

    def random(self) -> float:
        return 0.5


def _admitter() -> SloAdmitter:
    return SloAdmitter(SETTINGS, RetryAfterPolicy(SETTINGS.retry_after, _Zero()))


def _with_step(s: ReplicaState, left_s: float) -> ReplicaState:
    return dataclasses.replace(s, step_remaining_s=left_s)


def _view(s: ReplicaState, built_at: float, *, busy: bool) -> ReplicaView:
    return ReplicaView.build(
        "r", healthy=True, model=MODEL, state=s, streams=streams(8) if busy else (), built_at=built_at
    )


def _same(aged: Decision, fresh: Decision) -> None:
    assert type(aged) is type(fresh)
    assert getattr(aged, "replica", None) == getattr(fresh, "replica", None)
    assert getattr(aged, "reason", None) == getattr(fresh, "reason", None)
    a, f = aged.forecast, fresh.forecast
    assert a is not None
    assert f is not None
    for field in ("ttft_s", "tpot_s", "inflicted_tpot_s", "step_wait_s", "admission_wait_s"):
        assert getattr(a, field) == pytest.approx(getattr(f, field), rel=1e-9, abs=1e-12), field


#: (name, replica state, busy streams, seconds after the build, the request's deadline from arrival)
CASES = [
    ("idle-engine-mid-step-admits", state(4, context=1000), False, 0.003, None),
    ("busy-engine-mid-step-admits", state(64, context=2000, queued=[2000]), True, 0.005, None),
    # A first token that cannot come within 30 ms of arrival on a full engine: refused.
    ("full-engine-deadline-refused", state(250, context=3000, queued=[6000, 6000]), True, 0.002, 0.030),
    # Past the step's predicted end the step wait is 0, not negative.
    ("past-the-step-end-clamps", state(64, context=2000), True, 0.020, None),
]


@pytest.mark.parametrize(("name", "base", "busy", "later_s", "deadline_s"), CASES, ids=[c[0] for c in CASES])
def test_aged_view_decides_as_a_fresh_one(
    name: str, base: ReplicaState, busy: bool, later_s: float, deadline_s: float | None
) -> None:
    now = BUILT_AT + later_s
    deadline = None if deadline_s is None else now + deadline_s
    aged = _view(_with_step(base, STEP_LEFT_S), BUILT_AT, busy=busy)
    fresh = _view(_with_step(base, max(0.0, STEP_LEFT_S - later_s)), now, busy=busy)
    assert aged.step_elapsed_s(now) == pytest.approx(min(later_s, STEP_LEFT_S))
    req = request(arrival=now, deadline=deadline)
    on_aged = _admitter().decide(req, [aged], now)
    on_fresh = _admitter().decide(req, [fresh], now)
    _same(on_aged, on_fresh)
    if deadline_s is None:
        assert isinstance(on_aged, Admit), on_aged
    else:
        assert not on_aged.admits, on_aged
    # And the aging is not a no-op: the view as built forecasts a later first token.
    as_built = _admitter().decide(req, [aged], BUILT_AT)
    assert as_built.forecast is not None
    assert on_aged.forecast is not None
    assert as_built.forecast.ttft_s - on_aged.forecast.ttft_s == pytest.approx(
        min(later_s, STEP_LEFT_S) * (1 + SETTINGS.forecast_margin), rel=1e-6
    )


def test_a_timeless_view_is_used_as_built() -> None:
    timeless = _view(_with_step(state(8), STEP_LEFT_S), math.nan, busy=False)
    assert math.isnan(timeless.usable_until)
    assert timeless.step_elapsed_s(BUILT_AT + 1.0) == 0.0
    req = request(arrival=BUILT_AT)
    early = _admitter().decide(req, [timeless], BUILT_AT)
    late = _admitter().decide(req, [timeless], BUILT_AT + 0.005)
    assert early.forecast is not None
    assert late.forecast is not None
    assert early.forecast.ttft_s == late.forecast.ttft_s


def test_usable_until_is_the_predicted_end_of_the_step() -> None:
    v = _view(_with_step(state(8), STEP_LEFT_S), BUILT_AT, busy=False)
    assert v.usable_until == pytest.approx(BUILT_AT + STEP_LEFT_S)
    idle = _view(state(), BUILT_AT, busy=False)
    assert idle.usable_until == BUILT_AT  # no step in progress: nothing to age
    assert idle.step_elapsed_s(BUILT_AT + 1.0) == 0.0
