"""Online step-model fit: prior on minute one, recovery from noisy data, robustness, forgetting."""

from __future__ import annotations

import math

import numpy as np
import pytest

from predictor.calibrate import CalibrationConfig, StepCalibrator
from predictor.hardware import GPUS, UNKNOWN_GPU
from predictor.model import MODELS
from predictor.observations import (
    Observation,
    ObservationSource,
    Reject,
    WindowStats,
    mean_excess_tokens,
    observation_from_window,
)
from predictor.step_model import (
    Efficiency,
    ModelSource,
    StepBatch,
    StepModel,
    roofline_prior,
    unknown_step_model,
)

#: The priors the truths below are placed against (near one, twice as slow...): the roofline at
#: 50 % of peak FLOP/s, the default guess until 2026-12-01, pinned so that the truths keep their
#: distance from it whatever the default becomes.
_AT_HALF_PEAK = Efficiency(compute=0.5)
PRIOR_8B = roofline_prior(MODELS["Llama-3-8B"], GPUS["H100-SXM"], efficiency=_AT_HALF_PEAK)
PRIOR_70B_TP4 = roofline_prior(
    MODELS["Llama-3-70B"], GPUS["H100-SXM"], tensor_parallel=4, efficiency=_AT_HALF_PEAK
)
NO_PRIOR = roofline_prior(MODELS["Llama-3-8B"], UNKNOWN_GPU)


def truth_like(prior: StepModel, coefficients: tuple[float, ...]) -> StepModel:
    return StepModel(prior.params.with_coefficients(list(coefficients)))


