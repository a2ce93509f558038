"""The limiter contract, run unchanged against every backend (see conftest.py).

Numbers are checked within bounds that allow for the refill that really happened
(``rate * backend.elapsed()``), which is exactly zero on the memory backend's fake clock.
Tests whose name ends in ``_everywhere`` also run against a three-master Redis Cluster.
"""

from __future__ import annotations

import asyncio
import math

import pytest

from gateway.limits.base import BucketState, Reservation, TenantLimits
from tests.contract.limits.conftest import Backend

EPS = 1e-6
TENANT = "acme"


def between(value: float, low: float, high: float) -> None:
    assert low - EPS <= value <= high + EPS, f"{value} not in [{low}, {high}]"


def bucket(state: BucketState | None) -> BucketState:
    assert state is not None, "expected a limited bucket"
    return state


async def reserve(backend: Backend, cost: float, limits: TenantLimits, request_id: str) -> Reservation:
    return await backend.limiter.reserve(TENANT, cost_tokens=cost, limits=limits, request_id=request_id)


async def test_allows_within_limits_and_reports_every_header_value_everywhere(
    backend_or_cluster: Backend,
) -> None:
    backend = backend_or_cluster
    limits = TenantLimits(tokens_per_minute=600, requests_per_minute=60, max_concurrent=5)
    r = await reserve(backend, 100, limits, "r1")
    assert r.allowed
    assert r.blocked_by == frozenset()
    assert not r.oversize
    assert r.retry_after_s == 0.0
    assert r.retryable
    assert not r.from_cache
    assert (r.tenant, r.request_id, r.cost_tokens, r.limits) == (TENANT, "r1", 100, limits)
    tokens, requests = bucket(r.tokens), bucket(r.requests)
    assert (tokens.limit_per_minute, tokens.capacity) == (600, 600)
    between(tokens.remaining, 500, 500 + 10 * backend.elapsed())
    between(tokens.reset_after_s, 10 - backend.elapsed(), 10)
    assert tokens.retry_after_s == 0.0
    assert (requests.limit_per_minute, requests.capacity) == (60, 60)
    between(requests.remaining, 59, 59 + backend.elapsed())
    between(requests.reset_after_s, 1 - backend.elapsed(), 1)
    assert r.concurrency is not None
    assert (r.concurrency.limit, r.concurrency.in_flight) == (5, 1)
    assert await backend.limiter.in_flight(TENANT) == 1


async def test_unlimited_tenant_is_always_allowed(backend: Backend) -> None:
    r = await reserve(backend, 1e9, TenantLimits(), "r1")
    assert r.allowed
    assert r.retry_after_s == 0.0
    assert (r.tokens, r.requests, r.concurrency) == (None, None, None)
    assert await backend.limiter.in_flight(TENANT) == 1


async def test_exhausted_tokens_give_exact_retry_after_everywhere(backend_or_cluster: Backend) -> None:
    backend = backend_or_cluster
    limits = TenantLimits(tokens_per_minute=60, requests_per_minute=60)  # 1 token/s, 1 request/s
    assert (await reserve(backend, 60, limits, "r1")).allowed
    r = await reserve(backend, 30, limits, "r2")
    waited = backend.elapsed()  # an upper bound on the refill time between the two scripts
    assert not r.allowed
    assert r.blocked_by == {"tokens"}
    assert r.retryable
    assert not r.oversize
    tokens = bucket(r.tokens)
    between(tokens.remaining, 0, waited)
    between(r.retry_after_s or -1, 30 - waited, 30)
    assert tokens.retry_after_s == r.retry_after_s
    between(tokens.reset_after_s, 60 - waited, 60)
    # A refused reservation takes nothing: the request bucket still shows only r1.
    between(bucket(r.requests).remaining, 59, 59 + backend.elapsed())
    assert bucket(r.requests).retry_after_s == 0.0


async def test_retry_after_is_when_the_cost_fits(backend: Backend) -> None:
    limits = TenantLimits(tokens_per_minute=6000, token_burst=100)  # 100 tokens/s: empty to full in 1 s
    assert (await reserve(backend, 100, limits, "r1")).allowed
    refused = await reserve(backend, 100, limits, "r2")
    assert not refused.allowed
    assert refused.retry_after_s is not None
    between(refused.retry_after_s, 1.0 - backend.elapsed(), 1.0)
    if backend.exact:
        await backend.advance(refused.retry_after_s - 0.001)
        assert not (await reserve(backend, 100, limits, "r3")).allowed
    await backend.advance(refused.retry_after_s + 0.01)
    assert (await reserve(backend, 100, limits, "r4")).allowed


async def test_bucket_refills_over_time_up_to_capacity(backend: Backend) -> None:
    limits = TenantLimits(tokens_per_minute=60_000, token_burst=100)  # 1000 tokens/s
    assert (await reserve(backend, 100, limits, "r1")).allowed
    await backend.advance(0.2)  # refills 200 tokens, capped at 100
    r = await reserve(backend, 100, limits, "r2")
    assert r.allowed
    between(bucket(r.tokens).remaining, 0, 1000 * backend.elapsed())


