"""The gateway's live forecasts on one emulated vLLM: every request forecast, forecasts sane.

The real gateway (``build_app`` on a free port, in this process) fronts one emulator process
(``llama3-8b-h100``) and knows only what an operator would (``bench.live_runs.single_run``).
``CONCURRENCY`` clients stream chat completions in a closed loop until ``MIN_SAMPLES`` requests
sent after ``WARMUP_S`` seconds were answered with a forecast (a count, not a time: a slow host
makes the run longer, not a failure).

These are behaviour checks, not the accuracy targets: the forecasts must be there and within 2x
of what the requests measured, which a broken predictor, a lost dispatch overhead or a unit error
would miss and a busy host would not. The accuracy targets are measured by
``python -m bench.live_accuracy`` (results in docs/predictor-accuracy.md, "Live").
"""

from __future__ import annotations

import pytest

from bench.live_accuracy import describe, measured, observed_summary
from bench.live_runs import SINGLE_REPLICA, SingleRun, single_run
from tests.support import speed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

CONCURRENCY = 4
WARMUP_S = 6.0
#: Measured requests the run goes on until (the median ratios need a few dozen).
MIN_SAMPLES = 40
#: The median of predicted / observed must lie within this on an idle host: forecasts within 2x
#: of measured. Both sides carry the host's stalls (the forecast through the dispatch overhead it
#: learned, the measurement directly), so the bounds widen by the host-speed factor.
RATIO_BOUNDS = (0.5, 2.0)


@pytest.fixture(scope="module")
def run() -> SingleRun:
    """One emulator, one gateway, one load run for every test of this module."""
    speed.factor(fresh=True)  # before and after: the larger one counts
    got = single_run(concurrency=CONCURRENCY, warmup_s=WARMUP_S, wanted=MIN_SAMPLES)
    print(f"host-speed factor after the run: {speed.factor(fresh=True):.2f}")
    print(f"\n{len(got.samples)} requests, {len(got.kept)} measured after {WARMUP_S:g} s of warm-up")
    print(describe(got.errors))
    print(observed_summary(got.kept))
    return got


def test_every_request_was_served_and_forecast(run: SingleRun) -> None:
    assert all(s.status == 200 for s in run.samples)
    assert all(s.replica == SINGLE_REPLICA for s in run.samples)
    after_warmup = measured(run.samples, warmup_s=WARMUP_S)  # keeps only forecasts that are "ok"
    late = [s for s in run.samples if s.sent_at >= min(x.sent_at for x in run.samples) + WARMUP_S]
    assert len(after_warmup) >= 0.95 * len(late), {s.prediction for s in late}
    assert len(run.kept) >= MIN_SAMPLES


@pytest.mark.parametrize("metric", ["ttft_gateway", "tpot"])
def test_forecasts_within_2x_of_measured(run: SingleRun, metric: str) -> None:
    errors = run.errors[metric]
    assert errors.n >= MIN_SAMPLES, describe({metric: errors})
    low, high = speed.widened(*RATIO_BOUNDS)
    assert low <= errors.median_ratio <= high, describe({metric: errors})
