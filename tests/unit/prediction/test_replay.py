"""The virtual-time replay: trace handling, determinism, and predictions vs the emulator's outcomes.

The accuracy test checks the accuracy targets at moderate load: the emulator (the ground
truth, whose profile the predictor never sees) runs real trace arrivals, the prediction service
learns from the same /metrics text and scrape parsing the gateway uses, and every forecast made
at dispatch is compared with what the request then measured.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest

from gateway.prediction import ReplicaFacts
from replay import (
    ReplayConfig,
    ReplayResult,
    TraceRequest,
    at_rate,
    fit_to_model_len,
    load_azure_trace,
    measure_capacity,
    run_replay,
)
from simulator.profile import load_profile

FACTS = ReplicaFacts(
    gpu="H100-SXM",
    model="meta-llama/Meta-Llama-3-8B-Instruct",
    max_num_seqs=1024,
    max_num_batched_tokens=8192,
    max_model_len=8192,
)


def test_trace_rows_and_relative_arrivals() -> None:
    rows = load_azure_trace(count=3)
    # The CSV's first two rows: 18:15:46.6805900,374,44 and 18:15:50.9951690,396,109.
    assert [(r.prompt_tokens, r.output_tokens) for r in rows[:2]] == [(374, 44), (396, 109)]
    assert rows[0].arrival_s == 0.0
    assert rows[1].arrival_s == pytest.approx(4.314579, abs=1e-6)
    later = load_azure_trace(start=1, count=2)
    assert later[0].arrival_s == 0.0
    assert later[0].prompt_tokens == 396


@pytest.mark.parametrize("rate", [0.5, 5.0, 40.0], ids=["slower", "about-native", "compressed"])
def test_at_rate_scales_every_gap_by_one_factor(rate: float) -> None:
    rows = load_azure_trace(count=200)
    scaled = at_rate(rows, rate)
    assert (len(scaled) - 1) / scaled[-1].arrival_s == pytest.approx(rate)
    gaps = np.diff([r.arrival_s for r in rows])
    new_gaps = np.diff([r.arrival_s for r in scaled])
    assert np.allclose(new_gaps / gaps, new_gaps[0] / gaps[0])
    assert [r.prompt_tokens for r in scaled] == [r.prompt_tokens for r in rows]


def test_requests_longer_than_the_model_are_counted_not_truncated() -> None:
    rows = [TraceRequest(0.0, 3000, 100), TraceRequest(1.0, 4000, 200), TraceRequest(2.0, 100, 4000)]
    kept, dropped = fit_to_model_len(rows, 4096)
    assert (kept, dropped) == ([rows[0]], 2)


@cache
def replay(seed: int) -> tuple[ReplayResult, float]:
    """200 trace requests at ~20 % of two H100 replicas' capacity; (result, warm-up end)."""
    profile = load_profile("llama3-8b-h100")
    trace, _ = fit_to_model_len(load_azure_trace(count=260), profile.engine.max_model_len)
    requests = at_rate(trace, 7.0)
    config = ReplayConfig(profile=profile, facts=FACTS, replicas=2, seed=seed)
    return run_replay(requests, config, finish=200), 15.0


def test_replay_is_deterministic() -> None:
    first, _ = replay(0)
    profile = load_profile("llama3-8b-h100")
    trace, _ = fit_to_model_len(load_azure_trace(count=260), profile.engine.max_model_len)
    again = run_replay(
        at_rate(trace, 7.0), ReplayConfig(profile=profile, facts=FACTS, replicas=2, seed=0), finish=200
    )
    assert again.records == first.records
    assert (again.steps, again.scrapes, again.end_s) == (first.steps, first.scrapes, first.end_s)
    assert {r.replica for r in first.records} == {"r0", "r1"}  # least outstanding spreads them
    assert len([r for r in first.records if r.index < 200]) == 200


def ape(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    errors = np.abs(np.array([p - a for p, a in pairs]) / np.array([a for _, a in pairs]))
    return float(np.median(errors)), float(np.percentile(errors, 90))


def test_predictions_match_the_emulator_within_the_issue_targets_at_moderate_load() -> None:
    result, warmup_s = replay(0)
    records = [r for r in result.records if r.arrival_s >= warmup_s and r.index < 200]
    assert len(records) > 120
    assert all(r.forecast.valid for r in records)
    ttft = ape([(r.forecast.ttft_s, r.ttft_s) for r in records if r.ttft_s])
    tpot = ape([(r.forecast.tpot_s, r.tpot_s) for r in records if r.tpot_s])
    # The accuracy targets: TTFT median <= 15 %, p90 <= 35 %; TPOT median <= 10 %, p90 <= 25 %.
    assert ttft[0] <= 0.15, ttft
    assert ttft[1] <= 0.35, ttft
    assert tpot[0] <= 0.10, tpot
    assert tpot[1] <= 0.25, tpot
    for report in result.reports.values():
        assert report is not None
        assert report.valid
        assert report.observations_total > 50


def test_capacity_is_the_saturated_rate() -> None:
    profile = load_profile("llama3-8b-h100")
    trace, _ = fit_to_model_len(load_azure_trace(count=100), profile.engine.max_model_len)
    capacity = measure_capacity(profile, trace, min_requests=600)
    # Thousand-token prompts and ~200-token answers: tens of requests per second on one H100.
    assert 5.0 < capacity < 100.0