async def test_requests_per_minute_limit(backend: Backend) -> None:
    limits = TenantLimits(requests_per_minute=2)  # one request per 30 s, burst 2
    assert (await reserve(backend, 1, limits, "r1")).allowed
    assert (await reserve(backend, 1, limits, "r2")).allowed
    r = await reserve(backend, 1, limits, "r3")
    assert not r.allowed
    assert r.blocked_by == {"requests"}
    assert r.tokens is None
    requests = bucket(r.requests)
    assert (requests.limit_per_minute, requests.capacity) == (2, 2)
    between(r.retry_after_s or -1, 30 - backend.elapsed(), 30)
    between(requests.reset_after_s, 60 - backend.elapsed(), 60)
    if backend.exact:
        await backend.advance(30)
        assert (await reserve(backend, 1, limits, "r4")).allowed


async def test_concurrency_limit_frees_a_slot_on_settle_everywhere(backend_or_cluster: Backend) -> None:
    backend = backend_or_cluster
    limits = TenantLimits(max_concurrent=2)
    first = await reserve(backend, 1, limits, "r1")
    assert first.allowed
    assert (await reserve(backend, 1, limits, "r2")).allowed
    r = await reserve(backend, 1, limits, "r3")
    assert not r.allowed
    assert r.blocked_by == {"concurrency"}
    assert r.retry_after_s is None, "the time until a slot frees is unknown"
    assert r.retryable, "but a slot will free"
    assert r.concurrency is not None
    assert (r.concurrency.limit, r.concurrency.in_flight) == (2, 2)
    await backend.limiter.settle(first, actual_cost_tokens=1)
    assert await backend.limiter.in_flight(TENANT) == 1
    assert (await reserve(backend, 1, limits, "r4")).allowed


async def test_settle_refunds_unused_tokens(backend: Backend) -> None:
    limits = TenantLimits(tokens_per_minute=60, token_burst=1000)
    r = await reserve(backend, 1000, limits, "r1")
    assert r.allowed
    await backend.limiter.settle(r, actual_cost_tokens=400)
    after = await reserve(backend, 1, limits, "r2")
    between(bucket(after.tokens).remaining, 599, 599 + backend.elapsed())


async def test_settle_charges_extra_tokens_into_debt(backend: Backend) -> None:
    limits = TenantLimits(tokens_per_minute=60, token_burst=100)  # 1 token/s
    r = await reserve(backend, 100, limits, "r1")
    await backend.limiter.settle(r, actual_cost_tokens=250)
    refused = await reserve(backend, 1, limits, "r2")
    assert not refused.allowed
    assert refused.blocked_by == {"tokens"}
    tokens = bucket(refused.tokens)
    between(tokens.remaining, -150, -150 + backend.elapsed())
    between(refused.retry_after_s or -1, 151 - backend.elapsed(), 151)
    between(tokens.reset_after_s, 250 - backend.elapsed(), 250)


async def test_refund_never_fills_past_capacity(backend: Backend) -> None:
    limits = TenantLimits(tokens_per_minute=60, token_burst=100)
    r = await reserve(backend, 10, limits, "r1")
    await backend.limiter.settle(r, actual_cost_tokens=0)
    after = await reserve(backend, 0, limits, "r2")
    between(bucket(after.tokens).remaining, 100, 100)


async def test_every_reservation_settles_exactly_once_everywhere(backend_or_cluster: Backend) -> None:
    backend = backend_or_cluster
    limits = TenantLimits(tokens_per_minute=60, token_burst=1000, max_concurrent=50)
    reservations = [await reserve(backend, 10, limits, f"r{i}") for i in range(20)]
    assert all(r.allowed for r in reservations)
    # Settle each twice, concurrently: the second settle of each request id must change nothing.
    await asyncio.gather(
        *(backend.limiter.settle(r, actual_cost_tokens=5) for r in reservations for _ in range(2))
    )
    assert (backend.stats.settles_total, backend.stats.settles_noop_total) == (20, 20)
    assert await backend.limiter.in_flight(TENANT) == 0
    after = await reserve(backend, 1, limits, "last")
    # 200 taken, 100 refunded once (not twice), 1 more taken.
    between(bucket(after.tokens).remaining, 899, 899 + backend.elapsed())


async def test_settling_a_refused_reservation_is_a_noop(backend: Backend) -> None:
    limits = TenantLimits(tokens_per_minute=60, token_burst=100)
    assert (await reserve(backend, 100, limits, "r1")).allowed
    refused = await reserve(backend, 50, limits, "r2")
    await backend.limiter.settle(refused, actual_cost_tokens=0)
    assert backend.stats.settles_noop_total == 1
    assert backend.stats.settles_total == 0
    still = await reserve(backend, 50, limits, "r3")
    assert not still.allowed


