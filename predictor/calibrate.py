"""Fit a replica's step model online from the observations its ``/metrics`` windows give.

``StepCalibrator`` keeps a bounded ring of observations (mean step composition and mean step time)
and fits the six ``predictor.step_model`` coefficients by robust (Huber), relative-error,
non-negative least squares, regularised toward the roofline prior and forgetting old observations
with ``half_life_s``. Coefficients are seconds per unit and never negative. A replica on unknown
hardware has no prior and is reported valid only after ``min_observations_without_prior``.
Synchronous arithmetic: times (``at_s``, ``now_s``) are the caller's monotonic seconds. The design
is in docs/predictor.md.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

import numpy as np
import numpy.typing as npt

from predictor.step_model import (
    FEATURE_NAMES,
    ModelSource,
    StepBatch,
    StepModel,
    StepParams,
)

__all__ = [
    "Calibration",
    "CalibrationConfig",
    "FitReport",
    "Observation",
    "ObservationSource",
    "Reject",
    "SourceKind",
    "StepCalibrator",
    "WindowStats",
    "mean_excess_tokens",
    "observation_from_window",
]

Vec = npt.NDArray[np.float64]
_NF: Final = len(FEATURE_NAMES)
_COMPUTE: Final = FEATURE_NAMES.index("tokens_past_knee")
_ATTN: Final = FEATURE_NAMES.index("attn_pairs")
# Feature magnitudes that make a coefficient "matter" when the data says nothing about its scale:
# the prior penalty is measured at least at these values relative to a typical step (see _units).
_REFERENCE: Final = np.array([1.0, 256.0, 64.0, 1024.0, 65536.0, 2048.0 * 2048.0 / 2.0])
#: Knees (tokens per step) a replica without a roofline prior chooses from by fit quality: 0 is a
#: machine with no weight-read-bound flat region (a CPU), the rest span GPUs' ridges.
_CANDIDATE_KNEES: Final = (0.0, 64.0, 128.0, 256.0, 512.0)
#: A relative residual counts at most this much when knees are compared (outliers must not decide).
_KNEE_LOSS_CAP: Final = 0.5
# Longest plausible engine step; anything above is a broken window, not a slow step.
_MAX_STEP_S: Final = 60.0


class ObservationSource(StrEnum):
    """How an observation's step time was measured."""

    STEP = "step"  # one measured step (TGI forward duration, emulator, synthetic)
    WINDOW_PERIOD = "window_period"  # window length / engine steps: the engine was busy throughout
    WINDOW_ITL = "window_itl"  # mean inter-token latency: decode steps only, robust to idle gaps


class SourceKind(StrEnum):
    """The two views of a replica's steps the fit learns from, which it weighs equally.

    Each has its own bias (a window's mean batch approximates its mixed steps; a step timed from
    outside the engine, e.g. a prefill from a request's TTFT, carries the model of the wait
    before it) and its own rate (a TTFT per finished request, a window per scrape), so its rows'
    errors are correlated: a thousand rows of one are not a thousand times the evidence of one
    row of the other, and must not drown it.
    """

    STEP = "step"  # ``ObservationSource.STEP``: one step (or one kind of step) timed
    WINDOW = "window"  # ``WINDOW_PERIOD`` and ``WINDOW_ITL``: a scrape window's mean step

    @staticmethod
    def of(source: ObservationSource) -> SourceKind:
        """The kind ``source`` is of."""
        return SourceKind.STEP if source == ObservationSource.STEP else SourceKind.WINDOW


class Reject(StrEnum):
    """Why a window or step was not usable. Bounded set: safe as a metric label."""

    NO_STEPS = "no_steps"
    NO_STEP_TIME = "no_step_time"
    NOT_FINITE = "not_finite"
    OUT_OF_RANGE = "out_of_range"


