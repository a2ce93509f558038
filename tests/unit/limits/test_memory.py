"""MemoryLimiter beyond the shared contract: its share of a fleet's budget, as a fail-open fallback."""

from __future__ import annotations

import pytest

from gateway.limits.base import TenantLimits
from gateway.limits.memory import MemoryLimiter
from tests.unit.limits.fakes import FakeClock

LIMITS = TenantLimits(tokens_per_minute=600, requests_per_minute=60, max_concurrent=10)


async def reserve_all(limiter: MemoryLimiter, cost: float, count: int, limits: TenantLimits = LIMITS) -> int:
    """How many of ``count`` reserves of ``cost`` are allowed, back to back."""
    results = [
        await limiter.reserve("acme", cost_tokens=cost, limits=limits, request_id=f"r{i}")
        for i in range(count)
    ]
    return sum(r.allowed for r in results)


@pytest.mark.parametrize(
    ("share", "cost", "expected_allowed"),
    [
        pytest.param(1.0, 100, 6, id="whole-budget-600-tokens"),
        pytest.param(0.5, 100, 3, id="half-300-tokens"),
        pytest.param(0.25, 50, 3, id="quarter-150-tokens"),
        pytest.param(0.5, 1, 5, id="half-of-10-concurrent"),
    ],
)
async def test_share_scales_each_budget(share: float, cost: float, expected_allowed: int) -> None:
    limiter = MemoryLimiter(share=share, clock=FakeClock())
    assert await reserve_all(limiter, cost, 20) == expected_allowed


async def test_share_reports_the_local_limits() -> None:
    r = await MemoryLimiter(share=0.5, clock=FakeClock()).reserve(
        "acme", cost_tokens=10, limits=LIMITS, request_id="r"
    )
    assert r.tokens is not None
    assert r.requests is not None
    assert r.concurrency is not None
    assert (r.tokens.limit_per_minute, r.requests.limit_per_minute, r.concurrency.limit) == (300, 30, 5)
    assert r.limits == LIMITS, "the tenant's own limits travel to settle unscaled"


async def test_cost_above_the_local_share_but_within_the_fleet_bucket_waits_for_a_full_bucket() -> None:
    clock = FakeClock()
    limiter = MemoryLimiter(share=0.25, clock=clock)  # local bucket 150 tokens at 2.5 tokens/s
    limits = TenantLimits(tokens_per_minute=600)
    first = await limiter.reserve("acme", cost_tokens=400, limits=limits, request_id="big1")
    assert first.allowed, "a full local bucket admits it, going into debt"
    assert first.tokens is not None
    assert first.tokens.remaining == pytest.approx(-250)
    second = await limiter.reserve("acme", cost_tokens=400, limits=limits, request_id="big2")
    assert not second.allowed
    assert second.retryable
    assert second.retry_after_s == pytest.approx(400 / 2.5), "until the local bucket is full again"
    clock.advance(160)
    assert (await limiter.reserve("acme", cost_tokens=400, limits=limits, request_id="big3")).allowed


async def test_oversize_is_judged_against_the_fleet_bucket() -> None:
    limiter = MemoryLimiter(share=0.25, clock=FakeClock())
    r = await limiter.reserve(
        "acme", cost_tokens=601, limits=TenantLimits(tokens_per_minute=600), request_id="r"
    )
    assert r.oversize
    assert not r.retryable


async def test_stats_count_each_answer_once() -> None:
    limiter = MemoryLimiter(clock=FakeClock())
    limits = TenantLimits(tokens_per_minute=60, max_concurrent=1)
    ok = await limiter.reserve("acme", cost_tokens=10, limits=limits, request_id="a")
    await limiter.reserve("acme", cost_tokens=10, limits=limits, request_id="b")  # concurrency
    await limiter.reserve("acme", cost_tokens=100, limits=limits, request_id="c")  # oversize
    await limiter.settle(ok, actual_cost_tokens=10)
    await limiter.settle(ok, actual_cost_tokens=10)
    stats = limiter.stats
    assert (stats.reserves_total, stats.allowed_total) == (3, 1)
    assert stats.rejected_total == {"concurrency": 1, "oversize": 1}
    assert (stats.settles_total, stats.settles_noop_total) == (1, 1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"share": 0.0}, "share must be in", id="zero-share"),
        pytest.param({"share": 1.5}, "share must be in", id="share-above-one"),
        pytest.param({"lease_ttl_s": 0.0}, "lease_ttl_s must be > 0", id="no-lease"),
    ],
)
def test_invalid_construction(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MemoryLimiter(**kwargs)  # type: ignore[arg-type]


async def test_negative_actual_cost_is_a_value_error() -> None:
    limiter = MemoryLimiter(clock=FakeClock())
    r = await limiter.reserve("acme", cost_tokens=1, limits=LIMITS, request_id="r")
    with pytest.raises(ValueError, match="actual_cost_tokens"):
        await limiter.settle(r, actual_cost_tokens=-1)
