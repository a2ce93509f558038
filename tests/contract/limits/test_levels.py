"""``levels``: a tenant's buckets read without side effects, on every backend (see conftest.py).

Reading must report what a reservation left, follow a settle's refund, show refill, and never
take, write or keep alive anything: reading a thousand times leaves the next reservation's
answer as it would have been.
"""

from __future__ import annotations

import pytest

from gateway.limits.base import BucketState, LevelReader, TenantLevels, TenantLimits
from tests.contract.limits.conftest import Backend

EPS = 1e-6
TENANT = "levels-tenant"
LIMITS = TenantLimits(tokens_per_minute=600, requests_per_minute=60, max_concurrent=5)


def bucket(state: BucketState | None) -> BucketState:
    assert state is not None, "expected a limited bucket"
    return state


async def levels(backend: Backend, limits: TenantLimits = LIMITS) -> TenantLevels:
    limiter = backend.limiter
    assert isinstance(limiter, LevelReader)
    return await limiter.levels(TENANT, limits)


async def test_an_unseen_tenant_is_full_and_idle_everywhere(backend_or_cluster: Backend) -> None:
    found = await levels(backend_or_cluster)
    assert bucket(found.tokens).remaining == pytest.approx(600)
    assert bucket(found.requests).remaining == pytest.approx(60)
    assert found.in_flight == 0
    assert found.limits == LIMITS
    unlimited = await levels(backend_or_cluster, TenantLimits())
    assert (unlimited.tokens, unlimited.requests, unlimited.in_flight) == (None, None, 0)


async def test_levels_follow_reserve_and_settle_without_taking_anything_everywhere(
    backend_or_cluster: Backend,
) -> None:
    backend = backend_or_cluster
    limiter = backend.limiter
    r = await limiter.reserve(TENANT, cost_tokens=200, limits=LIMITS, request_id="a")
    assert r.allowed
    for _ in range(50):
        found = await levels(backend)
    refill = 10 * backend.elapsed()
    tokens = bucket(found.tokens)
    assert 400 - EPS <= tokens.remaining <= 400 + refill + EPS
    assert tokens.capacity == 600
    assert 59 - EPS <= bucket(found.requests).remaining <= 59 + backend.elapsed() + EPS
    assert found.in_flight == 1
    # Reading took nothing: the next reservation sees the level the first one left (plus refill).
    r2 = await limiter.reserve(TENANT, cost_tokens=100, limits=LIMITS, request_id="b")
    assert 300 - EPS <= bucket(r2.tokens).remaining <= 300 + 10 * backend.elapsed() + EPS
    assert r2.concurrency is not None
    assert r2.concurrency.in_flight == 2
    await limiter.settle(r, actual_cost_tokens=50)  # a refund of 150
    await limiter.settle(r2, actual_cost_tokens=100)
    after = await levels(backend)
    assert after.in_flight == 0
    assert 450 - EPS <= bucket(after.tokens).remaining <= 450 + 10 * backend.elapsed() + EPS


async def test_levels_show_refill(backend: Backend) -> None:
    limiter = backend.limiter
    await limiter.reserve(TENANT, cost_tokens=600, limits=LIMITS, request_id="all")
    await backend.advance(1.0)
    tokens = bucket((await levels(backend)).tokens)
    assert 10 - EPS <= tokens.remaining <= 10 * backend.elapsed() + EPS
    assert tokens.reset_after_s == pytest.approx(60 - tokens.remaining / 10, abs=0.05)