@dataclass(frozen=True, slots=True)
class WindowStats:
    """What one scrape window of a vLLM ``/metrics`` says, as rates and means over the window.

    ``at_s``: window end on the caller's monotonic clock (s). ``window_s``: its length (s, > 0).
    ``steps_per_s``: rate(``vllm:iteration_tokens_total_count``).
    ``mean_tokens_per_step``: rate(``_sum``) / rate(``_count``) of the same histogram; ``None`` if absent.
    ``mean_itl_s``: mean ``vllm:inter_token_latency_seconds`` over the window; ``None`` if no samples.
    ``running``, ``waiting``: ``num_requests_running`` / ``_waiting`` (mean of the window's scrapes).
    ``kv_tokens_in_use``: ``kv_cache_usage_perc`` x KV capacity in tokens.
    ``prompt_tokens_per_s``, ``generation_tokens_per_s``: rates of the two token counters.
    ``mean_ttft_s``: mean TTFT; carried for accuracy dashboards, not used by the step fit (it mixes
    queueing with step time).
    ``mean_prompt_tokens``: mean of ``vllm:request_prompt_tokens`` (for long-prompt attention);
    ``None`` if unknown.
    ``busy``: the caller saw the engine never idle (e.g. running > 0 at every scrape); ``waiting > 0``
    counts as busy too.
    ``tokens_per_step_buckets``: the window's increase of ``iteration_tokens_total_bucket`` as
    cumulative ``(le, count)`` pairs in ascending ``le`` (last may be ``inf``); empty if not scraped.
    ``steps_counted``: ``steps_per_s`` counts every step the engine ran (vLLM's iteration histogram),
    so that window / steps is the mean step when busy. ``False`` for an estimate that counts some
    steps only over a wall time that holds all of them (old SGLang: ``gen_throughput /
    num_running_reqs``, decode steps alone over a log interval that also ran the prefill batches);
    its period is then no step time and the ITL is used.
    """

    at_s: float
    window_s: float
    steps_per_s: float
    mean_tokens_per_step: float | None
    mean_itl_s: float | None
    running: float
    waiting: float
    kv_tokens_in_use: float
    prompt_tokens_per_s: float
    generation_tokens_per_s: float
    mean_ttft_s: float | None = None
    mean_prompt_tokens: float | None = None
    busy: bool = False
    tokens_per_step_buckets: tuple[tuple[float, float], ...] = ()
    steps_counted: bool = True


@dataclass(frozen=True, slots=True)
class Observation:
    """One (mean batch composition -> mean step time) pair, or why there is none.

    ``excess_tokens``: mean over the window's steps of ``max(0, tokens - knee)`` (the hinge feature;
    a per-step mean, which is not the hinge of the mean tokens when steps are mixed).
    """

    at_s: float
    batch: StepBatch
    excess_tokens: float
    step_s: float
    source: ObservationSource
    valid: bool = True
    reason: Reject | None = None

    @staticmethod
    def rejected(at_s: float, reason: Reject, source: ObservationSource) -> Observation:
        """An invalid observation carrying only its reason."""
        return Observation(at_s, StepBatch(), 0.0, math.nan, source, valid=False, reason=reason)


def mean_excess_tokens(
    buckets: tuple[tuple[float, float], ...], mean_tokens: float, knee_tokens: float
) -> float | None:
    """Mean of ``max(0, N - knee)`` over steps, from cumulative histogram buckets of N and its mean.

    Uses ``E[max(0, N - k)] = E[N] - E[min(N, k)]``: the exact mean carries every step above the
    knee (which all count ``k`` in the second term), so only the buckets below the knee need a
    guess about where their steps lie (uniform inside a bucket). Buckets are coarse (vLLM's go
    512, 1024, 2048...) and prompt lengths are not uniform inside them, so this is much closer than
    placing every step at its bucket's midpoint. The result is clamped to what the buckets allow
    (each step between its bucket's bounds). ``None`` when the buckets hold no count.
    """
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0.0:
        return None
    lo, prev_cum, below, low_bound, high_bound = 0.0, 0.0, 0.0, 0.0, 0.0
    for le, cum in buckets:
        count = max(0.0, cum - prev_cum)
        prev_cum = max(prev_cum, cum)
        if count > 0.0:
            below += count * _uniform_min(lo, le, knee_tokens)
            low_bound += count * max(0.0, lo - knee_tokens)
            high_bound += count * max(0.0, le - knee_tokens)
        if not math.isinf(le):
            lo = le
    estimate = mean_tokens - below / total
    return min(max(estimate, low_bound / total), high_bound / total)


