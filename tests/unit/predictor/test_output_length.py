"""Output-length prediction: quantiles of recent lengths per tenant, else of the model's fleet prior
(the median population, robust to any one tenant), or the lognormal prior."""

from __future__ import annotations

import math
from statistics import NormalDist

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from predictor.output_length import OutputLengthConfig, OutputLengthPredictor, Population

CFG = OutputLengthConfig(min_tenant_samples=50, min_model_samples=20, resort_every=1)


def predictor_with(
    model_lengths: list[int], tenant_lengths: list[int] | None = None
) -> OutputLengthPredictor:
    p = OutputLengthPredictor(CFG)
    for n in model_lengths:
        p.observe("m", None, n)
    for n in tenant_lengths or []:
        p.observe("m", "acme", n)
    return p


@pytest.mark.parametrize(
    ("quantile", "max_tokens", "tokens", "capped"),
    [
        (0.5, 4096, 51, False),  # 1..100: median 50.5, rounded up
        (0.9, 4096, 91, False),  # 90.1 -> 91
        (1.0, 4096, 100, False),
        (0.0, 4096, 1, False),
        (0.9, 64, 64, True),  # max_tokens is the binding cap
    ],
    ids=["median", "p90", "max", "min", "capped-by-max-tokens"],
)
def test_model_quantiles(quantile: float, max_tokens: int, tokens: int, capped: bool) -> None:
    est = predictor_with(list(range(1, 101))).predict("m", None, max_tokens, quantile)
    assert (est.tokens, est.population, est.samples, est.capped) == (tokens, Population.MODEL, 100, capped)
    assert est.quantile == quantile


PRIOR_MEDIAN = math.ceil(CFG.prior_median_tokens)