def random_batch(rng: np.random.Generator, max_seqs: int, budget: int, max_ctx: int) -> StepBatch:
    """A vLLM-like step: some decodes, sometimes a prefill chunk filling part of the budget."""
    n = int(rng.integers(1, max_seqs + 1))
    chunk = int(rng.integers(1, budget - n + 1)) if rng.random() < 0.4 else 0
    ctx = int(rng.integers(max_ctx // 10, max_ctx + 1))
    done = int(rng.integers(0, 4 * budget)) if chunk else 0
    return StepBatch(chunk, n, n * ctx, chunk * (chunk / 2 + done))


def feed(
    cal: StepCalibrator,
    truth: StepModel,
    rng: np.random.Generator,
    count: int,
    *,
    start_s: float = 0.0,
    every_s: float = 5.0,
    noise: float = 0.05,
    outliers: float = 0.0,
    max_seqs: int = 256,
    budget: int = 8192,
    max_ctx: int = 4096,
) -> float:
    """Feed ``count`` noisy step observations; return the time of the last one."""
    t = start_s
    for i in range(count):
        t = start_s + i * every_s
        batch = random_batch(rng, max_seqs, budget, max_ctx)
        y = truth.step_time(batch) * (1.0 + noise * rng.standard_normal())
        if rng.random() < outliers:
            y *= rng.choice([0.3, 3.0, 8.0])  # a preemption storm, a GC pause, a broken window
        cal.observe_step(t, batch, max(y, 1e-4))
    return t


def prediction_error(model: StepModel, truth: StepModel, rng: np.random.Generator, **kw: int) -> float:
    """Worst relative error of ``model`` against ``truth`` over 200 fresh random batches."""
    worst = 0.0
    for _ in range(200):
        b = random_batch(rng, kw.get("max_seqs", 256), kw.get("budget", 8192), kw.get("max_ctx", 4096))
        worst = max(worst, abs(model.step_time(b) / truth.step_time(b) - 1.0))
    return worst


def test_zero_observations_use_the_prior_alone() -> None:
    cal = StepCalibrator(PRIOR_8B)
    result = cal.fit(now_s=0.0)
    assert result.model is PRIOR_8B
    assert result.model.source == ModelSource.PRIOR
    r = result.report
    assert (r.observations_total, r.observations_kept, r.mdape, r.valid) == (0, 0, None, True)
    assert r.params == PRIOR_8B.params


def test_zero_observations_without_prior_is_invalid() -> None:
    result = StepCalibrator(NO_PRIOR).fit(now_s=0.0)
    assert not result.model.valid
    assert result.model.source == ModelSource.NONE
    assert result.report.reason is not None
    assert "unknown hardware" in result.report.reason
    assert math.isnan(result.model.step_time(StepBatch(decode_seqs=4)))


# Truths: a machine near its roofline, one twice as slow as the prior thinks, and a TP=4 70B.
# Tolerance: predictions within 6% of the truth on fresh batches (noise 5%, 10% outliers).
@pytest.mark.parametrize(
    ("prior", "coefficients", "seed"),
    [
        (PRIOR_8B, (0.009, 2e-6, 1.2e-5, 2.6e-5, 6e-8, 8.5e-10), 1),
        (PRIOR_8B, (0.016, 0.0, 2e-5, 6.5e-5, 1.0e-7, 2.1e-9), 2),
        (PRIOR_70B_TP4, (0.018, 1e-6, 1e-5, 7e-5, 3e-8, 9e-10), 3),
    ],
    ids=["near-prior", "twice-slower-than-prior", "70b-tp4"],
)
def test_fit_recovers_known_parameters_despite_noise_and_outliers(
    prior: StepModel, coefficients: tuple[float, ...], seed: int
) -> None:
    truth = truth_like(prior, coefficients)
    rng = np.random.default_rng(seed)
    cal = StepCalibrator(prior)
    last = feed(cal, truth, rng, 300, noise=0.05, outliers=0.10)
    result = cal.fit(now_s=last)
    fitted = result.model
    assert fitted.source == ModelSource.FITTED
    assert fitted.valid
    assert prediction_error(fitted, truth, rng) < 0.06
    got, want = fitted.params.coefficients(), coefficients
    assert got[0] == pytest.approx(want[0], rel=0.10)  # base
    assert got[4] == pytest.approx(want[4], rel=0.15)  # per KV token
    assert got[3] == pytest.approx(want[3], rel=0.10)  # per token past the knee
    assert got[5] == pytest.approx(want[5], rel=0.15)  # per prefill attention pair
    assert result.report.mdape is not None
    assert result.report.mdape < 0.06
    assert result.report.prior_mdape is not None


@pytest.mark.parametrize(
    ("robust_from", "max_error"),
    [(8, 0.06), (10**9, None)],
    ids=["huber", "plain-least-squares"],
)
def test_outliers_need_the_robust_loss(robust_from: int, max_error: float | None) -> None:
    truth = truth_like(PRIOR_8B, (0.016, 0.0, 2e-5, 6.5e-5, 1.0e-7, 2.1e-9))
    rng = np.random.default_rng(2)
    cal = StepCalibrator(PRIOR_8B, CalibrationConfig(robust_min_observations=robust_from))
    last = feed(cal, truth, rng, 300, noise=0.05, outliers=0.10)
    error = prediction_error(cal.fit(now_s=last).model, truth, rng)
    if max_error is not None:
        assert error < max_error
    else:
        assert error > 0.15  # the same data spoils a non-robust fit


def test_fit_improves_on_a_wrong_prior() -> None:
    truth = truth_like(PRIOR_8B, (0.016, 0.0, 2e-5, 6.5e-5, 1.0e-7, 2.1e-9))
    rng = np.random.default_rng(7)
    cal = StepCalibrator(PRIOR_8B)
    last = feed(cal, truth, rng, 60)
    report = cal.fit(now_s=last).report
    assert report.prior_mdape is not None
    assert report.mdape is not None
    assert report.prior_mdape > 0.3
    assert report.mdape < 0.1


def test_prior_weight_decays_with_observations_but_keeps_a_floor() -> None:
    cfg = CalibrationConfig()
    cal = StepCalibrator(PRIOR_8B, cfg)
    rng = np.random.default_rng(3)
    weights = []
    for _ in range(4):
        last = feed(cal, PRIOR_8B, rng, 50, every_s=0.1)
        weights.append(cal.fit(now_s=last).report.prior_weight)
    assert weights == sorted(weights, reverse=True)
    assert weights[-1] >= cfg.prior_floor


def test_forgetting_tracks_a_change() -> None:
    before = truth_like(PRIOR_8B, (0.008, 0.0, 1e-5, 3e-5, 5e-8, 1e-9))
    # e.g. thermal throttling, or a noisy neighbour on the host
    after = truth_like(PRIOR_8B, (0.014, 0.0, 1e-5, 5e-5, 9e-8, 1.6e-9))
    rng = np.random.default_rng(11)
    cal = StepCalibrator(PRIOR_8B, CalibrationConfig(half_life_s=300.0))
    t = feed(cal, before, rng, 120, every_s=10.0)  # 20 min of the old machine
    t = feed(cal, after, rng, 120, start_s=t + 10.0, every_s=10.0)  # 20 min of the new one
    fitted = cal.fit(now_s=t).model
    assert prediction_error(fitted, after, rng) < 0.08


def test_unknown_hardware_is_learned_from_observations_alone() -> None:
    # A CPU replica: purely linear in tokens, no knee; nothing like a GPU.
    cpu = truth_like(NO_PRIOR, (0.02, 1e-4, 1e-4, 0.0, 1e-7, 3e-9))
    rng = np.random.default_rng(5)
    cfg = CalibrationConfig()
    cal = StepCalibrator(NO_PRIOR, cfg)
    kw = {"max_seqs": 8, "budget": 512, "max_ctx": 1000}
    for i in range(cfg.min_observations_without_prior - 1):
        cal.observe_step(float(i), random_batch(rng, **kw), 0.03)
        assert not cal.fit(now_s=float(i)).model.valid
    cal2 = StepCalibrator(NO_PRIOR, cfg)
    t = 0.0
    for i in range(80):
        t = float(i)
        b = random_batch(rng, **kw)
        cal2.observe_step(t, b, cpu.step_time(b) * (1 + 0.03 * rng.standard_normal()))
    result = cal2.fit(now_s=t)
    assert result.model.valid
    assert result.report.prior is None
    assert prediction_error(result.model, cpu, rng, **kw) < 0.08


def test_coefficients_stay_non_negative_on_nonsense_data() -> None:
    cal = StepCalibrator(NO_PRIOR)
    rng = np.random.default_rng(9)
    for i in range(40):
        n = float(rng.integers(1, 200))
        # Step time falling with batch size: a fit without constraints would go negative.
        cal.observe_step(float(i), StepBatch(decode_seqs=n, kv_tokens_read=n * 1000), 0.05 / n + 0.001)
    coefficients = cal.fit(now_s=40.0).model.params.coefficients()
    assert min(coefficients) >= 0.0


def test_window_observations_fit_mixed_steps_through_the_histogram() -> None:
    """Windows mix decode-only steps with big prefill steps; the bucket histogram carries the hinge."""
    truth = truth_like(PRIOR_8B, (0.009, 0.0, 1.2e-5, 2.8e-5, 6e-8, 9e-10))
    rng = np.random.default_rng(13)
    cal = StepCalibrator(PRIOR_8B)
    les = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, math.inf)
    for w in range(60):
        n = int(rng.integers(8, 200))
        kv = n * int(rng.integers(300, 3000))
        chunk = int(rng.integers(1000, 8000))
        share = float(rng.uniform(0.05, 0.5))  # fraction of steps that carry a prefill chunk
        t_dec = truth.step_time(StepBatch(0, n, kv))
        t_mix = truth.step_time(StepBatch(chunk, n, kv, chunk * chunk / 2))
        steps = 1000.0
        mean_step = (1 - share) * t_dec + share * t_mix
        counts = {n: steps * (1 - share), n + chunk: steps * share}
        buckets = tuple((le, sum(c for tok, c in counts.items() if tok <= le)) for le in les)
        window = WindowStats(
            at_s=w * 10.0,
            window_s=steps * mean_step,
            steps_per_s=1 / mean_step,
            mean_tokens_per_step=n + share * chunk,
            mean_itl_s=mean_step,
            running=n,
            waiting=2,
            kv_tokens_in_use=kv,
            prompt_tokens_per_s=share * chunk / mean_step,
            generation_tokens_per_s=n / mean_step,
            mean_prompt_tokens=float(chunk),
            busy=True,
            tokens_per_step_buckets=buckets,
        )
        obs = cal.observe_window(window)
        assert obs.valid
        assert obs.source == ObservationSource.WINDOW_PERIOD
    report = cal.fit(now_s=600.0).report
    assert report.mdape is not None
    assert report.mdape < 0.05


def _window(**overrides: object) -> WindowStats:
    base: dict[str, object] = {
        "at_s": 100.0,
        "window_s": 5.0,
        "steps_per_s": 50.0,  # 20 ms period
        "mean_tokens_per_step": 300.0,
        "mean_itl_s": 0.02,
        "running": 40.0,
        "waiting": 0.0,
        "kv_tokens_in_use": 80_000.0,
        "prompt_tokens_per_s": 13_000.0,
        "generation_tokens_per_s": 2_000.0,  # 40 per step
        "busy": True,
    }
    return WindowStats(**(base | overrides))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("overrides", "source", "step_s", "decode", "prefill"),
    [
        ({}, ObservationSource.WINDOW_PERIOD, 0.02, 40.0, 260.0),
        ({"busy": False}, ObservationSource.WINDOW_ITL, 0.02, 40.0, 260.0),
        ({"busy": False, "waiting": 3.0}, ObservationSource.WINDOW_PERIOD, 0.02, 40.0, 260.0),
        ({"mean_itl_s": 0.01}, ObservationSource.WINDOW_ITL, 0.01, 40.0, 260.0),  # idle gaps: period 2x ITL
        ({"mean_itl_s": None}, ObservationSource.WINDOW_PERIOD, 0.02, 40.0, 260.0),
        ({"mean_tokens_per_step": None}, ObservationSource.WINDOW_PERIOD, 0.02, 40.0, 260.0),
    ],
    ids=[
        "busy-period",
        "idle-uses-itl",
        "waiting-means-busy",
        "period-too-long-uses-itl",
        "no-itl",
        "no-histogram",
    ],
)
def test_window_to_observation(
    overrides: dict[str, object], source: ObservationSource, step_s: float, decode: float, prefill: float
) -> None:
    obs = observation_from_window(_window(**overrides), knee_tokens=200.0)
    assert obs.valid
    assert obs.source == source
    assert obs.step_s == pytest.approx(step_s)
    assert obs.batch.decode_seqs == pytest.approx(decode)
    assert obs.batch.prefill_tokens == pytest.approx(prefill)
    assert obs.batch.kv_tokens_read == 80_000.0
    assert obs.excess_tokens == pytest.approx(100.0)  # hinge of the mean without buckets


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"steps_per_s": 0.0}, Reject.NO_STEPS),
        ({"busy": False, "mean_itl_s": None}, Reject.NO_STEP_TIME),
        ({"kv_tokens_in_use": math.nan}, Reject.NOT_FINITE),
        ({"running": -1.0}, Reject.OUT_OF_RANGE),
        ({"steps_per_s": 0.001, "mean_itl_s": None}, Reject.OUT_OF_RANGE),  # a 1000 s "step"
    ],
    ids=["idle-window", "no-timing", "nan", "negative", "absurd-step"],
)
def test_unusable_windows_are_rejected_and_counted(overrides: dict[str, object], reason: Reject) -> None:
    cal = StepCalibrator(PRIOR_8B)
    obs = cal.observe_window(_window(**overrides))
    assert not obs.valid
    assert obs.reason == reason
    report = cal.fit(now_s=200.0).report
    assert report.rejected == ((reason, 1),)
    assert report.observations_total == 0