def _uniform_min(lo: float, hi: float, knee: float) -> float:
    """E[min(X, knee)] for X uniform on [lo, hi] (``hi`` may be infinite: then ``knee`` if lo < knee)."""
    if lo >= knee:
        return knee
    if math.isinf(hi):
        return knee  # unbounded above: its steps are taken past the knee
    if hi <= knee or hi <= lo:
        return (lo + hi) / 2.0
    share_below = (knee - lo) / (hi - lo)
    return share_below * (lo + knee) / 2.0 + (1.0 - share_below) * knee


def observation_from_window(window: WindowStats, knee_tokens: float) -> Observation:
    """Turn one scrape window into an observation (``valid=False`` with a reason when unusable).

    Composition: decoding sequences per step = generation tokens / steps (each decode step yields
    one token per sequence); prefill tokens per step = mean tokens per step minus that (or prompt
    tokens / steps when the iteration histogram is absent); KV read = KV tokens in use; prefill
    attention pairs per step ~ prefill tokens per step x mean prompt / 2.

    Step time: the mean step period (window / steps) when the engine was busy throughout, unless
    it exceeds 1.5x the mean ITL (then it idled, and the ITL is used), or the steps were estimated
    rather than counted (``steps_counted``); else the mean ITL.
    """
    w, src = window, ObservationSource.WINDOW_ITL
    numbers = (w.steps_per_s, w.running, w.waiting, w.kv_tokens_in_use, w.generation_tokens_per_s)
    if not all(math.isfinite(x) for x in (*numbers, w.prompt_tokens_per_s, w.window_s, w.at_s)):
        return Observation.rejected(w.at_s, Reject.NOT_FINITE, src)
    if w.steps_per_s <= 0.0 or w.window_s <= 0.0:
        return Observation.rejected(w.at_s, Reject.NO_STEPS, src)
    if min(numbers) < 0.0 or w.prompt_tokens_per_s < 0.0:
        return Observation.rejected(w.at_s, Reject.OUT_OF_RANGE, src)
    decode = w.generation_tokens_per_s / w.steps_per_s
    if w.mean_tokens_per_step is not None and math.isfinite(w.mean_tokens_per_step):
        prefill = max(0.0, w.mean_tokens_per_step - decode)
    else:
        prefill = w.prompt_tokens_per_s / w.steps_per_s
    attn = prefill * w.mean_prompt_tokens / 2.0 if w.mean_prompt_tokens else 0.0
    batch = StepBatch(prefill, decode, w.kv_tokens_in_use, attn)
    excess = mean_excess_tokens(w.tokens_per_step_buckets, batch.tokens, knee_tokens)
    if excess is None:
        excess = max(0.0, batch.tokens - knee_tokens)
    itl = w.mean_itl_s if w.mean_itl_s is not None and w.mean_itl_s > 0.0 else None
    period = 1.0 / w.steps_per_s
    if w.steps_counted and (w.busy or w.waiting > 0.0) and (itl is None or period <= 1.5 * itl):
        step_s, src = period, ObservationSource.WINDOW_PERIOD
    elif itl is not None:
        step_s = itl
    else:
        return Observation.rejected(w.at_s, Reject.NO_STEP_TIME, src)
    if not math.isfinite(step_s) or step_s > _MAX_STEP_S:
        return Observation.rejected(w.at_s, Reject.OUT_OF_RANGE, src)
    return Observation(w.at_s, batch, excess, step_s, src)