@pytest.mark.parametrize(
    ("tenant_samples", "population", "median"),
    [
        (0, Population.MODEL, (PRIOR_MEDIAN + 1000) // 2),  # voters: the prior and "other"
        (19, Population.MODEL, (PRIOR_MEDIAN + 1000) // 2),  # acme too few to vote yet
        (20, Population.PRIOR, PRIOR_MEDIAN),  # acme votes: 10 < prior < 1000
        (50, Population.TENANT, 10),
    ],
    ids=["no-tenant-data", "too-few-to-vote", "votes-not-trusted", "tenant-at-threshold"],
)
def test_tenant_population_needs_enough_samples(
    tenant_samples: int, population: Population, median: int
) -> None:
    # Another tenant writes essays (1000 tokens); acme writes one-liners (10 tokens).
    p = OutputLengthPredictor(CFG)
    for _ in range(500):
        p.observe("m", "other", 1000)
    for _ in range(tenant_samples):
        p.observe("m", "acme", 10)
    est = p.predict("m", "acme", 4096, 0.5)
    assert (est.population, est.tokens) == (population, median)


@pytest.mark.parametrize("flood", [1, 8000], ids=["one-token-answers", "longest-answers"])
def test_one_tenant_cannot_set_another_tenants_prediction(flood: int) -> None:
    """A tenant flooding the model with outputs of one length moves a newcomer's prediction (and
    its expected remainder) only as one vote among the model's populations."""
    p = OutputLengthPredictor(CFG)
    for tenant, length in (("a", 180), ("b", 200), ("c", 220)):
        for _ in range(CFG.min_model_samples):
            p.observe("m", tenant, length)
    # Voters by median: a 180, b 200, c 220 and the prior 256: the mean of the middle two.
    honest = p.predict("m", "newcomer", 4096, 0.5).tokens
    assert honest == 210
    honest_rest = p.expected_remaining("m", "newcomer", 0)
    for _ in range(5000):
        p.observe("m", "attacker", flood)
    # With the attacker's vote at either end, b or c alone is the middle.
    after = p.predict("m", "newcomer", 4096, 0.5)
    assert after.population == Population.MODEL
    assert after.tokens in (200, 220)
    assert p.expected_remaining("m", "newcomer", 0) == pytest.approx(honest_rest, rel=0.2)
    # The attacker's own predictions are its own.
    assert p.predict("m", "attacker", 10_000, 0.5).tokens == flood


def test_a_lone_tenant_moves_a_newcomer_at_most_halfway_from_the_prior() -> None:
    p = OutputLengthPredictor(CFG)
    for _ in range(2000):
        p.observe("m", "attacker", 8000)
    est = p.predict("m", "newcomer", 100_000, 0.5)
    assert est.tokens == (PRIOR_MEDIAN + 8000) // 2


@pytest.mark.parametrize(
    ("model_samples", "quantile", "max_tokens"),
    [(0, 0.5, 4096), (19, 0.5, 4096), (0, 0.9, 4096), (0, 0.9, 100)],
    ids=["no-data", "too-few-model-samples", "prior-p90", "prior-capped"],
)
def test_prior_when_the_model_has_too_little_data(
    model_samples: int, quantile: float, max_tokens: int
) -> None:
    est = predictor_with([7] * model_samples).predict("m", None, max_tokens, quantile)
    expected = math.ceil(CFG.prior_median_tokens * math.exp(CFG.prior_sigma * NormalDist().inv_cdf(quantile)))
    assert (est.population, est.samples) == (Population.PRIOR, 0)
    assert est.tokens == min(expected, max_tokens)
    assert est.capped == (expected > max_tokens)


def test_window_keeps_only_recent_lengths() -> None:
    p = OutputLengthPredictor(OutputLengthConfig(window=100, min_model_samples=20, resort_every=1))
    for n in range(1, 1001):
        p.observe("m", None, n)
    est = p.predict("m", None, 4096, 0.5)
    assert est.samples == 100
    assert est.tokens == 951  # median of 901..1000


def test_sorted_copy_refreshes_after_resort_every_observations() -> None:
    p = OutputLengthPredictor(OutputLengthConfig(min_model_samples=1, resort_every=10))
    for _ in range(20):
        p.observe("m", None, 100)
    assert p.predict("m", None, 4096, 0.5).tokens == 100
    for _ in range(40):
        p.observe("m", None, 500)
    assert p.predict("m", None, 4096, 0.5).tokens == 500


def test_models_are_separate_populations() -> None:
    p = OutputLengthPredictor(CFG)
    for _ in range(30):
        p.observe("chat", None, 300)
        p.observe("code", None, 900)
    assert p.predict("chat", None, 4096).tokens == 300
    assert p.predict("code", None, 4096).tokens == 900
    assert (p.samples("chat"), p.samples("chat", "nobody")) == (30, 0)


def test_population_count_is_bounded() -> None:
    p = OutputLengthPredictor(OutputLengthConfig(max_populations=3))
    for i in range(10):
        p.observe(f"m{i}", None, 5)
    assert sum(p.samples(f"m{i}") > 0 for i in range(10)) == 3


def test_many_tenants_keep_the_least_recently_taught_out() -> None:
    p = OutputLengthPredictor(OutputLengthConfig(max_populations=100, min_model_samples=1))
    p.observe("m", "regular", 7)
    for i in range(10_000):
        p.observe("m", f"tenant-{i}", 5)
        if i % 50 == 0:
            p.observe("m", "regular", 7)  # still taught: kept
    assert p.populations() == 100
    assert p.samples("m", "regular") > 0
    assert p.samples("m", "tenant-0") == 0


@pytest.mark.parametrize(
    ("generated", "max_tokens", "expected"),
    [
        (0, None, 49.5),  # mean of 1..100 is 50.5, minus the 0 generated... of those above 0
        (50, None, 25.5),  # lengths it can still end with: 51..100, mean 75.5
        (50, 60, 10.0),  # the cap leaves 10
        (99, None, 1.0),  # only 100 is left: one more token
        (500, None, None),  # longer than anything seen: the prior's conditional mean
    ],
    ids=["fresh", "half-way", "capped", "last-token", "beyond-the-data"],
)
def test_expected_remaining_is_conditional_on_what_was_generated(
    generated: int, max_tokens: int | None, expected: float | None
) -> None:
    p = predictor_with(list(range(1, 101)))
    got = p.expected_remaining("m", None, generated, max_tokens)
    if expected is not None:
        assert got == pytest.approx(expected + (1.0 if generated == 0 else 0.0))
    else:
        assert got > 1.0  # a lognormal tail still has somewhere to go


def test_expected_remaining_without_data_uses_the_prior() -> None:
    p = OutputLengthPredictor(CFG)
    fresh, later = p.expected_remaining("m", None, 0), p.expected_remaining("m", None, 300)
    # Lognormal prior (median 256, sigma 1): mean exp(mu + 1/2) ~ 422 from scratch.
    assert fresh == pytest.approx(CFG.prior_median_tokens * math.exp(0.5), rel=1e-6)
    assert later > 1.0


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda p: p.predict("m", None, 100, 1.5), "quantile"),
        (lambda p: p.predict("m", None, 0), "max_tokens"),
        (lambda p: p.observe("m", None, -1), "output_tokens"),
        (lambda p: p.expected_remaining("m", None, -1), "generated"),
    ],
    ids=["quantile-above-one", "zero-max-tokens", "negative-length", "negative-generated"],
)
def test_bad_arguments_raise(call: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call(OutputLengthPredictor())  # type: ignore[operator]


@pytest.mark.parametrize("samples", [0, 100], ids=["prior", "data"])
def test_expected_remaining_many_matches_one_by_one(samples: int) -> None:
    p = predictor_with(list(range(1, samples + 1)))
    generated, caps = [0, 5, 50, 99, 300], [None, 20, None, 1000, None]
    many = p.expected_remaining_many("m", None, generated, caps)
    one = [p.expected_remaining("m", None, g, c) for g, c in zip(generated, caps, strict=True)]
    assert many == pytest.approx(one)


def _answers(p: OutputLengthPredictor) -> list[object]:
    """Every answer a caller could have remembered: predictions and expected remainders for
    each population, cap and progress in a small grid."""
    out: list[object] = []
    for model in ("m0", "m1"):
        for tenant in (None, "t0", "t1"):
            for cap in (1, 7, 400):
                out.append(p.predict(model, tenant, cap, 0.5).tokens)
            out.append(
                p.expected_remaining_many(model, tenant, [0, 3, 9, 40, 300], [None, 5, None, 64, None])
            )
    return out


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 5),
    st.integers(1, 6),
    st.integers(1, 4),
    st.integers(2, 3),
    st.lists(
        st.tuples(
            st.sampled_from(["m0", "m1", "m2"]), st.sampled_from([None, "t0", "t1"]), st.integers(0, 500)
        ),
        max_size=80,
    ),
)
def test_observe_says_when_an_answer_may_change(
    resort_every: int,
    min_tenant: int,
    min_model: int,
    max_populations: int,
    seen: list[tuple[str, str | None, int]],
) -> None:
    """``observe`` returning False promises that every answer stays as it was (what lets
    ``PredictionService`` keep its memos): checked against the whole grid after each one, with
    small windows, thresholds and population bounds so that every case occurs."""
    config = OutputLengthConfig(
        window=8,
        min_tenant_samples=min_tenant,
        min_model_samples=min_model,
        resort_every=resort_every,
        max_populations=max_populations,
    )
    p = OutputLengthPredictor(config)
    before = _answers(p)
    for model, tenant, tokens in seen:
        changed = p.observe(model, tenant, tokens)
        after = _answers(p)
        if not changed:
            assert after == before
        before = after