@pytest.mark.parametrize(
    ("buckets", "mean", "knee", "expected"),
    [
        (((64.0, 10.0), (128.0, 10.0), (math.inf, 10.0)), 40.0, 200.0, 0.0),
        (((256.0, 0.0), (512.0, 10.0), (math.inf, 10.0)), 384.0, 256.0, 128.0),  # whole bucket above
        (((256.0, 0.0), (512.0, 10.0), (math.inf, 10.0)), 384.0, 384.0, 32.0),  # straddles: 128^2/(2x256)
        # overflow: its point is (1e5 - 5 x 4) / 5, and it holds half the steps
        (((8.0, 5.0), (16384.0, 5.0), (math.inf, 10.0)), 10_000.0, 1000.0, 9_498.0),
        ((), 500.0, 100.0, None),
        (((8.0, 0.0), (math.inf, 0.0)), 0.0, 100.0, None),
        # vLLM's coarse buckets: 9 decode steps of 24 tokens, one 1000-token prefill step. The
        # exact mean places the big step at 1000, not at its bucket's midpoint (768 -> 58.3).
        (((16.0, 0.0), (32.0, 9.0), (512.0, 9.0), (1024.0, 10.0), (math.inf, 10.0)), 121.6, 185.0, 81.5),
        # A mean the buckets cannot hold (all steps in (512, 1024]) is clamped to their bounds.
        (((512.0, 0.0), (1024.0, 10.0), (math.inf, 10.0)), 5000.0, 100.0, 924.0),
    ],
    ids=[
        "below-knee",
        "bucket-above-knee",
        "bucket-straddles-knee",
        "overflow-bucket",
        "no-buckets",
        "empty",
        "skewed-coarse-bucket",
        "mean-outside-buckets",
    ],
)
def test_mean_excess_tokens(
    buckets: tuple[tuple[float, float], ...], mean: float, knee: float, expected: float | None
) -> None:
    got = mean_excess_tokens(buckets, mean, knee)
    if expected is None:
        assert got is None
    else:
        assert got == pytest.approx(expected)