@dataclass(frozen=True, slots=True)
class CalibrationConfig:
    """Knobs of the online fit.

    ``half_life_s``: age (s) at which an observation counts half.
    ``capacity``: observations kept per kind of source (``SourceKind``: a ring buffer each);
    older ones are dropped.
    ``prior_strength``: the prior's weight with no data, in observations-with-100%-error.
    ``prior_half_count``: effective observation count at which the prior's weight has halved.
    ``prior_floor``: the prior's weight never drops below this (keeps unexercised terms put).
    ``no_prior_strength``: the weak pull toward "constant step time" when there is no prior.
    ``min_observations_without_prior``: observations before a prior-less fit is reported valid.
    ``robust_min_observations``: Huber reweighting starts at this many observations.
    ``huber_k``: Huber threshold in robust standard deviations of the relative residuals.
    ``irls_iterations``: reweighting passes.
    ``error_window``: most recent observations the reported median error is computed over.
    ``balance_sources``: every kind of source (``SourceKind``) present weighs as much in the fit as
    each other, however many observations it holds (its rows' forgetting weights scaled to an equal
    share of their total); ``False``: every observation weighs by its age alone.
    ``knee_factors``: with a prior, the knees the fit chooses from (by fit quality, as without
    one) are the prior's times these (each > 0; the first is the one reported before any fit).
    The prior's knee is the datasheet ridge at the assumed efficiencies; measured GEMMs leave
    their flat region earlier (their time steps up with every tile of tokens well before the
    ridge), and a knee too high makes the fit explain that rise with a steep slope below the
    knee, which it then extrapolates down to decode steps' few tokens.
    """

    half_life_s: float = 600.0
    capacity: int = 512
    prior_strength: float = 1.0
    prior_half_count: float = 10.0
    prior_floor: float = 0.05
    no_prior_strength: float = 0.05
    min_observations_without_prior: int = 3
    robust_min_observations: int = 8
    huber_k: float = 1.345
    irls_iterations: int = 10
    error_window: int = 32
    balance_sources: bool = True
    knee_factors: tuple[float, ...] = (1.0, 0.5, 0.25)

    def __post_init__(self) -> None:
        if self.half_life_s <= 0 or self.capacity < 1 or self.irls_iterations < 1 or self.error_window < 1:
            raise ValueError("half_life_s, capacity, irls_iterations and error_window must be positive")
        if min(self.prior_strength, self.prior_half_count, self.prior_floor, self.no_prior_strength) <= 0:
            raise ValueError("prior strengths must be positive")
        if not self.knee_factors or min(self.knee_factors) <= 0.0:
            raise ValueError(f"knee_factors must be positive and at least one: {self.knee_factors}")


@dataclass(frozen=True, slots=True)
class FitReport:
    """What a dashboard shows about one replica's step model.

    ``params``: the coefficients in use. ``prior``: the roofline prior's, or ``None`` without one.
    ``observations_total``: accepted since start; ``observations_kept``: in the rings now;
    ``effective_observations``: sum of forgetting weights at fit time.
    ``prior_weight``: the prior's current strength (observations-with-100%-error).
    ``mdape``: median |predicted - observed| / observed over the last ``error_window`` observations
    (a fraction; ``None`` with no observations). ``prior_mdape``: the same for the prior alone.
    ``rejected``: windows rejected since start, per reason.
    """

    params: StepParams
    prior: StepParams | None
    source: ModelSource
    observations_total: int
    observations_kept: int
    effective_observations: float
    prior_weight: float
    mdape: float | None
    prior_mdape: float | None
    rejected: tuple[tuple[Reject, int], ...]
    valid: bool
    reason: str | None


