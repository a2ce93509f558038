"""Predict a request's output length from the recent output lengths of its model and tenant.

A prediction is a chosen quantile of the tenant's own recent lengths once it has enough samples,
else of the model's fleet prior, never above ``max_tokens``. The fleet prior is the median
population (each tenant one vote, the lognormal prior one more), so no single tenant's traffic
decides what another is predicted. A high quantile (0.9) is the cautious choice for SLO checks;
the median suits throughput estimates.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from statistics import NormalDist
from typing import Final

import numpy as np
import numpy.typing as npt

__all__ = ["OutputLengthConfig", "OutputLengthEstimate", "OutputLengthPredictor", "Population"]

_STANDARD_NORMAL: Final = NormalDist()


class Population(StrEnum):
    """Which data a prediction came from: the tenant's own recent lengths, the model's (its fleet
    prior, or the own lengths of requests of no tenant), or the lognormal prior alone."""

    TENANT = "tenant"
    MODEL = "model"
    PRIOR = "prior"


@dataclass(frozen=True, slots=True)
class OutputLengthConfig:
    """``window``: recent samples kept per population. ``min_tenant_samples``: samples before a
    tenant's own population is trusted. ``min_model_samples``: samples before a population votes in
    its model's fleet prior (and before requests of no tenant are predicted from their own).
    ``prior_median_tokens`` and ``prior_sigma``: the lognormal assumed with no data (chat outputs
    are roughly lognormal; one vote in every fleet prior). ``resort_every``: observations between
    refreshes of the sorted copy. ``max_populations``: bound on tracked (model, tenant) pairs; the
    least recently taught is dropped beyond it."""

    window: int = 2048
    min_tenant_samples: int = 50
    min_model_samples: int = 20
    prior_median_tokens: float = 256.0
    prior_sigma: float = 1.0
    resort_every: int = 16
    max_populations: int = 4096

    def __post_init__(self) -> None:
        if min(self.window, self.min_tenant_samples, self.min_model_samples, self.resort_every) < 1:
            raise ValueError("window, sample minimums and resort_every must be >= 1")
        if self.prior_median_tokens <= 0 or self.prior_sigma < 0 or self.max_populations < 1:
            raise ValueError("prior_median_tokens and max_populations must be positive, prior_sigma >= 0")


@dataclass(frozen=True, slots=True)
class OutputLengthEstimate:
    """``tokens``: predicted output length (>= 1, <= max_tokens). ``quantile``: which quantile.
    ``population``: where it came from; ``samples``: how many observations backed it (0 for the
    prior). ``capped``: ``max_tokens`` was lower than the quantile."""

    tokens: int
    quantile: float
    population: Population
    samples: int
    capped: bool


class _Ring:
    """Fixed-size ring of recent lengths with a lazily refreshed sorted copy (and its suffix sums)."""

    __slots__ = ("_buf", "_count", "_next", "_sorted", "_stale", "_suffix")

    def __init__(self, size: int) -> None:
        self._buf: npt.NDArray[np.float64] = np.zeros(size)
        self._next = 0
        self._count = 0
        self._sorted: npt.NDArray[np.float64] = np.zeros(0)
        self._suffix: npt.NDArray[np.float64] = np.zeros(1)
        self._stale = 0

    @property
    def count(self) -> int:
        return self._count

    def add(self, value: float, resort_every: int) -> bool:
        """Keep ``value``; True when the sorted copy is due for a refresh, so the next query may
        answer differently (``quantile`` and the means read only the sorted copy)."""
        self._buf[self._next] = value
        self._next = (self._next + 1) % len(self._buf)
        self._count = min(self._count + 1, len(self._buf))
        self._stale += 1
        return self._stale >= resort_every or len(self._sorted) == 0

    def _refresh(self, resort_every: int) -> None:
        if self._stale >= resort_every or len(self._sorted) == 0:
            self._sorted = np.sort(self._buf[: self._count])
            # suffix[i] = sum of sorted[i:]; suffix[len] = 0.
            self._suffix = np.concatenate((np.cumsum(self._sorted[::-1])[::-1], [0.0]))
            self._stale = 0

    def quantile(self, q: float, resort_every: int) -> float:
        """The ``q`` quantile (linear interpolation between order statistics)."""
        self._refresh(resort_every)
        s = self._sorted
        pos = q * (len(s) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(s) - 1)
        return float(s[lo] + (s[hi] - s[lo]) * (pos - lo))

    def means_above(self, values: npt.NDArray[np.float64], resort_every: int) -> npt.NDArray[np.float64]:
        """``mean_above`` for every value at once; NaN where no kept length is above it."""
        self._refresh(resort_every)
        i = np.searchsorted(self._sorted, values, side="right")
        n = len(self._sorted) - i
        result: npt.NDArray[np.float64] = np.where(n > 0, self._suffix[i] / np.maximum(n, 1), np.nan)
        return result

    def mean_above(self, value: float, resort_every: int) -> float | None:
        """Mean of the kept lengths strictly above ``value``; ``None`` when none is."""
        self._refresh(resort_every)
        i = int(np.searchsorted(self._sorted, value, side="right"))
        n = len(self._sorted) - i
        return float(self._suffix[i]) / n if n > 0 else None


class OutputLengthPredictor:
    """Recent output lengths per (model, tenant), and per model a fleet prior robust to any one
    tenant: the median of its populations (each one vote, with the lognormal prior as one more).
    ``tenant`` ``None`` is the population of requests of no tenant. Not thread-safe."""

    def __init__(self, config: OutputLengthConfig | None = None) -> None:
        self._config = config or OutputLengthConfig()
        #: Every population, least recently taught first (the eviction order).
        self._rings: OrderedDict[tuple[str, str | None], _Ring] = OrderedDict()
        #: The same populations by model, for the fleet priors.
        self._by_model: dict[str, dict[str | None, _Ring]] = {}
        #: Per model, its fleet prior's middle voters (``None``: the lognormal prior) and the
        #: samples behind them, and how many times a voter moved since they were chosen: chosen
        #: again after enough moves (``_voter_moved``; their quantiles are always read afresh),
        #: or when a population is dropped.
        self._fleet: dict[str, tuple[tuple[_Ring | None, ...], int]] = {}
        self._moves: dict[str, int] = {}

    def observe(self, model: str, tenant: str | None, output_tokens: int) -> bool:
        """Record a finished request's output length in tokens (from its ``usage``; >= 0).

        Returns whether any answer (``predict``, ``expected_remaining``) may differ from now on;
        False while every population's sorted copy stays as it is (``resort_every``) and none
        crossed a sample threshold, so a caller may keep what it remembered of the answers
        (``PredictionService``'s memos). A population that was never queried has no sorted copy
        yet, so every sample it takes says True, and so does dropping one for a new one.
        """
        if output_tokens < 0:
            raise ValueError(f"output_tokens must be >= 0, got {output_tokens}")
        cfg = self._config
        key = (model, tenant)
        ring = self._rings.get(key)
        changed = False
        if ring is None:
            if len(self._rings) >= cfg.max_populations:
                self._drop(*next(iter(self._rings)))
                changed = True
            ring = self._rings[key] = _Ring(cfg.window)
            self._by_model.setdefault(model, {})[tenant] = ring
        else:
            self._rings.move_to_end(key)
        before = ring.count
        moved = ring.add(float(output_tokens), cfg.resort_every)
        moved |= any(before < n <= ring.count for n in (cfg.min_tenant_samples, cfg.min_model_samples))
        if moved and ring.count >= cfg.min_model_samples:
            self._voter_moved(model)
        return changed or moved

    def samples(self, model: str, tenant: str | None = None) -> int:
        """Samples held for ``tenant`` on ``model`` (``None``: requests of no tenant)."""
        ring = self._by_model.get(model, {}).get(tenant)
        return ring.count if ring else 0

    def populations(self) -> int:
        """How many (model, tenant) populations it holds (<= ``max_populations``)."""
        return len(self._rings)

    def predict(
        self, model: str, tenant: str | None, max_tokens: int, quantile: float = 0.5
    ) -> OutputLengthEstimate:
        """The ``quantile`` (0-1) of output length for a request capped at ``max_tokens`` (>= 1).

        Uses the tenant's own data when it has ``min_tenant_samples`` (requests of no tenant:
        theirs when they have ``min_model_samples``), else the model's fleet prior: the mean of
        the quantile over its middle voter(s), each population with ``min_model_samples`` and the
        lognormal prior voting by their median (``Population.PRIOR`` when the prior alone is in
        the middle).
        """
        if not 0.0 <= quantile <= 1.0:
            raise ValueError(f"quantile must be in [0, 1], got {quantile}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        every = self._config.resort_every
        rings, population, n = self._population(model, tenant)
        value = sum(self._prior(quantile) if r is None else r.quantile(quantile, every) for r in rings)
        tokens = max(1, math.ceil(value / len(rings)))
        return OutputLengthEstimate(min(tokens, max_tokens), quantile, population, n, tokens > max_tokens)

    def expected_remaining(
        self, model: str, tenant: str | None, generated: int, max_tokens: int | None = None
    ) -> float:
        """Expected output tokens still to come for a request that has produced ``generated`` (>= 0).

        The mean of the population's lengths above ``generated`` (the lengths it can still end
        with), minus ``generated``, capped at ``max_tokens - generated``; the same population choice
        as ``predict`` (the mean over the fleet prior's middle voters). Without data, or when
        ``generated`` exceeds every kept length, the lognormal prior's conditional mean. Always
        >= 1 (a request still running emits at least one more).
        """
        if generated < 0:
            raise ValueError(f"generated must be >= 0, got {generated}")
        rings, _, _ = self._population(model, tenant)
        every = self._config.resort_every
        total = 0.0
        for ring in rings:
            mean = ring.mean_above(float(generated), every) if ring is not None else None
            total += self._prior_mean_above(float(generated)) if mean is None else mean
        rest = total / len(rings) - generated
        if max_tokens is not None:
            rest = min(rest, float(max_tokens - generated))
        return max(1.0, rest)

    def expected_remaining_many(
        self, model: str, tenant: str | None, generated: Sequence[int], max_tokens: Sequence[int | None]
    ) -> list[float]:
        """``expected_remaining`` for many requests of one population at once (same results).

        One sorted-array search per voter for all of them: a replica's in-flight list is
        hundreds long.
        """
        if len(generated) != len(max_tokens):
            raise ValueError("generated and max_tokens must have the same length")
        if any(g < 0 for g in generated):
            raise ValueError("generated must be >= 0")
        rings, _, _ = self._population(model, tenant)
        done = np.asarray(generated, dtype=np.float64)
        total = np.zeros(len(done))
        for ring in rings:
            if ring is None:
                means = np.array([self._prior_mean_above(float(g)) for g in generated])
            else:
                means = ring.means_above(done, self._config.resort_every)
                for i in np.flatnonzero(np.isnan(means)):
                    means[i] = self._prior_mean_above(float(done[i]))
            total = total + means
        caps = np.array([np.inf if m is None else float(m) for m in max_tokens])
        rest = np.minimum(total / len(rings) - done, caps - done)
        return [float(x) for x in np.maximum(rest, 1.0)]

    def _population(self, model: str, tenant: str | None) -> tuple[tuple[_Ring | None, ...], Population, int]:
        """The ring(s) ``predict`` averages (``None``: the prior), where they come from and the
        samples behind them: the tenant's own when it has enough, else the fleet prior's middle."""
        cfg = self._config
        own = self._by_model.get(model, {}).get(tenant)
        if own is not None and own.count >= (
            cfg.min_model_samples if tenant is None else cfg.min_tenant_samples
        ):
            return (own,), (Population.MODEL if tenant is None else Population.TENANT), own.count
        fleet = self._fleet.get(model)
        if fleet is None:
            fleet = self._fleet_now(model)
            if model in self._by_model:
                self._fleet[model] = fleet
        rings, n = fleet
        return rings, (Population.PRIOR if n == 0 else Population.MODEL), n

    def _fleet_now(self, model: str) -> tuple[tuple[_Ring | None, ...], int]:
        """The middle voter(s) of ``model``'s populations with ``min_model_samples`` and the
        prior, ranked by median (two when they are even in number), and their samples."""
        cfg = self._config
        voters: list[tuple[float, int, _Ring | None]] = [(self._prior(0.5), 0, None)]
        for i, ring in enumerate(self._by_model.get(model, {}).values(), start=1):
            if ring.count >= cfg.min_model_samples:
                voters.append((ring.quantile(0.5, cfg.resort_every), i, ring))
        voters.sort(key=lambda v: (v[0], v[1]))
        half = len(voters) // 2
        middle = voters[half : half + 1] if len(voters) % 2 else voters[half - 1 : half + 1]
        rings = tuple(v[2] for v in middle)
        return rings, sum(r.count for r in rings if r is not None)

    def _voter_moved(self, model: str) -> None:
        """A voter of ``model``'s fleet prior took a sample that may move it (a refreshed sorted
        copy, or a sample threshold crossed): the middle is chosen again every ``resort_every``
        moves, or every quarter of its populations' number of moves when that is more (choosing
        costs a quantile per population)."""
        if model not in self._fleet:
            return
        moves = self._moves.get(model, 0) + 1
        if moves >= max(self._config.resort_every, len(self._by_model[model]) // 4):
            self._fleet.pop(model)
            moves = 0
        self._moves[model] = moves

    def _drop(self, model: str, tenant: str | None) -> None:
        del self._rings[(model, tenant)]
        rings = self._by_model[model]
        del rings[tenant]
        if not rings:
            del self._by_model[model]
            self._moves.pop(model, None)
        self._fleet.pop(model, None)

    def _prior_mean_above(self, value: float) -> float:
        """E[L | L > value] for the lognormal prior (closed form)."""
        mu, sigma = math.log(self._config.prior_median_tokens), self._config.prior_sigma
        if sigma <= 0.0:
            return max(math.exp(mu), value + 1.0)
        z = (math.log(max(value, 1e-9)) - mu) / sigma
        tail = 1.0 - _STANDARD_NORMAL.cdf(z)
        if tail <= 1e-12:
            return value + 1.0
        return math.exp(mu + sigma * sigma / 2.0) * (1.0 - _STANDARD_NORMAL.cdf(z - sigma)) / tail

    def _prior(self, quantile: float) -> float:
        q = min(max(quantile, 1e-6), 1.0 - 1e-6)
        z = _STANDARD_NORMAL.inv_cdf(q)
        return self._config.prior_median_tokens * math.exp(self._config.prior_sigma * z)
