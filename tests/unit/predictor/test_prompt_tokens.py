"""Prompt tokens from characters: a characters-per-token ratio learned per (model, tenant) from
usage, weighted by characters, with a per-model fleet prior that no one tenant decides."""

from __future__ import annotations

import pytest

from predictor.prompt_tokens import PromptTokenConfig, PromptTokenEstimator

#: Fleet priors recomputed on every observation, so that each test sees every vote at once.
EAGER = PromptTokenConfig(refresh_every=1)
#: A chat "hi" as the engine counts it: 2 characters, 9 tokens with its template.
HI_CHARS, HI_TOKENS = 2, 9


def teach(
    e: PromptTokenEstimator, tenant: str | None, ratio: float, chars: int = 20_000, times: int = 5
) -> None:
    """``times`` usage reports of ``chars``-character prompts at ``ratio`` for ``tenant`` on "m"."""
    for _ in range(times):
        e.observe("m", chars, round(chars / ratio), tenant)


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


def test_the_ratio_is_unbiased_for_the_tokens_of_many_prompts() -> None:
    """Prompts whose ratios vary: the tokens it predicts for all of them add up to their tokens
    (a mean of characters per token would undercount the dense ones)."""
    e = PromptTokenEstimator()
    reports = [(3000, 1000), (3000, 500), (6000, 2000), (2000, 1000)] * 10
    for chars, tokens in reports:
        e.observe("m", chars, tokens)
    predicted = sum(chars / e.chars_per_token("m") for chars, _ in reports)
    assert predicted == pytest.approx(sum(tokens for _, tokens in reports), rel=0.02)


def test_tiny_prompts_barely_move_a_tenants_own_ratio() -> None:
    e = PromptTokenEstimator(EAGER)
    teach(e, "a", 5.5, chars=12_000, times=1)
    for _ in range(1000):
        e.observe("m", HI_CHARS, HI_TOKENS, "a")
    assert e.chars_per_token("m", "a") == pytest.approx(5.5, rel=0.02)


def test_the_hi_attack_leaves_a_newcomer_where_it_was() -> None:
    """The "hi" attack: 100 chat "hi" from one tenant, then another tenant's first long prompt
    (12,000 characters, context 8,192) is sized as before the attack."""
    e = PromptTokenEstimator(EAGER)
    before = e.estimate("m", 12_000, "victim").tokens
    for _ in range(100):
        e.observe("m", HI_CHARS, HI_TOKENS, "attacker")
    after = e.estimate("m", 12_000, "victim")
    assert after.tokens == before == 3000
    assert after.fewest_tokens == 750  # at 16 characters a token: far under the context


def test_a_sustained_hi_attack_earns_no_vote() -> None:
    e = PromptTokenEstimator(EAGER)
    for _ in range(10_000):  # 20,000 characters of template: weighs less than one long prompt
        e.observe("m", HI_CHARS, HI_TOKENS, "attacker")
    assert e.estimate("m", 12_000, "victim").tokens == 3000
    assert e.chars_per_token("m", "attacker") > 3.8  # and hardly moves its own


@pytest.mark.parametrize("attacker_ratio", [0.5, 16.0], ids=["dense", "sparse"])
def test_one_tenant_is_one_vote_in_the_fleet_prior(attacker_ratio: float) -> None:
    e = PromptTokenEstimator(EAGER)
    teach(e, "attacker", attacker_ratio, times=50)
    # Alone with the prior, its vote (clamped to the 2-8 band) pulls a newcomer halfway at most.
    lone = e.chars_per_token("m", "newcomer")
    assert lone == pytest.approx((4.0 + min(max(attacker_ratio, 2.0), 8.0)) / 2)
    for tenant, ratio in (("b", 3.8), ("c", 4.2), ("d", 4.4)):
        teach(e, tenant, ratio)
    # Voters 3.8, 4.0 (the prior), 4.2, 4.4 and the attacker at one end: an honest middle.
    assert e.chars_per_token("m", "newcomer") in (pytest.approx(4.0, rel=1e-3), pytest.approx(4.2, rel=1e-3))
    # Each tenant keeps its own ratio: the attacker's is not anyone else's.
    assert e.chars_per_token("m", "b") == pytest.approx(3.8, rel=0.01)
    assert e.chars_per_token("m", "attacker") == pytest.approx(attacker_ratio, rel=0.01)