@dataclass(frozen=True, slots=True)
class Calibration:
    """A fit's result: the model to forecast with and the report about it."""

    model: StepModel
    report: FitReport


class StepCalibrator:
    """Online step-model fit for one replica. Not thread-safe; one per replica.

    ``prior`` fixes the knee and alpha; when it is valid its coefficients are the ridge target.
    """

    def __init__(self, prior: StepModel, config: CalibrationConfig | None = None) -> None:
        self._prior = prior
        self._config = config or CalibrationConfig()
        # Without a prior the knee is learned: each row's mean excess tokens past every candidate.
        self._knees = (
            tuple(prior.params.knee_tokens * f for f in self._config.knee_factors)
            if prior.valid
            else _CANDIDATE_KNEES
        )
        self._rings = {kind: _Ring(self._config.capacity, len(self._knees)) for kind in SourceKind}
        self._total = 0
        self._rejected: dict[Reject, int] = {}

    @property
    def prior(self) -> StepModel:
        """The roofline prior this calibrator regularises toward (may be invalid: no prior)."""
        return self._prior

    @property
    def knees(self) -> tuple[float, ...]:
        """The knees (tokens) the fit chooses from: the prior's alone, or candidates without one."""
        return self._knees

    def observe_window(self, window: WindowStats) -> Observation:
        """Derive an observation from a scrape window, keep it if valid, and return it."""
        obs = observation_from_window(window, self._prior.params.knee_tokens)
        excess = tuple(observation_from_window(window, k).excess_tokens for k in self._knees)
        self.observe(obs, excess)
        return obs

    def observe_step(self, at_s: float, batch: StepBatch, step_s: float) -> Observation:
        """Record one measured step (``step_s`` seconds for ``batch``) and return the observation."""
        src = ObservationSource.STEP
        if not (math.isfinite(step_s) and math.isfinite(at_s)):
            obs = Observation.rejected(at_s, Reject.NOT_FINITE, src)
        elif not 0.0 < step_s <= _MAX_STEP_S:
            obs = Observation.rejected(at_s, Reject.OUT_OF_RANGE, src)
        else:
            excess = max(0.0, batch.tokens - self._prior.params.knee_tokens)
            obs = Observation(at_s, batch, excess, step_s, src)
        self.observe(obs)
        return obs

    def observe(self, obs: Observation, excess_by_knee: tuple[float, ...] | None = None) -> None:
        """Keep a valid observation (count an invalid one by its reason).

        ``excess_by_knee``: its mean tokens past each of ``knees``; ``None`` = that of its mean
        batch (exact for one step, an approximation for a window's mean).
        """
        if not obs.valid:
            reason = obs.reason or Reject.OUT_OF_RANGE
            self._rejected[reason] = self._rejected.get(reason, 0) + 1
            return
        b = obs.batch
        # mean min(N, knee) = mean N - mean max(0, N - knee)
        to_knee = max(0.0, b.tokens - obs.excess_tokens)
        row = (1.0, to_knee, b.decode_seqs, obs.excess_tokens, b.kv_tokens_read, b.prefill_attn_pairs)
        if excess_by_knee is None or len(excess_by_knee) != len(self._knees):
            excess_by_knee = tuple(max(0.0, b.tokens - k) for k in self._knees)
        self._rings[SourceKind.of(obs.source)].add(row, excess_by_knee, obs.step_s, obs.at_s)
        self._total += 1

    def fit(self, now_s: float) -> Calibration:
        """Fit on the kept observations as of ``now_s`` (caller's monotonic clock, seconds)."""
        cfg, prior = self._config, self._prior
        x, y, t, kinds = self._recent_first()
        if len(y) == 0:
            return self._prior_only()
        weights = np.power(0.5, np.maximum(0.0, now_s - t) / cfg.half_life_s)
        n_eff = float(weights.sum())
        if cfg.balance_sources:
            weights = _balanced(weights, kinds)
        if prior.valid:
            target = np.array(prior.params.coefficients())
            strength = max(
                cfg.prior_floor, cfg.prior_strength * cfg.prior_half_count / (cfg.prior_half_count + n_eff)
            )
            ridge = np.full(_NF, strength)
        else:
            target = np.array([float(np.median(y)), 0.0, 0.0, 0.0, 0.0, 0.0])
            strength = cfg.no_prior_strength
            ridge = np.full(_NF, strength)
            ridge[_ATTN] = 0.0  # the tie alone decides it: a pull to zero would fight the tie
        penalty = _Penalty(ridge, target, strength, prior.params.attn_pair_tokens)
        params, x = self._best_knee(x, y, weights, penalty)
        valid, reason = True, None
        if not prior.valid and len(y) < cfg.min_observations_without_prior:
            valid, reason = False, f"too few observations without a prior ({len(y)})"
        model = StepModel(params, ModelSource.FITTED, valid=valid, reason=reason)
        return Calibration(model, self._report(model, x, y, n_eff, strength))

    def _best_knee(self, x: Vec, y: Vec, weights: Vec, penalty: _Penalty) -> tuple[StepParams, Vec]:
        """The fit at the knee (of ``knees``) whose capped relative residuals weigh least, and
        the rows' features at that knee.

        ``x``: rows at the prior's knee, most recent first; the two token features are rebuilt
        for every other candidate from the kept excess tokens.
        """
        cfg, base = self._config, self._prior.params
        excess = self._recent_excess()
        tokens = x[:, 1] + x[:, _COMPUTE]
        best: tuple[float, StepParams, Vec] | None = None
        for j, knee in enumerate(self._knees):
            xk = x.copy()
            xk[:, _COMPUTE] = excess[:, j]
            xk[:, 1] = np.maximum(0.0, tokens - excess[:, j])
            coef = _robust_fit(xk, y, weights, penalty, _units(xk, y, weights), cfg)
            residual = np.minimum(np.abs(xk @ coef - y) / y, _KNEE_LOSS_CAP)
            loss = float((weights * residual).sum())
            if best is None or loss < best[0] * (1.0 - 1e-9):
                params = dataclasses.replace(base.with_coefficients(list(coef)), knee_tokens=knee)
                best = (loss, params, xk)
        assert best is not None  # at least one knee
        return best[1], best[2]

    def _recent_first(self) -> tuple[Vec, Vec, Vec, npt.NDArray[np.int_]]:
        """Kept rows of every ring (features, step times, times, each row's ring as its index in
        ``SourceKind``), most recent first."""
        parts = [ring.recent_first() for ring in self._rings.values()]
        t = np.concatenate([p[2] for p in parts])
        order = np.argsort(-t, kind="stable")
        x = np.concatenate([p[0] for p in parts])[order]
        y = np.concatenate([p[1] for p in parts])[order]
        kinds = np.concatenate([np.full(len(p[1]), i) for i, p in enumerate(parts)])[order]
        return x, y, t[order], kinds

    def _recent_excess(self) -> Vec:
        """Kept rows' excess tokens per candidate knee, in ``_recent_first``'s order."""
        parts = [ring.recent_first() for ring in self._rings.values()]
        t = np.concatenate([p[2] for p in parts])
        order = np.argsort(-t, kind="stable")
        return np.concatenate([p[3] for p in parts])[order]

    def _prior_only(self) -> Calibration:
        prior = self._prior
        reason = None if prior.valid else (prior.reason or "no prior and no observations")
        model = (
            prior if prior.valid else StepModel(prior.params, ModelSource.NONE, valid=False, reason=reason)
        )
        strength = self._config.prior_strength if prior.valid else 0.0
        empty = np.zeros((0, _NF))
        return Calibration(model, self._report(model, empty, np.zeros(0), 0.0, strength))

    def _report(self, model: StepModel, x: Vec, y: Vec, n_eff: float, strength: float) -> FitReport:
        k = self._config.error_window
        prior = self._prior
        return FitReport(
            params=model.params,
            prior=prior.params if prior.valid else None,
            source=model.source,
            observations_total=self._total,
            observations_kept=len(y),
            effective_observations=n_eff,
            prior_weight=strength,
            mdape=_mdape(model.params, x[:k], y[:k]) if len(y) else None,
            prior_mdape=_mdape(prior.params, x[:k], y[:k]) if len(y) and prior.valid else None,
            rejected=tuple(sorted(self._rejected.items())),
            valid=model.valid,
            reason=model.reason,
        )


