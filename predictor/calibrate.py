"""Fit a replica's step model online from the observations its ``/metrics`` windows give.

``StepCalibrator`` keeps a bounded ring of observations (``predictor.observations``: mean step
composition and mean step time) and fits the six ``predictor.step_model`` coefficients by robust
(Huber), relative-error, non-negative least squares (``predictor.robust_fit``), regularised toward
the roofline prior and forgetting old observations with ``half_life_s``. Coefficients are seconds
per unit and never negative. A replica on unknown hardware has no prior and is reported valid only
after ``min_observations_without_prior``. Synchronous arithmetic: times (``at_s``, ``now_s``) are
the caller's monotonic seconds. The design is in docs/predictor.md.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from predictor.observations import (
    MAX_STEP_S,
    Observation,
    ObservationSource,
    Reject,
    SourceKind,
    WindowStats,
    observation_from_window,
)
from predictor.robust_fit import ATTN, COMPUTE, N_FEATURES, Penalty, Vec, balanced, mdape, robust_fit, units
from predictor.step_model import ModelSource, StepBatch, StepModel, StepParams

__all__ = ["Calibration", "CalibrationConfig", "FitReport", "StepCalibrator"]

#: Knees (tokens per step) a replica without a roofline prior chooses from by fit quality: 0 is a
#: machine with no weight-read-bound flat region (a CPU), the rest span GPUs' ridges.
_CANDIDATE_KNEES: Final = (0.0, 64.0, 128.0, 256.0, 512.0)
#: A relative residual counts at most this much when knees are compared (outliers must not decide).
_KNEE_LOSS_CAP: Final = 0.5


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
        elif not 0.0 < step_s <= MAX_STEP_S:
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
            weights = balanced(weights, kinds)
        if prior.valid:
            target = np.array(prior.params.coefficients())
            strength = max(
                cfg.prior_floor, cfg.prior_strength * cfg.prior_half_count / (cfg.prior_half_count + n_eff)
            )
            ridge = np.full(N_FEATURES, strength)
        else:
            target = np.array([float(np.median(y)), 0.0, 0.0, 0.0, 0.0, 0.0])
            strength = cfg.no_prior_strength
            ridge = np.full(N_FEATURES, strength)
            ridge[ATTN] = 0.0  # the tie alone decides it: a pull to zero would fight the tie
        penalty = Penalty(ridge, target, strength, prior.params.attn_pair_tokens)
        params, x = self._best_knee(x, y, weights, penalty)
        valid, reason = True, None
        if not prior.valid and len(y) < cfg.min_observations_without_prior:
            valid, reason = False, f"too few observations without a prior ({len(y)})"
        model = StepModel(params, ModelSource.FITTED, valid=valid, reason=reason)
        return Calibration(model, self._report(model, x, y, n_eff, strength))

    def _best_knee(self, x: Vec, y: Vec, weights: Vec, penalty: Penalty) -> tuple[StepParams, Vec]:
        """The fit at the knee (of ``knees``) whose capped relative residuals weigh least, and
        the rows' features at that knee.

        ``x``: rows at the prior's knee, most recent first; the two token features are rebuilt
        for every other candidate from the kept excess tokens.
        """
        cfg, base = self._config, self._prior.params
        excess = self._recent_excess()
        tokens = x[:, 1] + x[:, COMPUTE]
        best: tuple[float, StepParams, Vec] | None = None
        for j, knee in enumerate(self._knees):
            xk = x.copy()
            xk[:, COMPUTE] = excess[:, j]
            xk[:, 1] = np.maximum(0.0, tokens - excess[:, j])
            coef = robust_fit(
                xk,
                y,
                weights,
                penalty,
                units(xk, y, weights),
                robust=len(y) >= cfg.robust_min_observations,
                iterations=cfg.irls_iterations,
                huber_k=cfg.huber_k,
            )
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
        empty = np.zeros((0, N_FEATURES))
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
            mdape=mdape(model.params, x[:k], y[:k]) if len(y) else None,
            prior_mdape=mdape(prior.params, x[:k], y[:k]) if len(y) and prior.valid else None,
            rejected=tuple(sorted(self._rejected.items())),
            valid=model.valid,
            reason=model.reason,
        )


class _Ring:
    """One source kind's kept observations: a ring buffer of ``capacity`` rows."""

    def __init__(self, capacity: int, knees: int) -> None:
        self.x = np.zeros((capacity, N_FEATURES))
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
