"""Prompt tokens from characters: a per-model characters-per-token ratio learned from usage."""

from __future__ import annotations

import pytest

from predictor.prompt_tokens import PromptTokenConfig, PromptTokenEstimator


@pytest.mark.parametrize(
    ("chars", "tokens"),
    [(0, 1), (1, 1), (4000, 1000), (4001, 1001)],
    ids=["empty", "one-char", "4000", "rounds-up"],
)
def test_prior_is_four_chars_per_token(chars: int, tokens: int) -> None:
    est = PromptTokenEstimator().estimate("m", chars)
    assert (est.tokens, est.chars_per_token, est.samples) == (tokens, 4.0, 0)


@pytest.mark.parametrize(
    ("true_ratio", "observations"),
    [(3.0, 60), (2.2, 60), (6.5, 60)],
    ids=["code-like", "cjk-like", "verbose-english"],
)
def test_ratio_converges_to_usage_reports(true_ratio: float, observations: int) -> None:
    e = PromptTokenEstimator()
    for i in range(observations):
        tokens = 200 + 37 * (i % 11)
        e.observe("m", round(tokens * true_ratio), tokens)
    assert e.chars_per_token("m") == pytest.approx(true_ratio, rel=0.01)
    assert e.estimate("m", 10_000).tokens == pytest.approx(10_000 / true_ratio, rel=0.01)
    assert e.estimate("m", 10).samples == observations


def test_long_prompts_outweigh_template_overhead_on_short_ones() -> None:
    # Each prompt carries ~30 template tokens; text itself runs at 4 chars/token.
    e = PromptTokenEstimator()
    for _ in range(50):
        e.observe("m", 20, 5 + 30)  # a 20-char "hi": ratio 0.57
        e.observe("m", 20_000, 5000 + 30)  # a long document: ratio ~3.98
    assert e.chars_per_token("m") == pytest.approx(20_020 / 5065, rel=0.02)


def test_models_learn_separately() -> None:
    e = PromptTokenEstimator()
    for _ in range(50):
        e.observe("a", 3000, 1000)
    assert e.chars_per_token("a") == pytest.approx(3.0, rel=0.01)
    assert e.chars_per_token("b") == 4.0


@pytest.mark.parametrize(
    ("chars", "tokens", "expected"),
    [(0, 10, 4.0), (10, 0, 4.0), (1_000_000, 1, 16.0), (1, 1_000_000, 0.5)],
    ids=["no-chars-ignored", "no-tokens-ignored", "absurd-high-clamped", "absurd-low-clamped"],
)
def test_nonsense_reports_are_ignored_or_clamped(chars: int, tokens: int, expected: float) -> None:
    e = PromptTokenEstimator(PromptTokenConfig(alpha=1.0))
    e.observe("m", chars, tokens)
    assert e.chars_per_token("m") == expected


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="alpha"):
        PromptTokenConfig(alpha=0.0)
    with pytest.raises(ValueError, match="min_chars_per_token"):
        PromptTokenConfig(prior_chars_per_token=40.0)
    with pytest.raises(ValueError, match="chars"):
        PromptTokenEstimator().estimate("m", -1)