@pytest.mark.parametrize(
    ("limits", "cost"),
    [
        pytest.param(TenantLimits(tokens_per_minute=600, token_burst=100), 101, id="above-burst"),
        pytest.param(TenantLimits(tokens_per_minute=600), 600.5, id="above-one-minute-default-burst"),
    ],
)
async def test_oversize_cost_is_never_retryable_everywhere(
    backend_or_cluster: Backend, limits: TenantLimits, cost: float
) -> None:
    backend = backend_or_cluster
    r = await reserve(backend, cost, limits, "big")
    assert not r.allowed
    assert r.oversize
    assert not r.retryable
    assert r.retry_after_s is None
    assert r.blocked_by == {"tokens"}
    assert bucket(r.tokens).retry_after_s == math.inf
    assert backend.stats.rejected_total == {"oversize": 1}
    # Nothing was taken: a full bucket's worth still fits.
    assert (await reserve(backend, bucket(r.tokens).capacity, limits, "fits")).allowed


@pytest.mark.parametrize(
    ("limits", "cost", "expected_allowed"),
    [
        # Refill is under one token (or request) per minute, so no test run can add a unit.
        pytest.param(TenantLimits(tokens_per_minute=1, token_burst=1000), 7, 142, id="tokens"),
        pytest.param(TenantLimits(requests_per_minute=1, request_burst=50), 1, 50, id="requests"),
        pytest.param(TenantLimits(max_concurrent=10), 1, 10, id="concurrency"),
    ],
)
async def test_concurrent_reserves_never_exceed_capacity_everywhere(
    backend_or_cluster: Backend, limits: TenantLimits, cost: float, expected_allowed: int
) -> None:
    backend = backend_or_cluster
    results = await asyncio.gather(*(reserve(backend, cost, limits, f"r{i}") for i in range(200)))
    assert sum(r.allowed for r in results) == expected_allowed
    assert len({r.request_id for r in results}) == 200


async def test_a_repeated_reserve_is_a_retry_and_takes_nothing_more(backend: Backend) -> None:
    limits = TenantLimits(tokens_per_minute=60, token_burst=100, max_concurrent=5)
    first = await reserve(backend, 10, limits, "same")
    again = await reserve(backend, 10, limits, "same")
    assert again.allowed
    between(bucket(again.tokens).remaining, 90, 90 + backend.elapsed())
    assert await backend.limiter.in_flight(TENANT) == 1
    await backend.limiter.settle(first, actual_cost_tokens=10)
    await backend.limiter.settle(again, actual_cost_tokens=10)
    assert (backend.stats.settles_total, backend.stats.settles_noop_total) == (1, 1)
    # Once settled, the id is free: a new reserve with it is a new reservation.
    third = await reserve(backend, 10, limits, "same")
    between(bucket(third.tokens).remaining, 80, 80 + backend.elapsed())


async def test_unsettled_lease_expires_and_a_late_settle_is_a_noop(backend: Backend) -> None:
    limiter = backend.new(lease_ttl_s=backend.short_lease_s)
    limits = TenantLimits(max_concurrent=1)
    crashed = await limiter.reserve(TENANT, cost_tokens=1, limits=limits, request_id="crashed")
    assert crashed.allowed
    refused = await limiter.reserve(TENANT, cost_tokens=1, limits=limits, request_id="r2")
    assert refused.blocked_by == {"concurrency"}
    await backend.advance(backend.short_lease_s * 1.5)
    assert await limiter.in_flight(TENANT) == 0
    assert (await limiter.reserve(TENANT, cost_tokens=1, limits=limits, request_id="r3")).allowed
    await limiter.settle(crashed, actual_cost_tokens=1)
    assert backend.stats.settles_noop_total == 1
    assert await limiter.in_flight(TENANT) == 1, "the late settle must not free r3's slot"


async def test_tenants_do_not_share_budgets(backend: Backend) -> None:
    limits = TenantLimits(tokens_per_minute=60, max_concurrent=1)
    assert (await backend.limiter.reserve("a", cost_tokens=60, limits=limits, request_id="x")).allowed
    assert (await backend.limiter.reserve("b", cost_tokens=60, limits=limits, request_id="x")).allowed
    assert not (await backend.limiter.reserve("a", cost_tokens=30, limits=limits, request_id="y")).allowed


@pytest.mark.parametrize(
    "cost",
    [pytest.param(-1.0, id="negative"), pytest.param(math.nan, id="nan"), pytest.param(math.inf, id="inf")],
)
async def test_invalid_cost_is_a_value_error(backend: Backend, cost: float) -> None:
    with pytest.raises(ValueError, match="cost_tokens"):
        await reserve(backend, cost, TenantLimits(tokens_per_minute=60), "r")
