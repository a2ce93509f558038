"""Forecasts corrected by measurement: per replica, what the caller measured over what was forecast.

The step model prices engine steps; a real replica's API server (tokenisation, detokenisation,
streaming, contention for the host's cores) adds time no step model sees, and on a slow host it
can double a TTFT. The caller measures every admitted request's TTFT and TPOT as it relays the
stream, so no systematic error needs to survive for long: ``CorrectionLearner`` keeps, per
replica, a robust time-weighted estimate of ``log(measured / forecast)`` for TTFT and for TPOT, by
**load regime** (the prompt's size, and for TPOT the batch the request joined, ``regime``; for
TTFT how it reaches the engine, ``ttft_regime``: an idle one, a free slot, or a wait for a slot
behind at most one engine-full of requests or more: a queue deeper than the slots is where a
step model's error grows), and
``Correction`` is the immutable snapshot a forecast multiplies its TTFT and TPOT by.

* **Robust and quick**: the estimate is a weighted median of the samples, each weighing
  ``2^(-age / half_life_s)``. After a step change the new level holds half the weight one
  half-life later, so the median moves there then, all at once and within the data's range: no
  overshoot, and no single outlier moves it.
* **Pooled**: a regime's estimate is shrunk toward the replica-wide one by ``prior_weight``
  (pseudo-samples), so a regime with few samples borrows from the others.
* **Forgetting**: the replica-wide estimate is shrunk toward no correction by ``forget_weight``
  pseudo-samples against the samples' decayed weight now, so a replica that stops finishing
  requests (refused on a large correction, or idle) drifts back to its model's forecast over a
  few half-lives instead of keeping what a burst taught (a lock-out guard).
* **Against the model**: samples compare the measured latency with the *uncorrected* forecast
  (``Forecast.base_ttft_s``), so the estimate does not feed on itself; its residual (the error
  left after the correction the forecast carried) is kept apart for reporting.
* **Spread**: beside each TTFT regime's median, the learner keeps how far above it the upper
  quantiles of the same samples lie (``SPREAD_QUANTILES``), pooled and forgotten the same way.
  A caller that must hold a share of its requests within a target (admission, at a class's
  attainment target) multiplies by ``Correction.ttft_upper`` as well: the median makes a
  forecast right half the time, the spread right that share of the time, in the regime at
  hand. Only the TTFT's: a TTFT is one wait in a queue that drains in waves, so its error
  spreads wide; a TPOT is a mean over many steps, whose errors average out within the request.

The regimes are ``predictor.regimes``'; the samples of each, ``predictor.decayed_samples``'.
Pure and synchronous: times are the caller's seconds. Not thread-safe.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

from predictor.correction_state import CorrectionState, LatencyState, RegimeState, Residuals
from predictor.decayed_samples import SPREAD_QUANTILES, DecayedSamples
from predictor.regimes import (
    BATCH_EDGES,
    N_BATCH,
    N_REGIMES,
    PROMPT_EDGES,
    regime,
    regime_label,
    ttft_load,
    ttft_regime,
    ttft_regime_label,
)

__all__ = [
    "BATCH_EDGES",
    "NO_CORRECTION",
    "PROMPT_EDGES",
    "SPREAD_QUANTILES",
    "Correction",
    "CorrectionConfig",
    "CorrectionLearner",
    "CorrectionState",
    "LatencyState",
    "RegimeState",
    "Residuals",
    "regime",
    "regime_label",
    "ttft_regime",
    "ttft_regime_label",
]

_N_SPREADS: Final = len(SPREAD_QUANTILES)
#: Least time between two rebuilds of a replica's ``Correction``, in half-lives (0.75 s at 15 s).
_REBUILD_HALF_LIVES: Final = 0.05


@dataclass(frozen=True, slots=True)
class CorrectionConfig:
    """Knobs of the correction.

    ``enabled``: learn and apply it (off: every factor 1, nothing learned).
    ``half_life_s``: seconds after which a sample weighs half (a step change is followed about
    one half-life later). ``memory_half_lives``: samples older than this many half-lives are
    dropped. ``max_samples``: most samples kept per regime and per replica-wide estimate.
    ``prior_weight``: pseudo-samples pulling a regime toward the replica-wide estimate.
    ``forget_weight``: pseudo-samples pulling the replica-wide estimate toward no correction
    (its decayed sample weight is compared with it: a replica with recent finishes keeps its
    estimate, one without drifts back to 1). ``min_factor`` / ``max_factor``: the range a factor is
    clamped to. A TTFT sample below ``min_factor`` is learned as ``min_factor`` (a forecast far
    too high: the median still sees it); a TPOT sample below it is not learned from (a relay's
    burst, not the engine's pace); one above ``max_factor`` is not learned from (a stall or a
    fit gone wrong, which must not lock a replica out). All are counted apart.
    ``residual_window_s``: seconds of residuals kept for ``Residuals``. ``spread``: give each
    TTFT regime's spread (``Correction.ttft_upper``; off: none, every spread 1).
    """

    enabled: bool = True
    half_life_s: float = 15.0
    memory_half_lives: float = 4.0
    max_samples: int = 256
    prior_weight: float = 4.0
    forget_weight: float = 1.0
    min_factor: float = 0.25
    max_factor: float = 10.0
    residual_window_s: float = 60.0
    spread: bool = True

    def __post_init__(self) -> None:
        if not self.half_life_s > 0 or not self.memory_half_lives >= 1 or self.max_samples < 1:
            raise ValueError("half_life_s must be > 0, memory_half_lives >= 1, max_samples >= 1")
        if self.prior_weight < 0 or self.forget_weight < 0:
            raise ValueError("prior_weight and forget_weight must be >= 0")
        if not 0.0 < self.min_factor <= 1.0 <= self.max_factor:
            raise ValueError("min_factor must be in (0, 1] and max_factor >= 1")
        if not self.residual_window_s > 0:
            raise ValueError("residual_window_s must be > 0")


@dataclass(frozen=True, slots=True)
class Correction:
    """The factors to multiply a replica's forecasts by, per regime (``ttft_regime`` /
    ``regime``); immutable.

    ``ttft`` / ``tpot``: one factor per regime (``len == 16``), or empty for no correction.
    ``ttft_spreads``: per ``SPREAD_QUANTILES`` entry, one factor (>= 1) per TTFT regime by which
    that quantile of the regime's measured-over-forecast TTFT ratios lies above its median
    (``ttft_upper``); empty: none learned.
    """

    ttft: tuple[float, ...] = ()
    tpot: tuple[float, ...] = ()
    ttft_spreads: tuple[tuple[float, ...], ...] = ()

    def factors(
        self, prompt_tokens: float, decode_seqs: float, slot_waves: float = 0.0
    ) -> tuple[float, float]:
        """(TTFT factor, TPOT factor) for a request of ``prompt_tokens`` joining ``decode_seqs``,
        behind ``slot_waves`` engine-fulls waiting for a slot (``ttft_regime``)."""
        if not self.ttft:
            return 1.0, 1.0
        # Per request and replica on the decision path: the prompt's bin found once for both.
        row = bisect.bisect_right(PROMPT_EDGES, prompt_tokens) * N_BATCH
        return (
            self.ttft[row + ttft_load(decode_seqs, slot_waves)],
            self.tpot[row + bisect.bisect_right(BATCH_EDGES, decode_seqs)],
        )

    def ttft_upper(
        self, quantile: float, prompt_tokens: float, decode_seqs: float, slot_waves: float = 0.0
    ) -> float:
        """What to multiply the corrected TTFT of a request in ``factors``' regime by so that it
        is the ``quantile`` (0-1) of what was measured there, not its median: 1 at or below 0.5,
        interpolated (in the log) between ``SPREAD_QUANTILES``, their last one above it; 1
        without a spread learned."""
        if not self.ttft_spreads or not quantile > 0.5:
            return 1.0
        i = bisect.bisect_right(PROMPT_EDGES, prompt_tokens) * N_BATCH + ttft_load(decode_seqs, slot_waves)
        return self._spread_at(quantile, i)

    def judged(
        self, quantile: float | None, prompt_tokens: float, decode_seqs: float, slot_waves: float = 0.0
    ) -> tuple[float, float, float]:
        """``factors`` and ``ttft_upper`` at once, the regime found once: (TTFT factor, TPOT
        factor, TTFT spread at ``quantile``; ``None``: no spread, 1). What admission multiplies a
        request's forecast by on its decision path."""
        if not self.ttft:
            return 1.0, 1.0, 1.0
        row = bisect.bisect_right(PROMPT_EDGES, prompt_tokens) * N_BATCH
        i = row + ttft_load(decode_seqs, slot_waves)
        spread = 1.0
        if quantile is not None and quantile > 0.5 and self.ttft_spreads:
            spread = self._spread_at(quantile, i)
        return self.ttft[i], self.tpot[row + bisect.bisect_right(BATCH_EDGES, decode_seqs)], spread

    def _spread_at(self, quantile: float, i: int) -> float:
        """TTFT regime ``i``'s spread at ``quantile`` (> 0.5), read from the grid (see ``ttft_upper``)."""
        spreads = self.ttft_spreads
        g = bisect.bisect_left(SPREAD_QUANTILES, quantile)
        if g >= _N_SPREADS:
            return spreads[-1][i]
        hi_q, hi = SPREAD_QUANTILES[g], spreads[g][i]
        if quantile == hi_q:
            return hi
        lo_q, lo = (0.5, 1.0) if g == 0 else (SPREAD_QUANTILES[g - 1], spreads[g - 1][i])
        w = (quantile - lo_q) / (hi_q - lo_q)
        return float(lo ** (1.0 - w) * hi**w)

    @property
    def active(self) -> bool:
        """Whether any factor differs from 1."""
        return any(f != 1.0 for f in self.ttft) or any(f != 1.0 for f in self.tpot)


