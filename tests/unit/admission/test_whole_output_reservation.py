"""A response that cannot be stopped part-way (not streamed) of a tenant with a token bucket
reserves its whole output cap, so its budget is a hard cap too (docs/tenants.md, "Hard caps").

Virtual time throughout: the gateway's in-memory limiter on the test's clock
(``replay.budget.MemoryBudget``), the engine predicting 200 output tokens (``Predictions``), a
replica context of ``MAX_LEN``, weights 1 : 2 (prompt : output), a bucket of 1,000.
"""

from __future__ import annotations

import random

import pytest

from gateway.admission.budget import BudgetRefused, bucket_output_cap, request_cost
from gateway.admission.engine import AdmissionEngine
from gateway.admission.fairness import TokenWeights
from gateway.admission.results import Ending, Submitted
from gateway.limits.base import TenantLimits
from gateway.tenants.pricing import DEFAULT_WEIGHTS
from tests.unit.admission.fleet import MAX_LEN
from tests.unit.admission.test_budget_hard_caps import (
    LIMITS,
    PROMPT,
    SETTINGS,
    engine_and_budget,
    level,
    sized,
)
from tests.unit.admission.test_policies import Fleet, Predictions, new_entry

CAPACITY = 1000.0


@pytest.mark.parametrize(
    ("prompt", "choices", "context", "cap"),
    [
        pytest.param(100, 1, None, 450, id="capacity-less-prompt-over-the-output-weight"),
        pytest.param(100, 2, None, 225, id="two-choices-share-it"),
        pytest.param(101, 1, None, 449, id="rounded-down"),
        pytest.param(100, 1, 300, 300, id="at-most-the-context-left"),
        pytest.param(999, 1, None, 1, id="at-least-one-token"),
        pytest.param(5000, 1, None, 1, id="a-prompt-over-the-bucket"),
    ],
)
def test_the_cap_is_the_largest_output_the_bucket_holds(
    prompt: int, choices: int, context: int | None, cap: int
) -> None:
    assert bucket_output_cap(DEFAULT_WEIGHTS, prompt, choices, CAPACITY, context) == cap


def test_the_cap_holds_under_a_context_weight() -> None:
    # GPU-time weighting: every output token also pays for the context it reads.
    weights = TokenWeights(input=1.0, output=2.0, context=0.01)
    cap = bucket_output_cap(weights, 100, 1, CAPACITY, None)

    def cost(output: int) -> float:
        return request_cost(weights, 100, output, 1)

    assert cost(cap) <= CAPACITY < cost(cap + 1)


@pytest.mark.parametrize(
    ("capacity", "fields", "max_tokens", "output", "predicted"),
    [
        pytest.param(None, {"max_tokens": 300}, 300, 200, 200, id="streamed-the-prediction"),
        pytest.param(CAPACITY, {"max_tokens": 300}, 300, 300, 200, id="whole-max_tokens"),
        pytest.param(CAPACITY, {"max_tokens": 300, "choices": 2}, 300, 600, 200, id="whole-max_tokens-n2"),
        pytest.param(CAPACITY, {"max_tokens": 30}, 30, 30, 200, id="a-cap-under-the-prediction"),
        pytest.param(CAPACITY, {"max_tokens": None}, 450, 450, 200, id="no-max_tokens-the-bucket-cap"),
        pytest.param(CAPACITY, {"max_tokens": None, "choices": 2}, 225, 450, 200, id="no-max_tokens-n2"),
        pytest.param(
            CAPACITY, {"max_tokens": None, "ignore_eos": True}, 450, 450, 450, id="no-max_tokens-ignore_eos"
        ),
        pytest.param(
            CAPACITY, {"max_tokens": None, "min_tokens": 600}, 600, 600, 600, id="min_tokens-over-the-cap"
        ),
        pytest.param(
            10.0**9, {"max_tokens": None}, MAX_LEN - PROMPT, MAX_LEN - PROMPT, 200, id="the-context-left"
        ),
    ],
)
def test_a_response_that_cannot_be_stopped_reserves_its_whole_cap(
    capacity: float | None, fields: dict[str, object], max_tokens: int, output: int, predicted: int
) -> None:
    engine, _ = engine_and_budget()
    req = sized(engine, capacity, **fields)
    assert req.max_tokens == max_tokens
    assert engine.budget_cost(req) == pytest.approx(PROMPT + 2 * output)
    # Admission still forecasts the prediction: only the budget holds the whole cap.
    assert req.expected_output_tokens == pytest.approx(predicted)


def test_without_a_budget_nothing_is_capped() -> None:
    engine = AdmissionEngine(
        SETTINGS, Fleet(["r0"]), Predictions(), rng=random.Random(5), new_entry=new_entry
    )
    req = sized(engine, CAPACITY, max_tokens=None)
    assert req.max_tokens is None
    assert not req.reserve_whole_output


def test_the_bucket_holds_whole_responses_and_settles_to_usage() -> None:
    engine, budget = engine_and_budget()
    first = engine.submit(sized(engine, CAPACITY, max_tokens=None), "m", 10.0, streamed=False)
    assert isinstance(first, Submitted)
    assert level(budget, 10.0) == pytest.approx(0.0)  # 100 + 2 x 450: the whole bucket
    # The next one waits for the bucket: the two could never overdraw it together.
    second = engine.submit(sized(engine, CAPACITY, max_tokens=300), "m", 10.0, streamed=False)
    assert isinstance(second, BudgetRefused)
    assert second.retry_after is not None
    # The answer used 40 tokens: the unused 410 come back at the settle.
    engine.finish(first.key, Ending(produced_tokens=40, prompt_tokens=PROMPT, learn=False), 10.0)
    assert level(budget, 10.0) == pytest.approx(CAPACITY - (PROMPT + 2 * 40))
    third = engine.submit(sized(engine, CAPACITY, max_tokens=300), "m", 10.0, streamed=False)
    assert isinstance(third, Submitted)


def test_more_than_the_bucket_can_hold_is_refused_for_good() -> None:
    engine, _ = engine_and_budget()
    refused = engine.submit(
        sized(engine, CAPACITY, max_tokens=None, min_tokens=600), "m", 0.0, streamed=False
    )
    assert isinstance(refused, BudgetRefused)
    assert refused.answer.oversize
    assert refused.retry_after is None


def test_a_larger_burst_sets_a_larger_cap() -> None:
    engine, _ = engine_and_budget(TenantLimits(tokens_per_minute=6000.0, token_burst=3000.0))
    assert LIMITS.token_capacity == CAPACITY
    assert sized(engine, 3000.0, max_tokens=None).max_tokens == 1450
