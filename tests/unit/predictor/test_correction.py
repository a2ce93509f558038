"""``predictor.correction``: the measured correction's estimator, exactly, in the caller's time."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from predictor.correction import (
    NO_CORRECTION,
    Correction,
    CorrectionConfig,
    CorrectionLearner,
    regime,
    regime_label,
)

IDLE_SHORT = regime(100, 0)


def feed(
    learner: CorrectionLearner,
    ratio: float,
    *,
    start: float,
    until: float,
    every: float = 0.1,
    prompt: int = 100,
    decodes: float = 0.0,
    factor: float = 1.0,
) -> float:
    """Requests every ``every`` seconds from ``start`` to ``until`` measuring ``ratio`` times a
    1-second forecast (TTFT and TPOT alike); the time after the last."""
    t = start
    while t < until:
        sample = (ratio, 1.0, factor)
        learner.observe("r", at=t, prompt_tokens=prompt, decode_seqs=decodes, ttft=sample, tpot=sample)
        t += every
    return t


def test_regimes_bin_prompt_and_batch() -> None:
    assert regime(1, 0) == regime(255, 0) != regime(256, 0)
    assert regime(100, 0) != regime(100, 1) == regime(100, 3) != regime(100, 4)
    assert regime(10_000, 100) == 15
    assert regime_label(regime(300, 5)) == "prompt256-1023,batch4-15"
    assert regime_label(0) == "prompt<256,batch=0"


def test_nothing_learned_is_no_correction() -> None:
    learner = CorrectionLearner()
    assert learner.correction("r", 0.0) is NO_CORRECTION
    assert NO_CORRECTION.factors(5000, 20) == (1.0, 1.0)
    assert not NO_CORRECTION.active


def test_a_steady_bias_is_learned_within_the_forgetting_shrink() -> None:
    learner = CorrectionLearner()
    end = feed(learner, 2.0, start=0.0, until=60.0)
    ttft, tpot = learner.correction("r", end).factors(100, 0)
    # The regime's median is exactly 2; the forgetting pseudo-sample (1 against ~216) pulls it in
    # by under 1 % of the log.
    assert ttft == pytest.approx(2.0, rel=0.01)
    assert tpot == pytest.approx(2.0, rel=0.01)
    assert ttft < 2.0


def test_a_step_change_is_followed_within_a_minute_without_overshoot() -> None:
    learner = CorrectionLearner(CorrectionConfig(half_life_s=15.0))
    feed(learner, 1.0, start=0.0, until=60.0)
    seen = []
    t = 60.0
    while t < 180.0:
        learner.observe("r", at=t, prompt_tokens=100, decode_seqs=0, ttft=(3.0, 1.0, 1.0))
        seen.append((t, learner.correction("r", t).factors(100, 0)[0]))
        t += 0.1
    # Never beyond the new level (a median lies within the data), never back down once moved.
    assert max(f for _, f in seen) <= 3.0 + 1e-9
    assert all(b >= a - 1e-9 for (_, a), (_, b) in itertools.pairwise(seen))
    settled = [t for t, f in seen if f >= 0.9 * 3.0]
    assert settled
    assert settled[0] - 60.0 <= 30.0
    assert next(f for t, f in seen if t >= 120.0) == pytest.approx(3.0, rel=0.01)


def test_outliers_do_not_move_the_median() -> None:
    learner = CorrectionLearner()
    rng = random.Random(3)
    t = 0.0
    for i in range(600):
        ratio = 8.0 if i % 5 == 0 else 1.5 * math.exp(rng.gauss(0.0, 0.05))
        learner.observe("r", at=t, prompt_tokens=100, decode_seqs=0, ttft=(ratio, 1.0, 1.0))
        t += 0.1
    assert learner.correction("r", t).factors(100, 0)[0] == pytest.approx(1.5, rel=0.05)


def test_a_sample_far_above_the_forecast_is_not_learned() -> None:
    learner = CorrectionLearner(CorrectionConfig(max_factor=10.0))
    feed(learner, 2.0, start=0.0, until=10.0)
    before = learner.correction("r", 10.0).factors(100, 0)
    learner.observe("r", at=10.0, prompt_tokens=100, decode_seqs=0, ttft=(30.0, 1.0, 1.0))
    assert learner.correction("r", 10.0).factors(100, 0) == before
    assert learner.state("r", 10.0).ttft.out_of_range_total == 1


def test_samples_far_below_the_forecast_count_at_the_floor() -> None:
    # Three in five requests come back far faster than forecast (or before the overhead taken off
    # them), the rest at 0.8 of it. Dropped, the fast ones would leave the median at 0.8: the
    # forecast would stay high for most requests. Counted at the floor, they carry it there.
    learner = CorrectionLearner(CorrectionConfig(min_factor=0.25))
    t = 0.0
    for i in range(500):
        measured = (0.02, -0.01)[i % 2] if i % 5 < 3 else 0.8
        learner.observe("r", at=t, prompt_tokens=100, decode_seqs=0, ttft=(measured, 1.0, 1.0))
        t += 0.1
    factor = learner.correction("r", t).factors(100, 0)[0]
    assert factor == pytest.approx(0.25, rel=0.01)
    assert learner.state("r", t).ttft.out_of_range_total == 300


def test_a_tpot_far_below_the_forecast_is_not_learned() -> None:
    # A stream whose tokens came in one burst (a starved API server) measures a TPOT near 0: the
    # relay's, not the engine's pace. Learned, it would carry TPOT forecasts to the floor.
    learner = CorrectionLearner(CorrectionConfig(min_factor=0.25))
    t = feed(learner, 2.0, start=0.0, until=10.0)
    for i in range(300):  # three times the samples above: learned, they would be the median
        learner.observe("r", at=t, prompt_tokens=100, decode_seqs=0, tpot=((0.01, 0.0)[i % 2], 1.0, 1.0))
        t += 0.1
    assert learner.correction("r", t).factors(100, 0)[1] == pytest.approx(2.0, rel=0.02)
    assert learner.state("r", t).tpot.out_of_range_total == 150


def test_a_regime_with_few_samples_borrows_from_its_batch_bin() -> None:
    learner = CorrectionLearner()
    end = feed(learner, 2.0, start=0.0, until=30.0, prompt=100, decodes=0)
    # One long-prompt sample at 1.0 in the same batch bin: pooled, it stays near the bin's 2.
    learner.observe("r", at=end, prompt_tokens=2000, decode_seqs=0, ttft=(1.0, 1.0, 1.0))
    c = learner.correction("r", end)
    long_ttft = c.factors(2000, 0)[0]
    assert 1.0 < long_ttft < 2.0
    assert long_ttft > math.exp(0.5 * math.log(2.0))  # four pseudo-samples against one
    # A busy regime with no samples of its own is not taught by the idle one: no correction.
    assert c.factors(100, 8) == (1.0, 1.0)


def test_a_silent_replica_drifts_back_to_its_model() -> None:
    learner = CorrectionLearner(CorrectionConfig(half_life_s=15.0))
    end = feed(learner, 4.0, start=0.0, until=30.0)
    at = [learner.correction("r", end + d).factors(100, 0)[0] for d in (0.0, 60.0, 120.0, 240.0)]
    assert at[0] == pytest.approx(4.0, rel=0.02)
    assert at[0] > at[1] > at[2] > at[3]
    assert at[3] < 1.05


def test_residuals_before_and_after() -> None:
    learner = CorrectionLearner()
    t = 0.0
    for _ in range(100):
        # Forecast 1 s uncorrected, sent with a factor of 2, measured 2 s.
        learner.observe("r", at=t, prompt_tokens=100, decode_seqs=0, ttft=(2.0, 1.0, 2.0))
        t += 0.1
    res = learner.residuals("r", "ttft", t)
    assert res.samples == 100
    assert res.before_median == pytest.approx(1.0)
    assert res.after_median == pytest.approx(0.0)
    assert res.after_p90_abs == pytest.approx(0.0)
    assert learner.residuals("r", "tpot", t).samples == 0


def test_disabled_learns_nothing_and_reload_keeps_what_was_learned() -> None:
    off = CorrectionLearner(CorrectionConfig(enabled=False))
    feed(off, 2.0, start=0.0, until=10.0)
    assert off.correction("r", 10.0) is NO_CORRECTION
    on = CorrectionLearner()
    feed(on, 2.0, start=0.0, until=10.0)
    on.configure(CorrectionConfig(enabled=False))
    assert on.correction("r", 10.0) is NO_CORRECTION
    on.configure(CorrectionConfig())
    assert on.correction("r", 10.0).factors(100, 0)[0] > 1.5
    on.forget("r")
    assert on.correction("r", 10.0) is NO_CORRECTION


def test_the_factors_are_clamped() -> None:
    cfg = CorrectionConfig(min_factor=0.5, max_factor=3.0)
    learner = CorrectionLearner(cfg)
    feed(learner, 3.0, start=0.0, until=30.0)
    feed(learner, 0.5, start=0.0, until=30.0, decodes=8)
    c = learner.correction("r", 30.0)
    assert c.factors(100, 0)[0] <= 3.0
    assert c.factors(100, 8)[0] >= 0.5
    assert isinstance(c, Correction)
    assert c.active


@pytest.mark.parametrize(
    "knobs",
    [
        {"half_life_s": 0.0},
        {"min_factor": 1.5},
        {"max_factor": 0.9},
        {"prior_weight": -1.0},
        {"max_samples": 0},
    ],
)
def test_bad_knobs_are_refused(knobs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must"):
        CorrectionConfig(**knobs)  # type: ignore[arg-type]


def _spread_learner(ratios: list[float], *, decodes: float = 0.0) -> tuple[CorrectionLearner, float]:
    """Samples (TTFT and TPOT alike) cycling through ``ratios`` every 0.1 s for 60 s; the learner
    and the time after the last."""
    learner = CorrectionLearner()
    t = 0.0
    for i in range(600):
        sample = (ratios[i % len(ratios)], 1.0, 1.0)
        learner.observe("r", at=t, prompt_tokens=100, decode_seqs=decodes, ttft=sample, tpot=sample)
        t += 0.1
    return learner, t


def test_the_ttft_spread_is_the_quantile_over_the_median() -> None:
    # Twenty ratios 1.00 .. 1.95: the median 1.5 (pooled and forgotten: within 1 %), the 0.8 and
    # 0.95 quantiles 1.80 and 1.95 (the least value with more than that share of the weight at or
    # below it).
    learner, end = _spread_learner([1.0 + 0.05 * i for i in range(20)])
    c = learner.correction("r", end)
    median = c.factors(100, 0)[0]
    assert median == pytest.approx(1.5, rel=0.01)
    assert median * c.ttft_upper(0.95, 100, 0) == pytest.approx(1.95, rel=0.01)
    assert median * c.ttft_upper(0.8, 100, 0) == pytest.approx(1.80, rel=0.01)
    # Interpolated in the log between the grid's quantiles; 1 at or below the median; the last
    # quantile's above it.
    between = c.ttft_upper(0.85, 100, 0)
    assert c.ttft_upper(0.8, 100, 0) < between < c.ttft_upper(0.9, 100, 0)
    assert between == pytest.approx(math.sqrt(c.ttft_upper(0.8, 100, 0) * c.ttft_upper(0.9, 100, 0)))
    assert c.ttft_upper(0.5, 100, 0) == c.ttft_upper(0.3, 100, 0) == 1.0
    assert c.ttft_upper(0.999, 100, 0) == c.ttft_upper(0.99, 100, 0)


def test_a_steady_ratio_has_no_spread_and_the_spread_is_per_regime() -> None:
    learner, end = _spread_learner([2.0])
    c = learner.correction("r", end)
    assert c.ttft_upper(0.95, 100, 0) == pytest.approx(1.0)
    # A busy regime with no samples of its own borrows nothing from the idle one.
    assert c.ttft_upper(0.95, 100, 8) == 1.0


def test_the_spread_is_reported_per_regime() -> None:
    learner, end = _spread_learner([1.0, 1.0, 1.0, 3.0])
    state = learner.state("r", end).ttft.regimes
    assert [r.regime for r in state] == ["prompt<256,idle"]
    upper = state[0].upper
    assert len(upper) == 4
    assert upper == tuple(sorted(upper))  # a higher quantile lies no lower
    assert upper[2] == pytest.approx(learner.correction("r", end).ttft_upper(0.95, 100, 0))
    assert upper[2] > 2.5  # a quarter of the samples three times the median
    assert learner.state("r", end).tpot.regimes[0].upper == ()  # a TPOT's spread is not kept


def test_a_factor_times_its_spread_stays_within_the_clamp() -> None:
    learner, end = _spread_learner([1.0, 9.0])
    c = learner.correction("r", end)
    factor = c.factors(100, 0)[0]
    assert factor * c.ttft_upper(0.99, 100, 0) <= CorrectionConfig().max_factor + 1e-9


def test_the_spread_is_forgotten_with_the_median_and_can_be_switched_off() -> None:
    learner, end = _spread_learner([1.0, 1.0, 3.0])
    at = [learner.correction("r", end + d).ttft_upper(0.95, 100, 0) for d in (0.0, 60.0, 240.0)]
    assert at[0] > 2.0
    assert at[0] > at[1] > at[2]
    assert at[2] < 1.05
    learner.configure(CorrectionConfig(spread=False))
    assert learner.correction("r", end).ttft_upper(0.95, 100, 0) == 1.0
    assert learner.correction("r", end).ttft_spreads == ()