#: No correction: every factor 1.
NO_CORRECTION: Final = Correction()


@dataclass(slots=True)
class _Metric:
    """One latency's (TTFT's or TPOT's) estimates for one replica: replica-wide (reported), per
    batch bin (what a regime is pooled toward) and per regime."""

    overall: DecayedSamples = field(default_factory=DecayedSamples)
    batches: dict[int, DecayedSamples] = field(default_factory=dict)
    regimes: dict[int, DecayedSamples] = field(default_factory=dict)
    #: Samples ever taken, and refused as out of range (for reports).
    count: int = 0
    rejected: int = 0

    def add(self, at: float, index: int, value: float, cfg: CorrectionConfig) -> None:
        keep = {"half_life_s": cfg.half_life_s, "horizon_s": cfg.memory_half_lives * cfg.half_life_s}
        for samples in (
            self.overall,
            self.batches.setdefault(index % N_BATCH, DecayedSamples()),
            self.regimes.setdefault(index, DecayedSamples()),
        ):
            samples.add(at, value, max_samples=cfg.max_samples, **keep)
        self.count += 1

    def overall_log(self, now: float, cfg: CorrectionConfig) -> float:
        """The replica-wide log factor at ``now``: the median shrunk toward 0 by ``forget_weight``."""
        return _forgetting(self.overall, now, cfg)

    def factors(self, now: float, cfg: CorrectionConfig) -> tuple[float, ...]:
        """Each regime's factor at ``now`` (``build``'s first half)."""
        return self.build(now, cfg)[0]

    def build(
        self, now: float, cfg: CorrectionConfig
    ) -> tuple[tuple[float, ...], tuple[tuple[float, ...], ...]]:
        """Each regime's factor at ``now``, and per ``SPREAD_QUANTILES`` entry each regime's
        spread factor. A factor is the regime's median shrunk toward its batch bin's by
        ``prior_weight``, that one toward no correction by ``forget_weight``; a spread likewise.
        Not toward the replica-wide median: the error a burst teaches its busy regimes (the load
        admitted after a request slows it) must not close an idle replica to light requests. A
        factor times its spread stays within ``max_factor``."""
        lo, hi = math.log(cfg.min_factor), math.log(cfg.max_factor)
        pooled: dict[int, tuple[float, tuple[float, ...]]] = {}
        for b, bin_samples in self.batches.items():
            keep = _kept(bin_samples, now, cfg)
            pooled[b] = (bin_samples.median * keep, tuple(x * keep for x in bin_samples.spreads))
        zero = (0.0, (0.0,) * _N_SPREADS)
        out: list[float] = []
        uppers: list[list[float]] = [[] for _ in range(_N_SPREADS)]
        for i in range(N_REGIMES):
            value, spreads = pooled.get(i % N_BATCH, zero)
            s = self.regimes.get(i)
            if s is not None and s.points:
                w = s.weight_at(now, cfg.half_life_s)
                k = cfg.prior_weight
                value = (w * s.median + k * value) / (w + k)
                spreads = tuple((w * x + k * y) / (w + k) for x, y in zip(s.spreads, spreads, strict=True))
            value = min(hi, max(lo, value))
            out.append(math.exp(value))
            for g, x in enumerate(spreads):
                uppers[g].append(math.exp(min(x, hi - value)))
        return tuple(out), tuple(tuple(u) for u in uppers)


