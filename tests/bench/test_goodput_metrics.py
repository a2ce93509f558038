"""The goodput bench's metric definitions on hand-built outcomes (bench/goodput/metrics.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from bench.goodput.metrics import (
    DispatchForecast,
    attainment_series,
    forecast_accuracy,
    recovery_time_s,
    rejections_stop_s,
    score,
    score_by_tenant,
    wasted_gpu_fraction,
)
from replay import Outcome, Targets

TARGETS = Targets(ttft_s=1.0, tpot_s=0.05)


def outcome(
    arrival: float,
    *,
    ttft: float | None = 0.2,
    tpot: float | None = 0.02,
    busy: float = 1.0,
    rejected: bool = False,
    finished: bool = True,
    prompt: int = 100,
    output: int = 10,
) -> Outcome:
    """A request that arrived at ``arrival``: served with ``ttft``/``tpot`` unless ``rejected``."""
    if rejected:
        return Outcome(
            0, "t0", arrival, prompt, 0, True, "overloaded", None, None, None, arrival, None, 0.0, 0
        )
    first = None if ttft is None else arrival + ttft
    end = arrival + 5.0 if finished else None
    return Outcome(0, "t0", arrival, prompt, output, False, "", "r0", arrival, first, end, tpot, busy, 0)


def test_met_needs_both_targets_a_finish_and_no_rejection() -> None:
    assert outcome(0.0).met(TARGETS)
    assert outcome(0.0, tpot=None).met(TARGETS)  # a one-token answer has no TPOT
    assert outcome(0.0, ttft=1.0, tpot=0.05).met(TARGETS)  # targets are inclusive
    assert not outcome(0.0, ttft=1.01).met(TARGETS)
    assert not outcome(0.0, tpot=0.051).met(TARGETS)
    assert not outcome(0.0, finished=False).met(TARGETS)
    assert not outcome(0.0, rejected=True).met(TARGETS)
    assert outcome(0.0, ttft=0.3).ttft_s == pytest.approx(0.3)


def test_wasted_gpu_time_is_the_busy_share_of_served_requests_that_missed() -> None:
    outcomes = [
        outcome(0.0, busy=3.0),  # met
        outcome(0.0, ttft=2.0, busy=1.0),  # served, missed TTFT: wasted
        outcome(0.0, tpot=0.1, busy=0.5),  # served, missed TPOT: wasted
        outcome(0.0, ttft=None, finished=False, busy=0.5),  # still waiting when stopped: wasted
        outcome(0.0, rejected=True),  # no GPU time at all
    ]
    assert wasted_gpu_fraction(outcomes, TARGETS) == pytest.approx(2.0 / 5.0)
    assert wasted_gpu_fraction([outcome(0.0, rejected=True)], TARGETS) == 0.0


def test_score_rates_and_fractions() -> None:
    outcomes = [
        outcome(0.0),
        outcome(1.0, prompt=50, output=5),
        outcome(2.0, ttft=3.0),
        outcome(3.0, rejected=True),
    ]
    s = score(outcomes, TARGETS, span_s=4.0)
    assert (s.offered, s.met, s.rejected) == (4, 2, 1)
    assert s.offered_rate == pytest.approx(1.0)
    assert s.goodput == pytest.approx(0.5)
    assert s.attainment == pytest.approx(0.5)
    assert s.rejection_rate == pytest.approx(0.25)
    assert s.token_goodput == pytest.approx((110 + 55) / 4.0)
    with pytest.raises(ValueError, match="span_s"):
        score(outcomes, TARGETS, span_s=0.0)


def test_attainment_series_bins_by_arrival_second() -> None:
    outcomes = [outcome(0.1), outcome(0.9, ttft=2.0), outcome(1.5, rejected=True), outcome(3.2)]
    series = attainment_series(outcomes, TARGETS, 0.0, 4.0)
    assert series == [(0.0, 2, 1, 0), (1.0, 1, 0, 1), (2.0, 0, 0, 0), (3.0, 1, 1, 0)]


def _series(attainments: list[float], per_s: int = 10) -> list[tuple[float, int, int, int]]:
    """1-s bins of ``per_s`` arrivals with the given attainment (misses are rejections)."""
    out = []
    for k, a in enumerate(attainments):
        met = round(a * per_s)
        out.append((float(k), per_s, met, per_s - met))
    return out


def test_recovery_is_when_every_later_window_is_back_at_the_pre_spike_minimum() -> None:
    # Pre-spike 0..10 s: the lowest 2-s window is 0.85; spike 10..20 s; after it attainment climbs
    # back: from the window starting at 23 s on, every window is >= 0.85 (the one at 24-26 s just).
    pre = [0.9, 0.8, 0.9, 0.9, 0.8, 0.9, 0.9, 0.9, 0.8, 0.9]
    during = [0.3] * 10
    after = [0.2, 0.5, 0.6, 0.9, 0.9, 0.8, 0.9, 0.9, 0.9, 0.9]
    series = _series(pre + during + after)
    assert recovery_time_s(series, 10.0, 20.0, window_s=2) == pytest.approx(3.0)
    # Never dropping: recovered at once.
    assert recovery_time_s(_series([0.9] * 30), 10.0, 20.0, window_s=2) == 0.0
    # Still low at the end of the span: never recovered.
    assert recovery_time_s(_series(pre + during + [0.5] * 10), 10.0, 20.0, window_s=2) is None
    with pytest.raises(ValueError, match="before the spike"):
        recovery_time_s(series, 1.0, 20.0, window_s=2)


def test_a_later_dip_below_the_level_postpones_the_recovery() -> None:
    # Back at 20 s, but the dip at 27 s makes the windows at 26 s and 27 s low: recovered at 28 s.
    series = _series([1.0] * 10 + [0.0] * 10 + [1.0] * 7 + [0.0] + [1.0] * 6)
    rec = recovery_time_s(series, 10.0, 20.0, window_s=2)
    assert rec is not None
    assert rec == pytest.approx(8.0)
    assert math.isfinite(rec)


def test_rejections_stop_after_the_last_bin_with_a_rejection() -> None:
    series = [
        (0.0, 5, 5, 0),
        (10.0, 5, 0, 5),
        (20.0, 5, 3, 2),
        (21.0, 5, 4, 1),
        (22.0, 5, 5, 0),
        (23.0, 5, 5, 0),
    ]
    assert rejections_stop_s(series, 20.0) == pytest.approx(2.0)
    assert rejections_stop_s([(20.0, 5, 5, 0)], 20.0) == 0.0


def test_the_guard_keeps_windows_just_before_the_spike_out_of_the_pre_spike_level() -> None:
    # Attainment already sags in the 2 s before the spike (requests still decoding when it hits).
    series = _series([1.0] * 8 + [0.4, 0.4] + [0.0] * 10 + [0.6] * 3 + [1.0] * 7)
    # Without a guard the sag sets the level (0.4): back at 0.6 right after the spike.
    assert recovery_time_s(series, 10.0, 20.0, window_s=2) == 0.0
    # With a 2-s guard the level is 1.0: recovered only when attainment is back at 1.0.
    assert recovery_time_s(series, 10.0, 20.0, window_s=2, guard_s=2.0) == pytest.approx(3.0)


def test_tolerance_lets_a_single_miss_pass_when_the_level_is_perfect() -> None:
    # 100 % before the spike; afterwards one request in ten misses now and then.
    series = _series([1.0] * 10 + [0.0] * 10 + [1.0, 0.9, 1.0, 1.0, 0.9, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert recovery_time_s(series, 10.0, 20.0, window_s=2) == pytest.approx(5.0)
    assert recovery_time_s(series, 10.0, 20.0, window_s=2, tolerance=0.9) == 0.0


def test_forecast_accuracy_scores_served_finished_requests_from_their_dispatch() -> None:
    def served(index: int, arrival: float, dispatched: float, ttft: float, tpot: float | None) -> Outcome:
        first = dispatched + ttft
        return Outcome(
            index, "t0", arrival, 100, 10, False, "", "r0", dispatched, first, first + 1, tpot, 1.0, 0
        )

    outcomes = [
        served(0, 0.0, 0.5, 0.1, 0.02),  # waited 0.5 s in the gateway's queue: not in the TTFT scored
        served(1, 1.0, 1.0, 0.2, None),  # one token: no TPOT
        served(2, 2.0, 2.0, 0.1, 0.02),  # no forecast
        outcome(3.0, rejected=True),
        outcome(4.0, finished=False),
    ]
    forecasts = {
        0: DispatchForecast(0.12, 0.021, 1.15),
        1: DispatchForecast(0.15, 0.03, 1.15, stale=True),
    }
    acc = forecast_accuracy(outcomes, forecasts)
    assert (acc.served, acc.no_forecast, acc.stale) == (3, 1, 1)
    assert acc.ttft.n == 2
    assert acc.ttft.median_ape == pytest.approx((0.2 + 0.25) / 2)  # APEs 0.2 and 0.25
    assert acc.ttft.median_abs_s == pytest.approx((0.02 + 0.05) / 2)
    assert acc.tpot.n == 1
    assert acc.tpot.median_ape == pytest.approx(0.05)
    # With the margin: 0.12 x 1.15 = 0.138 against 0.1, 0.15 x 1.15 = 0.1725 against 0.2.
    assert acc.ttft_with_margin.median_ape == pytest.approx((0.38 + 0.1375) / 2)
    assert acc.tpot_with_margin.median_ape == pytest.approx(0.021 * 1.15 / 0.02 - 1)
    empty = forecast_accuracy([], {})
    assert empty.ttft.n == 0
    assert math.isnan(empty.tpot.median_ape)


def test_score_by_tenant_scores_each_tenants_own_requests() -> None:
    """t0: 3 requests, 2 met (one TTFT miss); t1: 2 requests, 1 met, 1 rejected. Over 10 s:
    t0 goodput 0.2/s at 2/3 attainment, t1 0.1/s at 1/2 with half rejected."""
    t0 = [outcome(0.0), outcome(1.0), outcome(2.0, ttft=1.5)]
    t1 = [outcome(3.0), outcome(4.0, rejected=True)]
    renamed = [*t0, *(dataclasses.replace(o, tenant="t1") for o in t1)]
    scores = score_by_tenant(renamed, TARGETS, 10.0)
    assert list(scores) == ["t0", "t1"]
    assert (scores["t0"].offered, scores["t0"].met, scores["t0"].rejected) == (3, 2, 0)
    assert scores["t0"].goodput == pytest.approx(0.2)
    assert scores["t0"].attainment == pytest.approx(2 / 3)
    assert scores["t0"].token_goodput == pytest.approx(2 * 110 / 10.0)
    assert (scores["t1"].offered, scores["t1"].met, scores["t1"].rejected) == (2, 1, 1)
    assert scores["t1"].rejection_rate == pytest.approx(0.5)
    # The tenants' scores add up to the cell's.
    whole = score(renamed, TARGETS, 10.0)
    assert sum(s.met for s in scores.values()) == whole.met
    assert sum(s.offered for s in scores.values()) == whole.offered
    assert score_by_tenant([], TARGETS, 10.0) == {}
