"""FailoverLimiter: the storage failure policy, driven by a fake clock and a switchable storage."""

from __future__ import annotations

import asyncio
import logging

import pytest

from gateway.limits.base import LimiterStats, LimiterUnavailable, Reservation, TenantLimits
from gateway.limits.failover import FailoverLimiter, FailureMode, next_backoff
from gateway.limits.memory import MemoryLimiter
from tests.unit.limits.fakes import FakeClock, FlakyStorage

LIMITS = TenantLimits(tokens_per_minute=6000, max_concurrent=100)


class Harness:
    def __init__(self, mode: FailureMode = "fail_open") -> None:
        self.clock = FakeClock()
        self.stats = LimiterStats()
        self.storage = FlakyStorage(MemoryLimiter(clock=self.clock, stats=self.stats, name="redis"))
        self.fallback = MemoryLimiter(share=0.5, clock=self.clock, stats=self.stats, name="fallback")
        self.limiter = FailoverLimiter(
            self.storage,
            self.fallback,
            mode=mode,
            backoff_s=1.0,
            backoff_max_s=4.0,
            clock=self.clock,
            stats=self.stats,
        )
        self._n = 0

    async def reserve(self) -> Reservation:
        self._n += 1
        return await self.limiter.reserve("acme", cost_tokens=1, limits=LIMITS, request_id=f"r{self._n}")


def logs(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "sluice.limits"]


@pytest.mark.parametrize(
    ("current", "maximum", "expected"),
    [
        pytest.param(1.0, 30.0, 2.0, id="doubles"),
        pytest.param(20.0, 30.0, 30.0, id="capped"),
        pytest.param(30.0, 30.0, 30.0, id="stays-at-max"),
    ],
)
def test_next_backoff(current: float, maximum: float, expected: float) -> None:
    assert next_backoff(current, maximum) == expected


async def test_healthy_storage_answers_everything() -> None:
    h = Harness()
    r = await h.reserve()
    assert r.origin == "redis"
    await h.limiter.settle(r, actual_cost_tokens=1)
    assert (h.stats.storage_errors_total, h.stats.transitions_total, h.stats.degraded) == (0, 0, False)


async def test_fail_open_falls_back_logs_once_and_resumes(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="sluice.limits")
    h = Harness()
    h.storage.down = True
    outage = [await h.reserve() for _ in range(10)]
    assert all(r.allowed and r.origin == "fallback" for r in outage)
    assert h.storage.calls == 1, "storage is not asked again before the backoff has passed"
    assert (h.stats.degraded, h.stats.transitions_total, h.stats.fail_open_total) == (True, 1, 10)
    h.storage.down = False
    h.clock.advance(1.0)
    back = await h.reserve()
    assert back.origin == "redis"
    assert (h.stats.degraded, h.stats.transitions_total) == (False, 2)
    assert [level for level, _ in logs(caplog)] == [logging.WARNING, logging.INFO]
    assert "redis unavailable" in logs(caplog)[0][1]
    assert "available again after 1.0 s" in logs(caplog)[1][1]


async def test_probes_back_off_exponentially_up_to_the_maximum() -> None:
    h = Harness()
    h.storage.down = True
    await h.reserve()  # goes down: next probe after 1 s
    probe_times = []
    for _ in range(200):
        h.clock.advance(0.5)
        calls = h.storage.calls
        await h.reserve()
        if h.storage.calls > calls:
            probe_times.append(h.clock.now - 1000.0)
    gaps = [b - a for a, b in zip([0.0, *probe_times], probe_times, strict=False)]
    assert gaps[:5] == [1.0, 2.0, 4.0, 4.0, 4.0]
    assert h.stats.transitions_total == 1


async def test_only_one_probe_at_a_time() -> None:
    h = Harness()
    h.storage.down = True
    await h.reserve()
    h.storage.down = False
    h.clock.advance(1.0)
    h.storage.hold = asyncio.Event()
    probe = asyncio.create_task(h.reserve())
    await asyncio.sleep(0)
    others = [await h.reserve() for _ in range(5)]
    assert all(r.origin == "fallback" for r in others), (
        "while one probe is in flight, others use the fallback"
    )
    h.storage.hold.set()
    assert (await probe).origin == "redis"
    assert not h.stats.degraded


async def test_fail_closed_refuses_without_asking_storage_until_the_probe() -> None:
    h = Harness(mode="fail_closed")
    h.storage.down = True
    for _ in range(3):
        with pytest.raises(LimiterUnavailable, match="unavailable"):
            await h.reserve()
    assert (h.storage.calls, h.stats.fail_closed_total, h.stats.fail_open_total) == (1, 3, 0)
    assert await h.fallback.in_flight("acme") == 0, "fail_closed never admits on local buckets"


async def test_reservations_settle_where_they_were_made() -> None:
    h = Harness()
    on_redis = await h.reserve()
    h.storage.down = True
    on_fallback = await h.reserve()
    h.storage.down = False
    h.clock.advance(1.0)
    assert (await h.reserve()).origin == "redis"
    await h.limiter.settle(on_fallback, actual_cost_tokens=1)
    await h.limiter.settle(on_redis, actual_cost_tokens=1)
    assert await h.fallback.in_flight("acme") == 0
    assert await h.storage.inner.in_flight("acme") == 1  # only the probe's reservation is left
    assert await h.limiter.in_flight("acme") == 1


async def test_a_settle_that_fails_is_counted_not_raised() -> None:
    h = Harness()
    r = await h.reserve()
    h.storage.down = True
    await h.limiter.settle(r, actual_cost_tokens=1)
    assert h.stats.storage_errors_total == 1
    assert h.stats.degraded, "a failed settle is evidence that storage is down"


async def test_in_flight_counts_the_fallback_alone_while_down() -> None:
    h = Harness()
    await h.reserve()
    h.storage.down = True
    await h.reserve()
    assert await h.limiter.in_flight("acme") == 1


async def test_a_value_error_from_storage_is_not_a_storage_failure() -> None:
    h = Harness()
    with pytest.raises(ValueError, match="cost_tokens"):
        await h.limiter.reserve("acme", cost_tokens=-1, limits=LIMITS, request_id="bad")
    assert (h.stats.degraded, h.stats.storage_errors_total) == (False, 0)


async def test_close_closes_both() -> None:
    h = Harness()
    await h.limiter.close()
    assert h.storage.closed


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"backoff_s": 0.0}, "backoff_s", id="no-backoff"),
        pytest.param({"backoff_s": 5.0, "backoff_max_s": 1.0}, "backoff_max_s", id="max-below-start"),
    ],
)
def test_invalid_backoff(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FailoverLimiter(MemoryLimiter(name="a"), MemoryLimiter(name="b"), **kwargs)  # type: ignore[arg-type]


def test_primary_and_fallback_need_different_names() -> None:
    with pytest.raises(ValueError, match="different names"):
        FailoverLimiter(MemoryLimiter(), MemoryLimiter())