def _kept(s: DecayedSamples, now: float, cfg: CorrectionConfig) -> float:
    """The share of ``s``'s estimates kept at ``now`` against ``forget_weight`` pseudo-samples of
    no correction: its decayed weight over that plus ``forget_weight`` (0 without samples)."""
    w = s.weight_at(now, cfg.half_life_s)
    return w / (w + cfg.forget_weight) if w > 0.0 else 0.0


def _forgetting(s: DecayedSamples, now: float, cfg: CorrectionConfig) -> float:
    """``s``'s weighted median at ``now``, shrunk toward 0 (no correction) by ``forget_weight``
    pseudo-samples against its decayed weight."""
    return s.median * _kept(s, now, cfg)


@dataclass(slots=True)
class _Replica:
    ttft: _Metric = field(default_factory=_Metric)
    tpot: _Metric = field(default_factory=_Metric)
    #: (time, before, after) relative errors, for ``Residuals``.
    ttft_errors: deque[tuple[float, float, float]] = field(default_factory=deque)
    tpot_errors: deque[tuple[float, float, float]] = field(default_factory=deque)
    #: The snapshot last built and the time it was built for (``CorrectionLearner.correction``).
    cached: Correction | None = None
    cached_at: float = -math.inf
    #: A sample came since it was built.
    changed: bool = False