class _Ring:
    """One source kind's kept observations: a ring buffer of ``capacity`` rows."""

    def __init__(self, capacity: int, knees: int) -> None:
        self.x = np.zeros((capacity, _NF))
        self.excess = np.zeros((capacity, knees))
        self.y = np.zeros(capacity)
        self.t = np.zeros(capacity)
        self.next = 0
        self.kept = 0

    def add(self, row: tuple[float, ...], excess: tuple[float, ...], step_s: float, at_s: float) -> None:
        """Keep one row (features, excess tokens per knee, step time, time), dropping the oldest
        when full."""
        i, capacity = self.next, len(self.y)
        self.x[i], self.excess[i], self.y[i], self.t[i] = row, excess, step_s, at_s
        self.next = (i + 1) % capacity
        self.kept = min(self.kept + 1, capacity)

    def recent_first(self) -> tuple[Vec, Vec, Vec, Vec]:
        """Kept features, step times, times and excess tokens, most recent first."""
        order = (self.next - 1 - np.arange(self.kept)) % len(self.y)
        return self.x[order], self.y[order], self.t[order], self.excess[order]


def _balanced(weights: Vec, kinds: npt.NDArray[np.int_]) -> Vec:
    """``weights`` rescaled so that every kind present in ``kinds`` totals the same, their sum
    unchanged (each kind's rows keep their relative weights)."""
    present = np.unique(kinds)
    if len(present) < 2:
        return weights
    share = float(weights.sum()) / len(present)
    out = weights.copy()
    for kind in present:
        mask = kinds == kind
        total = float(weights[mask].sum())
        if total > 0.0:
            out[mask] *= share / total
    return out


