"""OverLimitCache: known over-limit tenants answered in-process until their retry time."""

from __future__ import annotations

import pytest

from gateway.limits.base import LimiterStats, Reservation, TenantLimits
from gateway.limits.cache import OverLimitCache
from gateway.limits.memory import MemoryLimiter
from tests.unit.limits.fakes import FakeClock, FlakyStorage

TOKENS = TenantLimits(tokens_per_minute=60, token_burst=100)  # 1 token/s, capacity 100


class Harness:
    """A cache over a real MemoryLimiter; ``storage.calls`` counts what reached "storage"."""

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.stats = LimiterStats()
        self.storage = FlakyStorage(MemoryLimiter(clock=self.clock, stats=self.stats, name="redis"))
        self.cache = OverLimitCache(self.storage, clock=self.clock, stats=self.stats)
        self._n = 0

    async def reserve(self, cost: float, limits: TenantLimits = TOKENS, tenant: str = "acme") -> Reservation:
        self._n += 1
        return await self.cache.reserve(tenant, cost_tokens=cost, limits=limits, request_id=f"r{self._n}")


@pytest.fixture
async def exhausted() -> Harness:
    """100 of 100 tokens taken, then one 50-token reserve refused (retry in 50 s)."""
    h = Harness()
    assert (await h.reserve(100)).allowed
    refused = await h.reserve(50)
    assert refused.retry_after_s == pytest.approx(50)
    assert not refused.from_cache
    return h


@pytest.mark.parametrize(
    ("after_s", "cost", "from_cache", "allowed", "retry_after_s"),
    [
        pytest.param(0, 50, True, False, 50, id="same-cost-at-once"),
        pytest.param(20, 50, True, False, 30, id="same-cost-later-exact-retry"),
        pytest.param(20, 80, True, False, 60, id="bigger-cost-projected"),
        pytest.param(20, 10, False, True, 0, id="small-cost-that-fits-goes-to-storage"),
        pytest.param(50, 50, False, True, 0, id="entry-expires-at-retry-time"),
    ],
)
async def test_rejections_are_answered_locally_until_their_retry_time(
    exhausted: Harness, after_s: float, cost: float, from_cache: bool, allowed: bool, retry_after_s: float
) -> None:
    calls = exhausted.storage.calls
    exhausted.clock.advance(after_s)
    r = await exhausted.reserve(cost)
    assert (r.from_cache, r.allowed) == (from_cache, allowed)
    assert r.retry_after_s == pytest.approx(retry_after_s)
    assert exhausted.storage.calls == calls + (0 if from_cache else 1)


async def test_local_answer_carries_the_headers(exhausted: Harness) -> None:
    exhausted.clock.advance(20)
    r = await exhausted.reserve(50)
    assert r.tokens is not None
    assert r.tokens.remaining == pytest.approx(20)
    assert r.tokens.reset_after_s == pytest.approx(80)
    assert r.blocked_by == {"tokens"}
    assert r.origin == "redis"
    assert exhausted.stats.local_cache_rejections_total == 1
    assert exhausted.stats.rejected_total == {"tokens": 2}


async def test_a_flood_reaches_storage_once(exhausted: Harness) -> None:
    calls = exhausted.storage.calls
    for _ in range(1000):
        assert not (await exhausted.reserve(50)).allowed
    assert exhausted.storage.calls == calls


async def test_other_tenants_are_not_affected(exhausted: Harness) -> None:
    assert (await exhausted.reserve(50, tenant="other")).allowed


async def test_changed_limits_drop_the_entry(exhausted: Harness) -> None:
    bigger = TenantLimits(tokens_per_minute=60, token_burst=200)
    r = await exhausted.reserve(50, limits=bigger)
    assert not r.from_cache
    assert r.allowed


async def test_a_refund_drops_the_token_entry() -> None:
    h = Harness()
    held = await h.reserve(100)
    assert not (await h.reserve(50)).allowed
    await h.cache.settle(held, actual_cost_tokens=20)  # refunds 80
    r = await h.reserve(50)
    assert not r.from_cache
    assert r.allowed


async def test_request_limit_rejections_are_cached_too() -> None:
    h = Harness()
    limits = TenantLimits(requests_per_minute=1)  # capacity 1, one per 60 s
    assert (await h.reserve(1, limits)).allowed
    assert not (await h.reserve(1, limits)).from_cache
    h.clock.advance(30)
    r = await h.reserve(1, limits)
    assert r.from_cache
    assert r.blocked_by == {"requests"}
    assert r.retry_after_s == pytest.approx(30)


@pytest.mark.parametrize(
    ("limits", "cost"),
    [
        pytest.param(TenantLimits(max_concurrent=1), 1, id="concurrency-frees-any-time"),
        pytest.param(TenantLimits(tokens_per_minute=60, token_burst=10), 11, id="oversize-is-not-a-wait"),
    ],
)
async def test_rejections_that_are_not_waits_are_never_cached(limits: TenantLimits, cost: float) -> None:
    h = Harness()
    if limits.max_concurrent:
        assert (await h.reserve(cost, limits)).allowed
    for _ in range(3):
        r = await h.reserve(cost, limits)
        assert not r.allowed
        assert not r.from_cache
    assert h.cache.entries() == 0


async def test_an_allowed_reserve_forgets_the_tenant() -> None:
    h = Harness()
    await h.reserve(100)
    await h.reserve(50)
    assert h.cache.entries() == 1
    h.clock.advance(10)
    assert (await h.reserve(5)).allowed  # fits the projection: asks storage, which allows
    assert h.cache.entries() == 0


async def test_close_closes_the_inner_limiter() -> None:
    h = Harness()
    await h.cache.close()
    assert h.storage.closed
