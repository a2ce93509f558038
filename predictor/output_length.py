"""Predict a request's output length from the recent output lengths of its model and tenant.

A prediction is a chosen quantile of the most specific population with enough samples
(tenant -> model -> prior), never above ``max_tokens``. A high quantile (0.9) is the cautious
choice for SLO checks; the median suits throughput estimates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from statistics import NormalDist
from typing import Final, TypeVar

import numpy as np
import numpy.typing as npt

__all__ = ["OutputLengthConfig", "OutputLengthEstimate", "OutputLengthPredictor", "Population"]

_STANDARD_NORMAL: Final = NormalDist()
_K = TypeVar("_K")


class Population(StrEnum):
    """Which data a prediction came from."""

    TENANT = "tenant"
    MODEL = "model"
    PRIOR = "prior"


@dataclass(frozen=True, slots=True)
class OutputLengthConfig:
    """``window``: recent samples kept per population. ``min_tenant_samples`` /
    ``min_model_samples``: samples before that population is trusted. ``prior_median_tokens`` and
    ``prior_sigma``: the lognormal assumed with no data (chat outputs are roughly lognormal).
    ``resort_every``: observations between refreshes of the sorted copy. ``max_populations``: bound
    on tracked (model, tenant) pairs; the oldest-created is dropped beyond it."""

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
    """Per model and per (model, tenant) recent output lengths. Not thread-safe."""

    def __init__(self, config: OutputLengthConfig | None = None) -> None:
        self._config = config or OutputLengthConfig()
        self._models: dict[str, _Ring] = {}
        self._tenants: dict[tuple[str, str], _Ring] = {}

    def observe(self, model: str, tenant: str | None, output_tokens: int) -> bool:
        """Record a finished request's output length in tokens (from its ``usage``; >= 0).

        Returns whether any answer (``predict``, ``expected_remaining``) may differ from now on;
        False while both populations' sorted copies stay as they are (``resort_every``), so a
        caller may keep what it remembered of the answers (``PredictionService``'s memos). A
        population that was never queried has no sorted copy yet, so every sample it takes says
        True: a new one (and an old one dropped for it), one still short of the samples it needs
        to be trusted, one reaching them.
        """
        if output_tokens < 0:
            raise ValueError(f"output_tokens must be >= 0, got {output_tokens}")
        every = self._config.resort_every
        changed = self._ring(self._models, model).add(float(output_tokens), every)
        if tenant is not None and self._ring(self._tenants, (model, tenant)).add(float(output_tokens), every):
            changed = True
        return changed

    def samples(self, model: str, tenant: str | None = None) -> int:
        """Samples held for the model, or for the tenant on that model."""
        ring = self._models.get(model) if tenant is None else self._tenants.get((model, tenant))
        return ring.count if ring else 0

    def predict(
        self, model: str, tenant: str | None, max_tokens: int, quantile: float = 0.5
    ) -> OutputLengthEstimate:
        """The ``quantile`` (0-1) of output length for a request capped at ``max_tokens`` (>= 1).

        Uses the tenant's own data when it has ``min_tenant_samples``, else the model's when it has
        ``min_model_samples``, else the lognormal prior.
        """
        if not 0.0 <= quantile <= 1.0:
            raise ValueError(f"quantile must be in [0, 1], got {quantile}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        cfg = self._config
        tenant_ring = self._tenants.get((model, tenant)) if tenant is not None else None
        model_ring = self._models.get(model)
        if tenant_ring is not None and tenant_ring.count >= cfg.min_tenant_samples:
            value, population, n = (
                tenant_ring.quantile(quantile, cfg.resort_every),
                Population.TENANT,
                tenant_ring.count,
            )
        elif model_ring is not None and model_ring.count >= cfg.min_model_samples:
            value, population, n = (
                model_ring.quantile(quantile, cfg.resort_every),
                Population.MODEL,
                model_ring.count,
            )
        else:
            value, population, n = self._prior(quantile), Population.PRIOR, 0
        tokens = max(1, math.ceil(value))
        return OutputLengthEstimate(min(tokens, max_tokens), quantile, population, n, tokens > max_tokens)

    def expected_remaining(
        self, model: str, tenant: str | None, generated: int, max_tokens: int | None = None
    ) -> float:
        """Expected output tokens still to come for a request that has produced ``generated`` (>= 0).

        The mean of the population's lengths above ``generated`` (the lengths it can still end
        with), minus ``generated``, capped at ``max_tokens - generated``; the same population choice
        as ``predict``. Without data, or when ``generated`` exceeds every kept length, the lognormal
        prior's conditional mean. Always >= 1 (a request still running emits at least one more).
        """
        if generated < 0:
            raise ValueError(f"generated must be >= 0, got {generated}")
        ring = self._population(model, tenant)
        mean = ring.mean_above(float(generated), self._config.resort_every) if ring is not None else None
        if mean is None:
            mean = self._prior_mean_above(float(generated))
        rest = mean - generated
        if max_tokens is not None:
            rest = min(rest, float(max_tokens - generated))
        return max(1.0, rest)

    def expected_remaining_many(
        self, model: str, tenant: str | None, generated: Sequence[int], max_tokens: Sequence[int | None]
    ) -> list[float]:
        """``expected_remaining`` for many requests of one population at once (same results).

        One sorted-array search for all of them: a replica's in-flight list is hundreds long.
        """
        if len(generated) != len(max_tokens):
            raise ValueError("generated and max_tokens must have the same length")
        if any(g < 0 for g in generated):
            raise ValueError("generated must be >= 0")
        ring = self._population(model, tenant)
        done = np.asarray(generated, dtype=np.float64)
        if ring is None:
            means = np.array([self._prior_mean_above(float(g)) for g in generated])
        else:
            means = ring.means_above(done, self._config.resort_every)
            for i in np.flatnonzero(np.isnan(means)):
                means[i] = self._prior_mean_above(float(done[i]))
        caps = np.array([np.inf if m is None else float(m) for m in max_tokens])
        rest = np.minimum(means - done, caps - done)
        return [float(x) for x in np.maximum(rest, 1.0)]

    def _population(self, model: str, tenant: str | None) -> _Ring | None:
        """The ring ``predict`` would use (tenant, else model), ``None`` when neither has enough."""
        cfg = self._config
        ring = self._tenants.get((model, tenant)) if tenant is not None else None
        if ring is not None and ring.count >= cfg.min_tenant_samples:
            return ring
        ring = self._models.get(model)
        return ring if ring is not None and ring.count >= cfg.min_model_samples else None

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

    def _ring(self, rings: dict[_K, _Ring], key: _K) -> _Ring:
        ring = rings.get(key)
        if ring is None:
            if len(rings) >= self._config.max_populations:
                del rings[next(iter(rings))]
            ring = rings[key] = _Ring(self._config.window)
        return ring