def _mdape(params: StepParams, x: Vec, y: Vec) -> float:
    """Median absolute percentage error (a fraction) of ``params`` on rows ``x`` -> ``y``."""
    predicted = x @ np.array(params.coefficients())
    return float(np.median(np.abs(predicted - y) / y))


def _units(x: Vec, y: Vec, weights: Vec) -> Vec:
    """Per coefficient: how much relative step time one unit of it explains, typically.

    The weighted RMS over observations of ``x_ij / y_i``, never below the reference magnitude over
    the median step. Scaling coefficients by it puts the data and the prior in one currency: a
    penalty of ``s x d^2`` costs as much as ``s`` observations each off by a fraction ``d``.
    """
    rms = np.sqrt((weights[:, None] * (x / y[:, None]) ** 2).sum(axis=0) / max(float(weights.sum()), 1e-12))
    result: Vec = np.maximum(rms, _REFERENCE / float(np.median(y)))
    return result


@dataclass(frozen=True, slots=True)
class _Penalty:
    """Ridge ``sum_j ridge_j (phi_j - target_j)^2`` plus ``tie x (c_a - alpha c_c)^2``, in scaled units."""

    ridge: Vec
    target: Vec
    tie: float
    alpha: float


def _robust_fit(x: Vec, y: Vec, weights: Vec, penalty: _Penalty, unit: Vec, cfg: CalibrationConfig) -> Vec:
    """Non-negative Huber-IRLS penalised fit of ``x @ coef ~ y`` in relative error; returns ``coef``.

    Works in scaled coordinates ``phi = coef x unit`` (dimensionless: the typical share of a step's
    time each term explains), where the prior penalty is ``ridge x (phi - phi0)^2``.
    """
    z = x / unit / y[:, None]  # row i: feature contributions relative to observed step time
    # Tie, in phi: (phi_a / unit_a - alpha phi_c / unit_c) x unit_a.
    tie = np.zeros(_NF)
    tie[_ATTN], tie[_COMPUTE] = 1.0, -penalty.alpha * unit[_ATTN] / unit[_COMPUTE]
    p_matrix = np.diag(penalty.ridge) + penalty.tie * np.outer(tie, tie)
    p_vector = penalty.ridge * penalty.target * unit
    robust = len(y) >= cfg.robust_min_observations
    phi = _nnls_penalised(z, weights, p_matrix, p_vector)
    for _ in range(cfg.irls_iterations if robust else 0):
        r = z @ phi - 1.0
        # Residual scale from the weighted MAD: forgotten observations must not set it.
        scale = max(1.4826 * _weighted_median(np.abs(r - _weighted_median(r, weights)), weights), 0.02)
        huber = np.minimum(1.0, cfg.huber_k * scale / np.maximum(np.abs(r), 1e-12))
        new = _nnls_penalised(z, weights * huber, p_matrix, p_vector)
        converged = np.allclose(new, phi, rtol=1e-6, atol=1e-9)
        phi = new
        if converged:
            break
    result: Vec = phi / unit
    return result


