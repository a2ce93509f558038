"""The engine's tenant budget: reserved before the decision, refunded on a refusal, settled at the end.

The budget is the gateway's in-memory limiter on the test's clock (``replay.budget.MemoryBudget``),
so the bucket arithmetic is the real one. Weights are 1 : 2 (prompt : output); the engine predicts
200 output tokens (``Predictions``), capped by ``max_tokens``.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from gateway.admission.budget import BudgetRefused, request_cost
from gateway.admission.engine import AdmissionEngine
from gateway.admission.results import Ending, Saturated, Submitted, UnknownModel
from gateway.admission.retry_after import RefusalReason
from gateway.limits.base import Reservation, TenantLimits
from gateway.replicas.registry import LiveRequest
from gateway.tenants.pricing import DEFAULT_WEIGHTS
from replay.budget import MemoryBudget
from tests.unit.admission.test_policies import Fleet, Predictions, new_entry, policy_settings

#: One request at a time on the replica; the rest wait (or are refused when the queue is off).
CAP_ONE = policy_settings("concurrency_cap", concurrency_cap={"max_in_flight": 1, "queue_ttl_s": 30.0})
#: 6,000 weighted tokens a minute (100 a second), bucket of 1,000: a request of 100 prompt tokens
#: and 50 output tokens costs 100 + 2 x 50 = 200.
LIMITS = TenantLimits(tokens_per_minute=6000.0, token_burst=1000.0)
COST = 200.0


def engine_and_budget(limits: TenantLimits = LIMITS) -> tuple[AdmissionEngine, MemoryBudget]:
    budget = MemoryBudget({"acme": limits}, weights=DEFAULT_WEIGHTS)
    engine = AdmissionEngine(
        CAP_ONE, Fleet(["r0"]), Predictions(), rng=random.Random(5), new_entry=new_entry, budget=budget
    )
    return engine, budget


def submit(
    engine: AdmissionEngine, rid: str, now: float, tenant: str | None = "acme", max_tokens: int = 50
) -> Submitted | UnknownModel | Saturated | BudgetRefused:
    req = engine.request(
        rid,
        "m",
        prompt_tokens=100,
        max_tokens=max_tokens,
        request_class="interactive",
        arrival_s=now,
        tenant=tenant,
    )
    return engine.submit(req, "m", now)


def level(engine: AdmissionEngine, budget: MemoryBudget, now: float) -> float:
    """The tenant's token bucket now, read by a probe reservation that is refunded at once."""
    probe = engine.request(
        "probe", "m", prompt_tokens=1, max_tokens=1, request_class="interactive", arrival_s=now, tenant="acme"
    )
    answer = budget.reserve(probe, 0.0, now)
    assert isinstance(answer, Reservation)
    assert answer.tokens is not None
    budget.settle(answer, 0.0, now)
    return answer.tokens.remaining


def test_the_cost_is_the_prompt_and_the_capped_prediction_weighted() -> None:
    engine, _ = engine_and_budget()
    req = engine.request(
        "a", "m", prompt_tokens=100, max_tokens=50, request_class="interactive", arrival_s=0.0, tenant="acme"
    )
    assert engine.budget_cost(req) == COST
    anonymous = engine.request(
        "b", "m", prompt_tokens=100, max_tokens=50, request_class="interactive", arrival_s=0.0
    )
    assert engine.budget_cost(anonymous) is None


def test_a_tenant_over_budget_is_refused_after_the_buckets_refill() -> None:
    engine, budget = engine_and_budget(TenantLimits(tokens_per_minute=6000.0, token_burst=300.0))
    first = submit(engine, "a", 10.0)
    assert isinstance(first, Submitted)
    assert first.replica == "r0"
    refused = submit(engine, "b", 10.0)
    assert isinstance(refused, BudgetRefused)
    assert refused.reason is RefusalReason.RATE_LIMITED
    # 100 tokens left, 200 needed, 100 a second: back in 1 s, jittered up to half as much again.
    assert refused.retry_after is not None
    assert refused.retry_after.base_s == pytest.approx(1.0)
    assert 1.0 <= refused.retry_after.delay_s <= 1.5
    assert engine.queued() == 0
    assert budget.stats.rejected_total == {"tokens": 1}


def test_an_oversize_request_is_told_not_to_retry() -> None:
    engine, _ = engine_and_budget(TenantLimits(tokens_per_minute=6000.0, token_burst=150.0))
    refused = submit(engine, "a", 10.0)
    assert isinstance(refused, BudgetRefused)
    assert refused.answer.oversize
    assert refused.retry_after is None


