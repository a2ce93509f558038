"""Estimate prompt tokens from characters, without a tokenizer, per (model, tenant).

Each (model, tenant) population learns its tokens per character from the ``usage`` blocks
replicas return (``observe``): the mean of each report's tokens per character, weighted by its
characters (so that the estimate of a sum of prompts is unbiased) discounted for short prompts,
whose counts are mostly chat template: ``chars^2 / (chars + small_prompt_chars)``, so that a long
prompt outweighs any number of tiny ones. Older reports fade as weight accrues
(``half_life_chars``). A population is trusted alone once its weight reaches
``min_tenant_chars``; until then it is blended with the model's fleet prior: the median of the
trusted populations' ratios and the configured prior, each one vote, clamped to a plausible band.
One tenant's traffic therefore moves only its own estimate, and a newcomer's by at most one vote
among the others. ``fewest_tokens`` is the lowest plausible count (what refusing a prompt as too
long may rely on, with no tokenizer). Memory is bounded: at most ``max_populations`` populations,
the least recently taught dropped first.
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["PromptTokenConfig", "PromptTokenEstimate", "PromptTokenEstimator"]


@dataclass(frozen=True, slots=True)
class PromptTokenConfig:
    """``prior_chars_per_token``: the ratio before any data (one vote in every fleet prior).
    ``min_tenant_chars``: weight (characters, short prompts discounted) of a population's own
    usage before its ratio is used alone (and votes in its model's fleet prior).
    ``half_life_chars``: weight of later usage that halves an observation's.
    ``small_prompt_chars``: a report of ``c`` characters weighs ``c^2 / (c + small_prompt_chars)``.
    ``min_chars_per_token`` / ``max_chars_per_token``: the clamp on each usage report (nonsense,
    or a prompt that is all template); the latter also sets ``fewest_tokens``.
    ``fleet_min_chars_per_token`` / ``fleet_max_chars_per_token``: the band each vote in a fleet
    prior is clamped to (BPE tokenizers on real text). ``max_populations``: bound on tracked
    (model, tenant) pairs. ``refresh_every``: observations of a model between recomputations of
    its fleet prior (or a quarter of its populations' number, when that is more: a
    recomputation reads every population)."""

    prior_chars_per_token: float = 4.0
    min_tenant_chars: int = 4096
    half_life_chars: float = 200_000.0
    small_prompt_chars: float = 256.0
    min_chars_per_token: float = 0.5
    max_chars_per_token: float = 16.0
    fleet_min_chars_per_token: float = 2.0
    fleet_max_chars_per_token: float = 8.0
    max_populations: int = 4096
    refresh_every: int = 16

    def __post_init__(self) -> None:
        if not (
            0.0
            < self.min_chars_per_token
            <= self.fleet_min_chars_per_token
            <= self.prior_chars_per_token
            <= self.fleet_max_chars_per_token
            <= self.max_chars_per_token
        ):
            raise ValueError(
                "need 0 < min_chars_per_token <= fleet_min_chars_per_token <= prior_chars_per_token"
                " <= fleet_max_chars_per_token <= max_chars_per_token"
            )
        if self.min_tenant_chars < 1 or self.half_life_chars <= 0 or self.small_prompt_chars < 0:
            raise ValueError("min_tenant_chars and half_life_chars must be positive, small_prompt_chars >= 0")
        if self.max_populations < 1 or self.refresh_every < 1:
            raise ValueError("max_populations and refresh_every must be >= 1")


@dataclass(frozen=True, slots=True)
class PromptTokenEstimate:
    """``tokens``: estimated prompt tokens (>= 1). ``chars_per_token``: the ratio used.
    ``samples``: the population's own usage reports behind it (0: the fleet prior alone).
    ``fewest_tokens``: the lowest plausible count (>= 1, <= ``tokens``)."""

    tokens: int
    chars_per_token: float
    samples: int
    fewest_tokens: int = 1


@dataclass(slots=True)
class _Ratio:
    """Decayed sums: ``weight`` (of the reports) and ``weighted`` (weight x tokens per character)."""

    weight: float = 0.0
    weighted: float = 0.0
    samples: int = 0


class PromptTokenEstimator:
    """Per-(model, tenant) characters-per-token, learned from usage reports, with a robust
    per-model fleet prior. ``tenant`` ``None`` is the population of requests of no tenant.
    Not thread-safe."""

    def __init__(self, config: PromptTokenConfig | None = None) -> None:
        self._config = config or PromptTokenConfig()
        #: Every population, least recently taught first (the eviction order).
        self._lru: OrderedDict[tuple[str, str | None], _Ratio] = OrderedDict()
        #: The same populations by model, for the fleet priors.
        self._by_model: dict[str, dict[str | None, _Ratio]] = {}
        #: Per model: (its fleet prior, observations since it was computed).
        self._fleet: dict[str, tuple[float, int]] = {}

    @property
    def config(self) -> PromptTokenConfig:
        """The knobs it was built with."""
        return self._config

    def populations(self) -> int:
        """How many (model, tenant) populations it holds (<= ``max_populations``)."""
        return len(self._lru)

    def fleet_chars_per_token(self, model: str) -> float:
        """``model``'s fleet prior: the median of the configured prior and each trusted
        population's ratio, every vote clamped to the fleet band."""
        if model not in self._by_model:
            return self._config.prior_chars_per_token
        cached = self._fleet.get(model)
        if cached is not None and cached[1] < max(
            self._config.refresh_every, len(self._by_model[model]) // 4
        ):
            return cached[0]
        value = self._fleet_now(model)
        self._fleet[model] = (value, 0)
        return value

    def chars_per_token(self, model: str, tenant: str | None = None) -> float:
        """The ratio for ``tenant`` on ``model``: its own once trusted, blended with the fleet
        prior in proportion to its characters of usage before."""
        cfg = self._config
        fleet = self.fleet_chars_per_token(model)
        r = self._by_model.get(model, {}).get(tenant)
        if r is None or r.weight <= 0.0:
            return fleet
        share = min(1.0, r.weight / cfg.min_tenant_chars)
        return share * self._own(r) + (1.0 - share) * fleet

    def fewest_tokens(self, chars: int) -> int:
        """The lowest plausible token count of a ``chars``-character prompt (>= 1):
        its characters at ``max_chars_per_token``."""
        return max(1, math.ceil(max(chars, 0) / self._config.max_chars_per_token))

    def estimate(self, model: str, chars: int, tenant: str | None = None) -> PromptTokenEstimate:
        """Estimated tokens for ``tenant``'s prompt of ``chars`` characters (>= 0) on ``model``;
        at least 1 token."""
        if chars < 0:
            raise ValueError(f"chars must be >= 0, got {chars}")
        r = self._by_model.get(model, {}).get(tenant)
        ratio = self.chars_per_token(model, tenant)
        tokens = max(1, math.ceil(chars / ratio))
        return PromptTokenEstimate(
            tokens, ratio, r.samples if r else 0, min(tokens, self.fewest_tokens(chars))
        )

    def observe(self, model: str, chars: int, actual_tokens: int, tenant: str | None = None) -> None:
        """Correct ``tenant``'s ratio on ``model`` with a response's ``usage.prompt_tokens`` for a
        ``chars``-long prompt. Reports with no characters or no tokens carry no ratio and are
        ignored; the report's ratio is clamped to ``[min, max]_chars_per_token``, its weight
        discounted when it is short (``small_prompt_chars``)."""
        if chars <= 0 or actual_tokens <= 0:
            return
        cfg = self._config
        key = (model, tenant)
        r = self._lru.get(key)
        if r is None:
            if len(self._lru) >= cfg.max_populations:
                self._drop(*next(iter(self._lru)))
            r = self._lru[key] = _Ratio()
            self._by_model.setdefault(model, {})[tenant] = r
        else:
            self._lru.move_to_end(key)
        ratio = min(max(chars / actual_tokens, cfg.min_chars_per_token), cfg.max_chars_per_token)
        weight = chars * chars / (chars + cfg.small_prompt_chars)
        keep = 0.5 ** (weight / cfg.half_life_chars)
        r.weight = r.weight * keep + weight
        r.weighted = r.weighted * keep + weight / ratio
        r.samples += 1
        cached = self._fleet.get(model)
        if cached is not None:
            self._fleet[model] = (cached[0], cached[1] + 1)

    # ------------------------------------------------------------------ internals

    def _own(self, r: _Ratio) -> float:
        cfg = self._config
        return min(max(r.weight / r.weighted, cfg.min_chars_per_token), cfg.max_chars_per_token)

    def _fleet_now(self, model: str) -> float:
        cfg = self._config
        votes = [cfg.prior_chars_per_token]
        for r in self._by_model.get(model, {}).values():
            if r.weight >= cfg.min_tenant_chars:
                votes.append(
                    min(max(self._own(r), cfg.fleet_min_chars_per_token), cfg.fleet_max_chars_per_token)
                )
        return float(statistics.median(votes))

    def _drop(self, model: str, tenant: str | None) -> None:
        del self._lru[(model, tenant)]
        tenants = self._by_model[model]
        del tenants[tenant]
        if not tenants:
            del self._by_model[model]
        self._fleet.pop(model, None)  # a vote may have gone: recomputed on its next use
