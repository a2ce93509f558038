"""FailoverLimiter: the storage failure policy, in virtual time, over a switchable storage.

The probe's sleeps end only when the test moves the clock past them (``VirtualTime``), so the
claims about when service returns are exact: the first probe after storage answers again marks
it up, one ``probe_interval_s`` at most after it answered, with or without request traffic.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest

from gateway.limits.base import LimiterStats, LimiterUnavailable, Reservation, TenantLimits
from gateway.limits.failover import PROBE_TENANT, FailoverLimiter, FailureMode
from gateway.limits.memory import MemoryLimiter
from tests.unit.limits.fakes import FakeClock, FlakyStorage

LIMITS = TenantLimits(tokens_per_minute=6000, max_concurrent=100)
INTERVAL_S = 0.25


class VirtualTime:
    """``sleep`` for the limiter: each sleep ends when ``advance`` moves ``clock`` past its end."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.sleeping: list[tuple[float, asyncio.Future[None]]] = []
        #: Every duration asked for, in order.
        self.asked: list[float] = []

    async def sleep(self, seconds: float) -> None:
        self.asked.append(seconds)
        wake: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.sleeping.append((self.clock.now + seconds, wake))
        await wake

    async def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` on, waking each sleep at its own end, in order, and letting
        the woken task run to its next sleep before going on."""
        target = self.clock.now + seconds
        await _run_ready()
        while True:
            due = [entry for entry in self.sleeping if entry[0] <= target + 1e-9]
            if not due:
                break
            entry = min(due, key=lambda e: e[0])
            self.sleeping.remove(entry)
            self.clock.now = max(self.clock.now, entry[0])
            entry[1].set_result(None)
            await _run_ready()
        self.clock.now = max(self.clock.now, target)


async def _run_ready() -> None:
    """Let every task that can run go to its next wait (the fakes never really block)."""
    for _ in range(10):
        await asyncio.sleep(0)


class Harness:
    def __init__(self, mode: FailureMode = "fail_open", *, with_probe: bool = False) -> None:
        self.clock = FakeClock()
        self.time = VirtualTime(self.clock)
        self.stats = LimiterStats()
        self.storage = FlakyStorage(MemoryLimiter(clock=self.clock, stats=self.stats, name="redis"))
        self.fallback = MemoryLimiter(share=0.5, clock=self.clock, stats=self.stats, name="fallback")
        self.pings = 0
        self.limiter = FailoverLimiter(
            self.storage,
            self.fallback,
            mode=mode,
            probe=self.ping if with_probe else None,
            probe_interval_s=INTERVAL_S,
            clock=self.clock,
            sleep=self.time.sleep,
            stats=self.stats,
        )
        self._n = 0

    async def ping(self) -> None:
        self.pings += 1
        if self.storage.down:
            raise LimiterUnavailable("redis: connection refused")

    async def reserve(self) -> Reservation:
        self._n += 1
        return await self.limiter.reserve("acme", cost_tokens=1, limits=LIMITS, request_id=f"r{self._n}")


def logs(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "sluice.limits"]


async def test_healthy_storage_answers_everything() -> None:
    h = Harness()
    r = await h.reserve()
    assert r.origin == "redis"
    await h.limiter.settle(r, actual_cost_tokens=1)
    assert (h.stats.storage_errors_total, h.stats.transitions_total, h.stats.degraded) == (0, 0, False)
    assert h.limiter.probes_total == 0, "nothing is probed while storage answers"


async def test_fail_open_falls_back_logs_once_and_resumes(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="sluice.limits")
    h = Harness()
    h.storage.down = True
    outage = [await h.reserve() for _ in range(10)]
    assert all(r.allowed and r.origin == "fallback" for r in outage)
    assert h.storage.calls == 1, "no request asks storage once it is marked down"
    assert (h.stats.degraded, h.stats.transitions_total, h.stats.fail_open_total) == (True, 1, 10)
    await h.time.advance(1.1)
    h.storage.down = False
    await h.time.advance(INTERVAL_S)
    assert (h.stats.degraded, h.stats.transitions_total) == (False, 2)
    assert (await h.reserve()).origin == "redis"
    assert [level for level, _ in logs(caplog)] == [logging.WARNING, logging.INFO]
    assert "redis unavailable" in logs(caplog)[0][1]
    assert "probed every 0.25 s" in logs(caplog)[0][1]
    assert "available again after 1.2 s" in logs(caplog)[1][1]


@pytest.mark.parametrize("answers_after_s", [0.0, 0.01, 0.124, 0.25, 0.26, 3.7, 61.0])
@pytest.mark.parametrize("mode", ["fail_open", "fail_closed"])
async def test_service_returns_within_one_interval_of_storage_answering(
    mode: FailureMode, answers_after_s: float
) -> None:
    """No request during the outage: the background probe alone finds storage back, one
    ``probe_interval_s`` at most after it answers, however long it was down."""
    h = Harness(mode)
    h.storage.down = True
    with pytest.raises(LimiterUnavailable) if mode == "fail_closed" else contextlib.nullcontext():
        await h.reserve()
    await h.time.advance(answers_after_s)
    h.storage.down = False
    answered_at = h.clock.now
    while h.stats.degraded:
        await h.time.advance(0.001)
        assert h.clock.now - answered_at <= INTERVAL_S + 1e-9, "still down one interval after"
    assert h.clock.now - answered_at <= INTERVAL_S + 1e-9
    assert set(h.time.asked) == {INTERVAL_S}, "a fixed interval: no backoff"
    assert (await h.reserve()).origin == "redis"


async def test_probes_keep_a_fixed_interval_through_a_long_outage() -> None:
    h = Harness(with_probe=True)
    h.storage.down = True
    await h.reserve()
    await h.time.advance(60.0)
    assert h.pings == 240, "one probe every 0.25 s for 60 s"
    assert set(h.time.asked) == {INTERVAL_S}
    assert h.storage.calls == 1, "the probe, not the storage's script calls, asks while down"
    assert h.stats.storage_errors_total == 1 + 240, "each failed probe is a failed storage call"
    assert h.stats.transitions_total == 1


async def test_the_default_probe_reads_an_empty_lease_set() -> None:
    h = Harness()
    h.storage.down = True
    await h.reserve()
    await h.time.advance(INTERVAL_S)
    assert h.storage.calls == 2, "the reserve, then one probe (in_flight)"
    assert await h.storage.inner.in_flight(PROBE_TENANT) == 0


async def test_fail_closed_refuses_at_once_without_asking_storage() -> None:
    h = Harness(mode="fail_closed", with_probe=True)
    h.storage.down = True
    for _ in range(3):
        with pytest.raises(LimiterUnavailable, match="unavailable"):
            await h.reserve()
    assert (h.storage.calls, h.stats.fail_closed_total, h.stats.fail_open_total) == (1, 3, 0)
    assert await h.fallback.in_flight("acme") == 0, "fail_closed never admits on local buckets"
    await h.time.advance(1.0)
    with pytest.raises(LimiterUnavailable):
        await h.reserve()
    assert h.storage.calls == 1, "requests between probes never wait on storage"


async def test_a_probe_that_raises_something_else_is_logged_and_probing_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    h = Harness(with_probe=True)
    h.storage.down = True
    await h.reserve()
    broken = [True]

    async def probe() -> None:
        if broken[0]:
            raise RuntimeError("bug")

    h.limiter._probe = probe
    h.storage.down = False
    await h.time.advance(INTERVAL_S)
    assert h.stats.degraded
    assert any("probing rate-limit storage redis failed" in m for _, m in logs(caplog))
    broken[0] = False
    await h.time.advance(INTERVAL_S)
    assert not h.stats.degraded


async def test_reservations_settle_where_they_were_made() -> None:
    h = Harness()
    on_redis = await h.reserve()
    h.storage.down = True
    on_fallback = await h.reserve()
    h.storage.down = False
    await h.time.advance(INTERVAL_S)
    assert (await h.reserve()).origin == "redis"
    await h.limiter.settle(on_fallback, actual_cost_tokens=1)
    await h.limiter.settle(on_redis, actual_cost_tokens=1)
    assert await h.fallback.in_flight("acme") == 0
    assert await h.storage.inner.in_flight("acme") == 1  # only the last reservation is left
    assert await h.limiter.in_flight("acme") == 1


async def test_a_settle_that_fails_is_counted_not_raised_and_starts_probing() -> None:
    h = Harness(with_probe=True)
    r = await h.reserve()
    h.storage.down = True
    await h.limiter.settle(r, actual_cost_tokens=1)
    assert h.stats.storage_errors_total == 1
    assert h.stats.degraded, "a failed settle is evidence that storage is down"
    h.storage.down = False
    await h.time.advance(INTERVAL_S)
    assert (h.pings, h.stats.degraded) == (1, False)


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


async def test_close_closes_both_and_stops_probing() -> None:
    h = Harness(with_probe=True)
    h.storage.down = True
    await h.reserve()
    await h.limiter.close()
    assert h.storage.closed
    await h.time.advance(10.0)
    assert h.pings == 0


@pytest.mark.parametrize("interval", [0.0, -1.0])
def test_invalid_probe_interval(interval: float) -> None:
    with pytest.raises(ValueError, match="probe_interval_s"):
        FailoverLimiter(MemoryLimiter(name="a"), MemoryLimiter(name="b"), probe_interval_s=interval)


def test_primary_and_fallback_need_different_names() -> None:
    with pytest.raises(ValueError, match="different names"):
        FailoverLimiter(MemoryLimiter(), MemoryLimiter())