def test_ring_keeps_only_capacity_observations() -> None:
    cal = StepCalibrator(PRIOR_8B, CalibrationConfig(capacity=16))
    rng = np.random.default_rng(1)
    last = feed(cal, PRIOR_8B, rng, 40)
    report = cal.fit(now_s=last).report
    assert (report.observations_total, report.observations_kept) == (40, 16)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="positive"):
        CalibrationConfig(half_life_s=0.0)


@pytest.mark.parametrize(
    ("true_knee", "chosen"),
    [(0.0, 0.0), (256.0, 256.0), (512.0, 512.0)],
    ids=["linear-machine-like-a-cpu", "gpu-knee-256", "gpu-knee-512"],
)
def test_without_a_prior_the_knee_is_learned(true_knee: float, chosen: float) -> None:
    """Steps of a machine flat up to ``true_knee`` tokens then linear: the fit picks that knee."""
    calibrator = StepCalibrator(unknown_step_model("unknown hardware"))
    assert calibrator.knees == (0.0, 64.0, 128.0, 256.0, 512.0)
    for i, tokens in enumerate([1, 8, 32, 100, 200, 300, 400, 600, 900, 1500, 2000, 50, 700, 1200] * 3):
        batch = StepBatch(prefill_tokens=float(tokens), decode_seqs=0.0, kv_tokens_read=0.0)
        step_s = 0.004 + 2e-5 * max(0.0, tokens - true_knee)
        calibrator.observe_step(float(i), batch, step_s)
    fit = calibrator.fit(50.0)
    assert fit.model.params.knee_tokens == chosen
    assert fit.report.mdape is not None
    assert fit.report.mdape < 0.1  # the weak pull toward a constant step time costs a little


