"""A mixed fleet behind one gateway: one emulated vLLM, one TGI, one SGLang.

Three emulator processes (``python -m simulator --engine vllm|tgi|sglang``, one profile, so they
serve the same model) sit behind the real gateway (``build_app`` on a free port, in this process),
each declared with its engine and what an operator knows (``bench.live_runs.fleet_run``). Clients
in their own process drive a closed loop: ``OPENAI_CLIENTS`` stream chat completions with the real
``openai`` SDK (routed anywhere in the fleet), ``TGI_CLIENTS`` stream TGI's native
``POST /generate_stream`` (only TGI serves it). The run goes on until every engine has answered
``MIN_SAMPLES`` requests sent after ``WARMUP_S`` seconds with a forecast (a count, so a slow host
makes the run longer, not a failure; ``FleetLoad.request_cap`` ends a run where that never comes).

These are behaviour checks, not the accuracy targets (those are measured by
``python -m bench.live_accuracy``, results in docs/engines.md): every request answered and routed
to an engine that serves its API, forecast after the warm-up, every engine's fit valid, each
engine's forecasts within 2x of what its requests measured (median of predicted / observed), TGI's
fitted step model within 2x of the emulator's cost model, and TGI's context length from its ``/info``.
"""

from __future__ import annotations

from collections import Counter

import pytest

from bench.live_accuracy import describe
from bench.live_runs import ENGINES, MAX_MODEL_LEN, PROFILE, FleetLoad, FleetRun, fleet_run
from predictor import StepBatch
from simulator.costmodel import CostModel, StepShape
from simulator.profile import load_profile
from tests.support import speed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

#: Eight clients over three engines: two or three streams per replica, so each engine's batch holds
#: a few sequences and TGI's fit sees batches of 2-8 (the step-time check below).
OPENAI_CLIENTS = 6
TGI_CLIENTS = 2
#: Requests sent before this are left out: the fits need a few scrapes, and the dispatch overhead
#: (an EWMA over 10 s scrape windows) needs about 20 s to forget the start-up's stalls (with 10 s,
#: one run on a heavily loaded host over-forecast TGI's TTFT 2.4x).
WARMUP_S = 16.0
#: Measured requests per engine the run goes on until (the median ratios need a few dozen; more
#: spread them over a longer window, so one stall of the host weighs less).
MIN_SAMPLES = 40
#: The median of predicted / observed must lie within this on an idle host: forecasts within 2x
#: of measured. Both sides carry the host's stalls (the forecast through the dispatch overhead it
#: learned, the measurement directly), so the bounds widen by the host-speed factor.
RATIO_BOUNDS = (0.5, 2.0)


@pytest.fixture(scope="module")
def run() -> FleetRun:
    """Three emulators, one gateway, one load run for every test of this module."""
    load = FleetLoad(
        openai_clients=OPENAI_CLIENTS, tgi_clients=TGI_CLIENTS, warmup_s=WARMUP_S, wanted=MIN_SAMPLES
    )
    speed.factor(fresh=True)  # before and after: the larger one counts
    got = fleet_run(load)
    print(f"host-speed factor after the run: {speed.factor(fresh=True):.2f}")
    print(f"\n{len(got.samples)} requests, measured after {WARMUP_S:g} s of warm-up:")
    print(Counter((s.replica, got.route[s.request_id], s.prediction, s.status) for s in got.samples))
    for engine in ENGINES:
        native = sum(1 for s in got.kept[engine] if got.route[s.request_id] == "tgi_native")
        print(f"{engine}: {len(got.kept[engine])} measured ({native} TGI-native)")
        print(describe(got.errors[engine]))
    print(f"TGI decode steps ran {got.tgi_decode_overhead_s * 1000:.2f} ms beyond their forward pass")
    if any(len(got.kept[e]) < MIN_SAMPLES for e in ENGINES):
        print(f"an engine was left without its share; the gateway's view: {got.state}")
    return got


def test_every_engine_served_and_forecast_its_share(run: FleetRun) -> None:
    assert all(s.status == 200 for s in run.samples), Counter(s.status for s in run.samples)
    assert {s.replica for s in run.samples} == set(ENGINES), Counter(s.replica for s in run.samples)
    native = [s for s in run.samples if run.route[s.request_id] == "tgi_native"]
    assert native, "TGI's native clients were served"
    assert {s.replica for s in native} == {"tgi"}, "TGI's native API reaches TGI only"
    late = [s for s in run.samples if s.sent_at >= min(x.sent_at for x in run.samples) + WARMUP_S]
    forecast_ok = sum(len(v) for v in run.kept.values())
    assert forecast_ok >= 0.95 * len(late), Counter(s.prediction for s in late)
    for engine in ENGINES:
        assert len(run.kept[engine]) >= MIN_SAMPLES, {e: len(k) for e, k in run.kept.items()}
        fit = run.service.report(engine)
        assert fit is not None, engine
        assert fit.valid, (engine, fit)
        assert fit.observations_total > 10, (engine, fit)


def test_tgi_context_length_comes_from_its_info(run: FleetRun) -> None:
    described = run.service.describe()["replicas"]
    assert isinstance(described, dict)
    for engine in ENGINES:
        assert described[engine]["facts"]["max_model_len"] == MAX_MODEL_LEN, engine


# Not a batch of one: with eight clients over three engines TGI's running batch is rarely one,
# so the fit there is an extrapolation of its intercept, not a check of what it learned.
@pytest.mark.parametrize("batch", [2, 4, 8])
def test_tgi_fit_matches_the_emulators_step_times(run: FleetRun, batch: int) -> None:
    """The TGI replica's step model, fitted from its measured step durations and batch sizes,
    against the emulator's cost model for decode steps of ``batch`` sequences of 600 tokens of
    context (the run's typical): between the forward pass alone and the forward pass plus the mean
    cycle overhead the emulator itself reported (its loop's lateness on this box), within
    ``RATIO_BOUNDS`` widened by the host-speed factor. A sanity bound: on a busy host the steps the
    fit sees stretch beyond the lateness the emulator reports, and the fit itself is checked
    exactly on known step times in ``tests/unit/prediction/test_tgi_calibration.py``."""
    model = run.service.step_model("tgi")
    assert model is not None
    assert model.valid
    context = 600
    forward = CostModel(load_profile(PROFILE)).step_time_s(StepShape(decode_contexts=(context,) * batch))
    fitted = model.step_time(StepBatch(0.0, batch, batch * context, 0.0))
    late = forward + run.tgi_decode_overhead_s
    low, high = speed.widened(*RATIO_BOUNDS)
    assert low * forward <= fitted <= high * late, (forward, late, fitted, speed.factor())


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("metric", ["ttft_gateway", "tpot"])
def test_forecasts_within_2x_of_measured(run: FleetRun, engine: str, metric: str) -> None:
    errors = run.errors[engine][metric]
    assert errors.n >= MIN_SAMPLES, describe({metric: errors})
    low, high = speed.widened(*RATIO_BOUNDS)
    assert low <= errors.median_ratio <= high, describe({metric: errors})
