"""``levels`` through the limiter stack: the over-limit cache and the failure policy.

Reading levels must not change how requests are limited: a failed read reports the local
fallback's levels and leaves storage marked up; while storage is marked down the fallback's
levels are read without calling storage.
"""

from __future__ import annotations

from gateway.limits.base import LevelReader, LimiterStats, TenantLimits
from gateway.limits.cache import OverLimitCache
from gateway.limits.failover import FailoverLimiter
from gateway.limits.memory import MemoryLimiter
from tests.unit.limits.fakes import FakeClock, FlakyStorage

LIMITS = TenantLimits(tokens_per_minute=600, max_concurrent=4)


def _stack() -> tuple[FailoverLimiter, FlakyStorage, FakeClock]:
    clock = FakeClock()
    stats = LimiterStats()
    storage = FlakyStorage(MemoryLimiter(clock=clock, stats=stats, name="redis"))
    fallback = MemoryLimiter(share=0.5, clock=clock, stats=stats, name="fallback")
    cache = OverLimitCache(storage, clock=clock, stats=stats)
    return FailoverLimiter(cache, fallback, clock=clock, stats=stats), storage, clock


async def test_levels_come_from_storage_through_the_cache() -> None:
    limiter, _storage, _clock = _stack()
    await limiter.reserve("t", cost_tokens=100, limits=LIMITS, request_id="a")
    assert isinstance(limiter, LevelReader)
    found = await limiter.levels("t", LIMITS)

    assert (found.origin, found.in_flight) == ("redis", 1)
    assert found.tokens is not None
    assert found.tokens.remaining == 500


async def test_a_failed_read_reports_the_fallback_and_leaves_storage_up() -> None:
    limiter, storage, _clock = _stack()
    storage.down = True
    found = await limiter.levels("t", LIMITS)

    assert found.origin == "fallback"
    assert found.tokens is not None
    assert found.tokens.capacity == 300  # the fallback's share of the budget
    assert not limiter.degraded
    assert limiter.stats.storage_errors_total == 0
    storage.down = False
    assert (await limiter.reserve("t", cost_tokens=1, limits=LIMITS, request_id="b")).origin == "redis"
    await limiter.close()