class CorrectionLearner:
    """Per-replica correction factors learned from measured latencies (see the module docstring)."""

    def __init__(self, config: CorrectionConfig | None = None) -> None:
        self._config = config or CorrectionConfig()
        self._replicas: dict[str, _Replica] = {}

    @property
    def config(self) -> CorrectionConfig:
        return self._config

    def configure(self, config: CorrectionConfig) -> None:
        """Take new knobs (a reload); what was learned is kept, the snapshots are rebuilt."""
        self._config = config
        for r in self._replicas.values():
            r.cached = None

    def forget(self, replica: str) -> None:
        """Drop everything learned about ``replica`` (removed, or its configuration changed)."""
        self._replicas.pop(replica, None)

    def observe(
        self,
        replica: str,
        *,
        at: float,
        prompt_tokens: float,
        decode_seqs: float,
        slot_waves: float = 0.0,
        ttft: tuple[float, float, float] | None = None,
        tpot: tuple[float, float, float] | None = None,
    ) -> None:
        """One finished request on ``replica`` at ``at`` (seconds), dispatched into the regimes of
        ``prompt_tokens``, ``decode_seqs`` and ``slot_waves`` (``ttft_regime``, ``regime``).
        ``ttft`` / ``tpot``: (measured, uncorrected forecast, factor the forecast carried),
        seconds, seconds, ratio; ``None``, a non-finite number or a non-positive forecast or
        factor: not measured (and a non-positive TPOT). A TTFT of 0 or less is as far below the
        forecast as a sample counts: ``min_factor``. Does nothing when disabled."""
        cfg = self._config
        if not cfg.enabled:
            return
        r = self._replicas.get(replica)
        if r is None:
            r = self._replicas[replica] = _Replica()
        learned = False
        for sample, metric, errors, floored, index in (
            (ttft, r.ttft, r.ttft_errors, True, ttft_regime(prompt_tokens, decode_seqs, slot_waves)),
            (tpot, r.tpot, r.tpot_errors, False, regime(prompt_tokens, decode_seqs)),
        ):
            if sample is None:
                continue
            measured, base, factor = sample
            if not (math.isfinite(measured) and _positive(base) and _positive(factor)):
                continue
            if not floored and measured <= 0.0:
                continue
            ratio = measured / base
            if ratio > cfg.max_factor:
                # Not a bias a factor in range could remove: a request that stalled or a step
                # model far off (which the next refit replaces). Learned from, it would hold the
                # clamp, and refuse the replica's traffic, against the next model too.
                metric.rejected += 1
                continue
            if ratio < cfg.min_factor:
                metric.rejected += 1
                if not floored:
                    # A TPOT far below the engine's step is the relay's, not the engine's: a
                    # starved API server sends a stream's tokens in a few bursts.
                    continue
                # A TTFT is measured whole by the caller and cannot come early: dropping these
                # would leave only the slower requests and bias the median up (the forecast
                # then runs high exactly where it already was); clamped, the median counts them
                # without being moved by how far below they fell.
                ratio = cfg.min_factor
            log_ratio = math.log(ratio)
            metric.add(at, index, log_ratio, cfg)
            errors.append((at, measured / base - 1.0, measured / (base * factor) - 1.0))
            while errors and errors[0][0] < at - cfg.residual_window_s:
                errors.popleft()
            learned = True
        if learned:
            r.changed = True

    def correction(self, replica: str, now: float) -> Correction:
        """The factors to apply to ``replica``'s forecasts at ``now`` (``NO_CORRECTION`` when
        disabled or nothing learned). Cheap: rebuilt at most every ``_REBUILD_HALF_LIVES`` of a
        half-life, and then only if a sample came or a tenth of a half-life of decay passed (a
        request's forecast can thus miss the samples of the last fraction of a second)."""
        cfg = self._config
        r = self._replicas.get(replica)
        if not cfg.enabled or r is None or (r.ttft.count == 0 and r.tpot.count == 0):
            return NO_CORRECTION
        age = abs(now - r.cached_at)
        due = age >= _REBUILD_HALF_LIVES * cfg.half_life_s and (r.changed or age > 0.1 * cfg.half_life_s)
        if r.cached is None or due:
            ttft, spreads = r.ttft.build(now, cfg)
            r.cached = Correction(ttft, r.tpot.factors(now, cfg), spreads if cfg.spread else ())
            r.cached_at, r.changed = now, False
        return r.cached

    def residuals(self, replica: str, metric: str, now: float) -> Residuals:
        """``metric``'s (``"ttft"`` or ``"tpot"``) relative errors on ``replica`` over the last
        ``residual_window_s`` seconds before ``now``."""
        r = self._replicas.get(replica)
        if metric not in ("ttft", "tpot"):
            raise ValueError(f"metric must be 'ttft' or 'tpot', got {metric!r}")
        if r is None:
            return Residuals(0, None, None, None, None)
        errors = r.ttft_errors if metric == "ttft" else r.tpot_errors
        since = now - self._config.residual_window_s
        kept = [(b, a) for t, b, a in errors if t >= since]
        if not kept:
            return Residuals(0, None, None, None, None)
        before = [b for b, _ in kept]
        after = [a for _, a in kept]
        return Residuals(
            len(kept),
            _quantile(before, 0.5),
            _quantile([abs(b) for b in before], 0.9),
            _quantile(after, 0.5),
            _quantile([abs(a) for a in after], 0.9),
        )

    def state(self, replica: str, now: float) -> CorrectionState:
        """``replica``'s correction at ``now``, for reports: per latency its replica-wide factor,
        samples and weight, each regime with samples kept, and the residuals."""
        cfg = self._config
        r = self._replicas.get(replica)
        correction = self.correction(replica, now)
        latencies = []
        for name in ("ttft", "tpot"):
            metric = None if r is None else (r.ttft if name == "ttft" else r.tpot)
            factors = correction.ttft if name == "ttft" else correction.tpot
            uppers = correction.ttft_spreads if name == "ttft" else ()
            regimes: list[RegimeState] = []
            if metric is not None:
                for i in sorted(metric.regimes):
                    s = metric.regimes[i]
                    if s.points:
                        factor = factors[i] if factors else 1.0
                        weight = s.weight_at(now, cfg.half_life_s)
                        label = ttft_regime_label(i) if name == "ttft" else regime_label(i)
                        upper = tuple(u[i] for u in uppers)
                        regimes.append(RegimeState(label, factor, len(s.points), weight, upper))
            latencies.append(
                LatencyState(
                    factor=self.overall_factor(replica, name, now),
                    samples_total=0 if metric is None else metric.count,
                    out_of_range_total=0 if metric is None else metric.rejected,
                    samples=0 if metric is None else len(metric.overall.points),
                    weight=0.0 if metric is None else metric.overall.weight_at(now, cfg.half_life_s),
                    regimes=tuple(regimes),
                    residuals=self.residuals(replica, name, now),
                )
            )
        return CorrectionState(cfg.enabled, cfg.half_life_s, latencies[0], latencies[1])

    def describe(self, replica: str, now: float) -> dict[str, object]:
        """``state`` as JSON-ready data (the admin view's ``correction``)."""
        return dataclasses.asdict(self.state(replica, now))

    def overall_factor(self, replica: str, metric: str, now: float) -> float:
        """``metric``'s (``"ttft"`` or ``"tpot"``) replica-wide factor on ``replica`` at ``now``
        (1 when nothing is learned or disabled), clamped as the regimes' are."""
        cfg = self._config
        r = self._replicas.get(replica)
        if r is None or not cfg.enabled:
            return 1.0
        m = r.ttft if metric == "ttft" else r.tpot
        value = m.overall_log(now, cfg)
        return math.exp(min(math.log(cfg.max_factor), max(math.log(cfg.min_factor), value)))

    def samples(self, replica: str, metric: str) -> int:
        """Samples ``metric`` (``"ttft"`` or ``"tpot"``) ever took on ``replica``."""
        r = self._replicas.get(replica)
        if r is None:
            return 0
        return (r.ttft if metric == "ttft" else r.tpot).count


def _positive(x: float) -> bool:
    return math.isfinite(x) and x > 0.0


def _quantile(values: Iterable[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (linear between order statistics); ``values`` not empty."""
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)