def test_a_new_tenant_is_blended_with_the_fleet_until_trusted() -> None:
    cfg = PromptTokenConfig(min_tenant_chars=4000, refresh_every=1, small_prompt_chars=0)
    e = PromptTokenEstimator(cfg)
    e.observe("m", 2000, 1000, "new")  # half the weight it needs, at 2.0
    assert e.chars_per_token("m", "new") == pytest.approx((4.0 + 2.0) / 2)
    e.observe("m", 2000, 1000, "new")
    assert e.chars_per_token("m", "new") == pytest.approx(2.0, rel=0.01)


def test_the_fleet_prior_is_recomputed_every_refresh_every_observations() -> None:
    e = PromptTokenEstimator(PromptTokenConfig(refresh_every=3, min_tenant_chars=100))
    assert e.fleet_chars_per_token("m") == 4.0
    e.observe("m", 1000, 500, "a")  # a votes 2.0: median of 4.0 and 2.0
    assert e.fleet_chars_per_token("m") == 3.0  # first use of the model's fleet: computed now
    e.observe("m", 1000, 125, "b")  # b votes 8.0
    e.observe("m", 1000, 125, "b")
    assert e.fleet_chars_per_token("m") == 3.0  # two observations since: not yet
    e.observe("m", 1000, 125, "b")
    assert e.fleet_chars_per_token("m") == 4.0  # median of 2.0, 4.0 and 8.0


def test_models_learn_separately() -> None:
    e = PromptTokenEstimator()
    for _ in range(50):
        e.observe("a", 3000, 1000)
    assert e.chars_per_token("a") == pytest.approx(3.0, rel=0.01)
    assert e.chars_per_token("b") == 4.0


def test_memory_is_bounded_and_the_least_recently_taught_goes_first() -> None:
    e = PromptTokenEstimator(PromptTokenConfig(max_populations=100))
    e.observe("m", 8000, 1000, "regular")
    for i in range(10_000):
        e.observe("m", 400, 100, f"tenant-{i}")
        if i % 50 == 0:
            e.observe("m", 8000, 1000, "regular")
    assert e.populations() == 100
    assert e.estimate("m", 8000, "regular").samples > 0
    assert e.estimate("m", 400, "tenant-0").samples == 0


@pytest.mark.parametrize(
    ("chars", "tokens", "expected"),
    [(0, 10, 4.0), (10, 0, 4.0), (1_000_000, 1, 16.0), (1, 1_000_000, 0.5)],
    ids=["no-chars-ignored", "no-tokens-ignored", "absurd-high-clamped", "absurd-low-clamped"],
)
def test_nonsense_reports_are_ignored_or_clamped(chars: int, tokens: int, expected: float) -> None:
    e = PromptTokenEstimator(PromptTokenConfig(min_tenant_chars=1, small_prompt_chars=0))
    e.observe("m", chars, tokens)
    assert e.chars_per_token("m") == expected


@pytest.mark.parametrize(("chars", "fewest"), [(0, 1), (16, 1), (17, 2), (12_000, 750)])
def test_fewest_tokens_is_the_characters_at_the_highest_plausible_ratio(chars: int, fewest: int) -> None:
    e = PromptTokenEstimator()
    assert e.fewest_tokens(chars) == fewest
    assert e.estimate("m", chars).fewest_tokens == min(fewest, e.estimate("m", chars).tokens)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="min_tenant_chars"):
        PromptTokenConfig(min_tenant_chars=0)
    with pytest.raises(ValueError, match="min_chars_per_token"):
        PromptTokenConfig(prior_chars_per_token=40.0)
    with pytest.raises(ValueError, match="fleet_max_chars_per_token"):
        PromptTokenConfig(fleet_max_chars_per_token=20.0)
    with pytest.raises(ValueError, match="refresh_every"):
        PromptTokenConfig(refresh_every=0)
    with pytest.raises(ValueError, match="chars"):
        PromptTokenEstimator().estimate("m", -1)