def test_a_finished_request_settles_what_it_really_cost() -> None:
    engine, budget = engine_and_budget()
    sent = submit(engine, "a", 10.0)
    assert isinstance(sent, Submitted)
    assert sent.replica == "r0"
    assert level(engine, budget, 10.0) == pytest.approx(1000.0 - COST)
    engine.finish(sent.key, Ending(produced_tokens=10, prompt_tokens=120, learn=False), 10.0)
    # Charged 120 + 2 x 10 = 140 instead of 200: 60 back.
    assert level(engine, budget, 10.0) == pytest.approx(1000.0 - 140.0)
    assert budget.stats.settles_total == 3  # two probes and the request


@pytest.mark.parametrize(
    "how",
    [
        pytest.param("expired", id="expired_in_the_queue"),
        pytest.param("dropped", id="client_went_away_while_queued"),
        pytest.param("cleared", id="gateway_stopping"),
    ],
)
def test_a_request_that_never_runs_is_refunded(how: str) -> None:
    # A slow refill (1 weighted token a second), so that a refund shows over the queue's 30 s.
    engine, budget = engine_and_budget(TenantLimits(tokens_per_minute=60.0, token_burst=1000.0))
    first = submit(engine, "a", 10.0)
    waiting = submit(engine, "b", 10.0)
    assert isinstance(first, Submitted)
    assert isinstance(waiting, Submitted)
    assert waiting.queued
    assert level(engine, budget, 10.0) == pytest.approx(1000.0 - 2 * COST)
    if how == "expired":
        now = 45.0
        resolved = engine.reevaluate(now)
        assert [r.request_id for r in resolved] == ["b"]
        assert not resolved[0].decision.admits
    elif how == "dropped":
        now = 10.0
        assert engine.drop(waiting.key, now)
    else:
        now = 10.0
        assert engine.clear(now) == [waiting.key]
    # Only the running request's reservation is held; the rest is the refill since.
    assert level(engine, budget, now) == pytest.approx(1000.0 - COST + (now - 10.0))


def test_a_placement_the_replica_refused_keeps_its_budget_for_the_next() -> None:
    engine, budget = engine_and_budget()
    first = submit(engine, "a", 10.0)
    assert isinstance(first, Submitted)
    engine.replica_refused(first.key, 0.5, "overloaded", 10.0, placed_again=True)
    engine.finish(first.key, Ending(learn=False), 10.0)
    again = engine.request(
        "a", "m", prompt_tokens=100, max_tokens=50, request_class="interactive", arrival_s=10.0, tenant="acme"
    )
    assert engine.budget_cost(again) is None  # held already: nothing to fetch
    engine.submit(again, "m", 10.2)
    assert budget.stats.reserves_total == 1
    assert level(engine, budget, 10.2) == pytest.approx(1000.0 - COST + 20.0)  # 0.2 s of refill
    assert math.isfinite(level(engine, budget, 10.2))


@pytest.mark.parametrize(
    ("ending", "streamed", "charged"),
    [
        pytest.param(Ending(produced_tokens=4, prompt_tokens=90), 0, 90 + 2 * 4, id="usage"),
        pytest.param(Ending(), 0, 100, id="replica-error-prompt-only"),
        pytest.param(Ending(), 7, 100 + 2 * 7, id="cut-charges-the-tokens-seen"),
        pytest.param(Ending(answered=True), 0, COST, id="answer-without-usage-charges-the-reservation"),
        pytest.param(Ending(answered=True), 3, 100 + 2 * 3, id="tokens-seen-beat-the-reservation"),
        pytest.param(Ending(produced_tokens=0, answered=True), 0, 100, id="usage-of-nothing"),
    ],
)
def test_the_settle_charges_what_the_ending_says(ending: Ending, streamed: int, charged: float) -> None:
    """The prompt is the replica's count, else the estimate; the output its usage, else the tokens
    seen, else (output came, uncounted: ``answered``) the 50 reserved, else nothing."""
    engine, budget = engine_and_budget()
    sent = submit(engine, "a", 10.0)
    assert isinstance(sent, Submitted)
    assert isinstance(sent.entry, LiveRequest)
    sent.entry.tokens_streamed = streamed
    engine.finish(sent.key, dataclasses.replace(ending, learn=False), 10.0)
    assert level(engine, budget, 10.0) == pytest.approx(1000.0 - charged)


def test_each_choice_reserves_its_own_output() -> None:
    """``n`` choices decode ``n`` sequences: the reservation holds the capped prediction of each."""
    engine, _ = engine_and_budget()
    req = engine.request(
        "a",
        "m",
        prompt_tokens=100,
        max_tokens=50,
        request_class="interactive",
        arrival_s=0.0,
        tenant="acme",
        choices=3,
    )
    assert engine.budget_cost(req) == pytest.approx(request_cost(DEFAULT_WEIGHTS, 100, 150, 3))
    assert engine.budget_cost(req) == pytest.approx(100 + 2 * 150)