@pytest.mark.parametrize(
    ("flat_to", "chosen"),
    [(1.0, 1.0), (0.25, 0.25)],
    ids=["flat-to-the-prior-knee", "flat-to-a-quarter-of-it"],
)
def test_with_a_prior_the_knee_is_chosen_at_or_below_it(flat_to: float, chosen: float) -> None:
    """Steps flat up to ``flat_to`` x the prior's knee, then at the prior's compute slope: the
    fit takes that knee, not a steep slope below the prior's that decode steps would inherit."""
    calibrator = StepCalibrator(PRIOR_8B)
    knee = PRIOR_8B.params.knee_tokens
    assert calibrator.knees == (knee, knee / 2, knee / 4)
    slope = PRIOR_8B.params.per_compute_token_s
    for i, tokens in enumerate([1, 16, 40, 80, 120, 160, 200, 300, 600, 1000, 2000, 4000, 8000] * 3):
        batch = StepBatch(prefill_tokens=float(tokens), decode_seqs=0.0, kv_tokens_read=0.0)
        step_s = 0.007 + slope * max(0.0, tokens - flat_to * knee)
        calibrator.observe_step(float(i), batch, step_s)
    fit = calibrator.fit(50.0)
    assert fit.model.params.knee_tokens == pytest.approx(chosen * knee)
    one_token = StepBatch(prefill_tokens=1.0)
    assert fit.model.step_time(one_token) == pytest.approx(0.007, rel=0.05)


