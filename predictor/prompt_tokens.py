"""Estimate prompt tokens from characters, without a tokenizer.

Each model learns its characters-per-token ratio from the ``usage`` blocks replicas return
(``observe(chars, prompt_tokens)``), as a ratio of two exponentially weighted sums so that long
prompts dominate; the prior enters as ``prior_tokens`` worth of text at ``prior_chars_per_token``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["PromptTokenConfig", "PromptTokenEstimate", "PromptTokenEstimator"]


@dataclass(frozen=True, slots=True)
class PromptTokenConfig:
    """``prior_chars_per_token``: the ratio before any data. ``prior_tokens``: how many tokens of
    evidence the prior is worth. ``alpha``: weight of each new observation (0-1).
    ``min_chars_per_token`` / ``max_chars_per_token``: clamp against nonsense usage reports.
    ``max_models``: bound on tracked models (oldest-created dropped beyond it)."""

    prior_chars_per_token: float = 4.0
    prior_tokens: float = 512.0
    alpha: float = 0.1
    min_chars_per_token: float = 0.5
    max_chars_per_token: float = 16.0
    max_models: int = 1024

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        if not 0.0 < self.min_chars_per_token <= self.prior_chars_per_token <= self.max_chars_per_token:
            raise ValueError("need 0 < min_chars_per_token <= prior_chars_per_token <= max_chars_per_token")
        if self.prior_tokens <= 0 or self.max_models < 1:
            raise ValueError("prior_tokens and max_models must be positive")


@dataclass(frozen=True, slots=True)
class PromptTokenEstimate:
    """``tokens``: estimated prompt tokens (>= 1). ``chars_per_token``: the ratio used.
    ``samples``: usage reports behind it (0 = prior only)."""

    tokens: int
    chars_per_token: float
    samples: int


@dataclass(slots=True)
class _Ratio:
    chars: float
    tokens: float
    samples: int = 0


class PromptTokenEstimator:
    """Per-model characters-per-token, learned from usage reports. Not thread-safe."""

    def __init__(self, config: PromptTokenConfig | None = None) -> None:
        self._config = config or PromptTokenConfig()
        self._models: dict[str, _Ratio] = {}

    def chars_per_token(self, model: str) -> float:
        """The current ratio for ``model`` (the prior when nothing was observed)."""
        r = self._models.get(model)
        return self._clamp(r.chars / r.tokens) if r else self._config.prior_chars_per_token

    def estimate(self, model: str, chars: int) -> PromptTokenEstimate:
        """Estimated tokens for a prompt of ``chars`` characters (>= 0); at least 1 token."""
        if chars < 0:
            raise ValueError(f"chars must be >= 0, got {chars}")
        r = self._models.get(model)
        ratio = self.chars_per_token(model)
        return PromptTokenEstimate(max(1, math.ceil(chars / ratio)), ratio, r.samples if r else 0)

    def observe(self, model: str, chars: int, actual_tokens: int) -> None:
        """Correct the ratio with a response's ``usage.prompt_tokens`` for a ``chars``-long prompt.

        Reports with no characters or no tokens carry no ratio and are ignored.
        """
        if chars <= 0 or actual_tokens <= 0:
            return
        cfg = self._config
        r = self._models.get(model)
        if r is None:
            if len(self._models) >= cfg.max_models:
                del self._models[next(iter(self._models))]
            r = self._models[model] = _Ratio(cfg.prior_chars_per_token * cfg.prior_tokens, cfg.prior_tokens)
        a = cfg.alpha
        r.chars = (1.0 - a) * r.chars + a * chars
        r.tokens = (1.0 - a) * r.tokens + a * actual_tokens
        r.samples += 1

    def _clamp(self, ratio: float) -> float:
        return min(max(ratio, self._config.min_chars_per_token), self._config.max_chars_per_token)
