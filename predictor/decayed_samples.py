"""Time-decayed samples of one quantity, with their weighted median and upper quantiles.

``DecayedSamples`` keeps (time, value) samples, newest last, each weighing ``2^(-age /
half-life)`` against the newest; it drops those older than a horizon or beyond a count. Read, it
gives the weighted median, the distances above it of the ``SPREAD_QUANTILES`` quantiles (the
spread), and the total weight decayed to a given time. The order statistics are computed when
first read after a change: one sort of at most a few hundred samples, which a caller reading
them every fraction of a second affords and a running estimator (P-square, a t-digest) would
not make cheaper at this size. What ``predictor.correction`` keeps per regime. Not thread-safe.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Final

__all__ = ["SPREAD_QUANTILES", "DecayedSamples"]

#: The quantiles whose distance above the median is kept (the spread); a quantile between two of
#: them is interpolated by the reader, one above the last read at the last.
SPREAD_QUANTILES: Final = (0.8, 0.9, 0.95, 0.99)
_N_SPREADS: Final = len(SPREAD_QUANTILES)
_LN2: Final = math.log(2.0)


@dataclass(slots=True)
class DecayedSamples:
    """Samples of one quantity, newest last: (time, value) in ``points``, and their weighted order
    statistics (see the module docstring)."""

    points: deque[tuple[float, float]] = field(default_factory=deque)
    _median: float = 0.0
    #: Each ``SPREAD_QUANTILES`` entry's weighted quantile less the median (>= 0).
    _spreads: tuple[float, ...] = (0.0,) * _N_SPREADS
    #: Sum of the samples' weights at the newest sample's time (each ``2^(-age / half-life)``).
    _weight: float = 0.0
    _dirty: bool = False
    _half_life_s: float = 1.0

    def add(self, at: float, value: float, *, half_life_s: float, horizon_s: float, max_samples: int) -> None:
        """One sample of ``value`` at ``at`` (seconds), weighed with ``half_life_s`` (> 0); samples
        older than ``horizon_s`` before it, and the oldest beyond ``max_samples``, are dropped."""
        points = self.points
        points.append((at, value))
        horizon = at - horizon_s
        while points and (points[0][0] < horizon or len(points) > max_samples):
            points.popleft()
        self._dirty = True
        self._half_life_s = half_life_s

    def _refresh(self) -> None:
        if not self._dirty:
            return
        self._dirty = False
        points = self.points
        if not points:
            self._median = self._weight = 0.0
            self._spreads = (0.0,) * _N_SPREADS
            return
        newest = points[-1][0]
        k = _LN2 / self._half_life_s
        ordered = sorted((v, math.exp(k * (t - newest))) for t, v in points)
        total = sum(w for _, w in ordered)
        self._weight = total
        median = self._median = _weighted_median(ordered, total)
        self._spreads = tuple(
            max(0.0, _weighted_quantile(ordered, total, q) - median) for q in SPREAD_QUANTILES
        )

    @property
    def median(self) -> float:
        """The samples' weighted median (0 without samples)."""
        self._refresh()
        return self._median

    @property
    def spreads(self) -> tuple[float, ...]:
        """Each ``SPREAD_QUANTILES`` entry's weighted quantile less the median (zeros without
        samples)."""
        self._refresh()
        return self._spreads

    def weight_at(self, now: float, half_life_s: float) -> float:
        """The samples' total weight at ``now`` (decayed since the newest)."""
        if not self.points:
            return 0.0
        self._refresh()
        age = max(0.0, now - self.points[-1][0])
        return self._weight * math.exp(-_LN2 * age / half_life_s)


def _weighted_median(ordered: list[tuple[float, float]], total: float) -> float:
    """The weighted median of (value, weight) pairs sorted by value (the mean of the two middle
    values where the halves meet exactly)."""
    half = total / 2.0
    run = 0.0
    for i, (v, w) in enumerate(ordered):
        run += w
        if run > half + 1e-12:
            return v
        if abs(run - half) <= 1e-12 and i + 1 < len(ordered):
            return (v + ordered[i + 1][0]) / 2.0
    return ordered[-1][0] if ordered else 0.0


def _weighted_quantile(ordered: list[tuple[float, float]], total: float, q: float) -> float:
    """The ``q`` weighted quantile (0-1) of (value, weight) pairs sorted by value: the least value
    whose cumulative weight exceeds ``q`` of ``total`` (the largest for ``q`` 1)."""
    target = q * total
    run = 0.0
    for v, w in ordered:
        run += w
        if run > target + 1e-12:
            return v
    return ordered[-1][0] if ordered else 0.0