def _weighted_median(values: Vec, weights: Vec) -> float:
    """The value at half the total weight (weights >= 0, not all zero)."""
    order = np.argsort(values)
    cumulative = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cumulative, 0.5 * cumulative[-1])])


def _nnls_penalised(z: Vec, w: Vec, p_matrix: Vec, p_vector: Vec) -> Vec:
    """argmin_{phi >= 0} sum_i w_i (z_i . phi - 1)^2 + phi' P phi - 2 p' phi (P positive definite)."""
    a = (z.T * w) @ z + p_matrix
    b = (z.T * w).sum(axis=1) + p_vector
    phi: Vec = np.linalg.solve(a, b)
    if (phi >= 0.0).all():
        return phi
    found = _active_set(a, b)
    return found if found is not None else _enumerate(a, b)


def _active_set(a: Vec, b: Vec) -> Vec | None:
    """Minimise ``phi' a phi - 2 b' phi`` over ``phi >= 0`` by a primal active set (a is SPD).

    Clamp negative coordinates to zero and re-solve on the rest; then free any clamped coordinate
    whose gradient still points inward. ``None`` if it has not converged in a few rounds.
    """
    free = np.ones(_NF, dtype=bool)
    for _ in range(4 * _NF):
        phi = np.zeros(_NF)
        if free.any():
            phi[free] = np.linalg.solve(a[np.ix_(free, free)], b[free])
        if (phi < 0.0).any():
            free &= phi > 0.0
            continue
        gradient = a @ phi - b
        inward = ~free & (gradient < -1e-12)
        if not inward.any():
            return phi
        free[int(np.argmin(np.where(inward, gradient, np.inf)))] = True
    return None


def _enumerate(a: Vec, b: Vec) -> Vec:
    """Exact fallback: the best non-negative solution over all 2^6 free sets."""
    best, best_obj = np.zeros(_NF), 0.0  # all-zero is always feasible, objective 0
    for size in range(1, _NF + 1):
        for free in itertools.combinations(range(_NF), size):
            idx = list(free)
            sub = np.linalg.solve(a[np.ix_(idx, idx)], b[idx])
            if (sub < 0.0).any():
                continue
            cand = np.zeros(_NF)
            cand[idx] = sub
            obj = float(cand @ a @ cand - 2.0 * b @ cand)
            if obj < best_obj:
                best, best_obj = cand, obj
    return best