def _window_row(at_s: float, batch: StepBatch, step_s: float) -> Observation:
    excess = max(0.0, batch.tokens - PRIOR_8B.params.knee_tokens)
    return Observation(at_s, batch, excess, step_s, ObservationSource.WINDOW_PERIOD)


@pytest.mark.parametrize(
    ("balance", "low", "high"),
    [(True, 1.04, 1.14), (False, 1.17, 1.21)],
    ids=["each-source-weighs-alike", "by-count"],
)
def test_a_source_with_few_rows_is_not_drowned_by_one_with_many(
    balance: bool, low: float, high: float
) -> None:
    """600 timed steps that read 20 % slow and 20 windows that read true: balanced, the fit
    lands halfway (each view of the engine one vote); by count, the many rows decide."""
    truth = truth_like(PRIOR_8B, (0.009, 2e-6, 1.2e-5, 2.6e-5, 6e-8, 8.5e-10))
    rng = np.random.default_rng(4)
    cal = StepCalibrator(PRIOR_8B, CalibrationConfig(balance_sources=balance))
    for i in range(20):
        batch = random_batch(rng, 256, 8192, 4096)
        cal.observe(_window_row(float(i), batch, truth.step_time(batch)))
    for i in range(600):
        batch = random_batch(rng, 256, 8192, 4096)
        cal.observe_step(20.0 + i * 0.01, batch, 1.2 * truth.step_time(batch))
    fitted = cal.fit(now_s=26.0).model
    ratios = [
        fitted.step_time(b) / truth.step_time(b)
        for b in (random_batch(rng, 256, 8192, 4096) for _ in range(200))
    ]
    assert low < float(np.median(ratios)) < high


def test_each_source_keeps_its_own_ring() -> None:
    """Timed steps, however many, never push the windows out of the fit."""
    cal = StepCalibrator(PRIOR_8B, CalibrationConfig(capacity=16))
    rng = np.random.default_rng(1)
    for i in range(5):
        batch = random_batch(rng, 256, 8192, 4096)
        cal.observe(_window_row(float(i), batch, PRIOR_8B.step_time(batch)))
    last = feed(cal, PRIOR_8B, rng, 40, start_s=10.0)
    report = cal.fit(now_s=last).report
    assert (report.observations_total, report.observations_kept) == (45, 21)
