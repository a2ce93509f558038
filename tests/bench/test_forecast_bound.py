"""``bench.forecast_bound``: the engine copied at a dispatch replays the request's real TTFT and
TPOT under the real future, and an oracle's forecast minimises the mean APE of its futures."""

from __future__ import annotations

import pytest

from bench.forecast_bound import DispatchRecorder, _run_future, best_ape_forecast, main
from bench.predictor_accuracy import FACTS, Schedule
from replay import ReplayConfig, fit_to_model_len, load_azure_trace, measure_capacity, run_replay
from simulator.profile import load_profile


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        pytest.param([0.010], 0.010, id="one"),
        # weights 100, 50, 25: the first already holds more than half of them
        pytest.param([0.010, 0.020, 0.040], 0.010, id="short-ones-weigh-more"),
        # weights 50, 50, 50, 50: the lower weighted median
        pytest.param([0.020, 0.020, 0.020, 0.020], 0.020, id="equal"),
        pytest.param([0.040, 0.010, 0.010, 0.040, 0.040], 0.010, id="unsorted"),
    ],
)
def test_best_ape_forecast_is_the_inverse_weighted_median(values: list[float], expected: float) -> None:
    assert best_ape_forecast(values) == expected


def test_best_ape_forecast_beats_every_other_value_on_its_sample() -> None:
    values = [0.012, 0.015, 0.021, 0.030, 0.055, 0.060]
    best = best_ape_forecast(values)

    def mean_ape(f: float) -> float:
        return sum(abs(f - y) / y for y in values) / len(values)

    for other in [0.010 + 0.001 * k for k in range(60)]:
        assert mean_ape(best) <= mean_ape(other) + 1e-12, other


#: Dispatches whose copied engine is replayed and compared (each replays the whole future after
#: it, so the cost grows with the count; an exact match on every one of 30 is the behaviour).
CHECKED = 30


@pytest.mark.slow
def test_the_copied_engine_replays_each_requests_real_latencies_under_the_real_future() -> None:
    name = "llama3-8b-h100"
    profile = load_profile(name)
    trace, _ = fit_to_model_len(load_azure_trace(start=0, count=300), profile.engine.max_model_len)
    rate = measure_capacity(profile, trace, min_requests=600)  # 100 % load: a busy batch
    schedule = Schedule(warmup_s=4.0, measure_s=6.0, cooldown_s=10.0, max_requests=300)
    requests, first, last, finish = schedule.cell(trace, rate)
    chosen = {i for i, r in enumerate(requests) if first <= r.arrival_s < last}
    config = ReplayConfig(profile=profile, facts=FACTS[name], replicas=1, seed=0)
    recorder = DispatchRecorder(chosen, [])
    outcome = {r.index: r for r in run_replay(requests, config, finish=finish, on_dispatch=recorder).records}
    checked = 0
    for snap in recorder.snapshots:
        record = outcome.get(snap.index)
        if record is None or record.tpot_s is None:
            continue
        stats = _run_future(snap, requests[snap.index + 1 :], profile, config.max_tokens, None, None)
        assert stats is not None, snap.index
        assert (stats.ttft_s, stats.tpot_s) == (record.ttft_s, record.tpot_s), snap.index
        checked += 1
        if checked == CHECKED:
            break
    assert checked == CHECKED


@pytest.mark.parametrize("option", ["--samples", "--futures", "--trace-rows"])
def test_counts_below_one_are_refused(option: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A run that would score nothing says so, instead of printing an empty table."""
    with pytest.raises(SystemExit) as exited:
        main([option, "0"])
    assert exited.value.code == 2
    assert f"{option} must be at least 1" in capsys.readouterr().err
