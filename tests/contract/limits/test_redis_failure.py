"""Redis dies, hangs and comes back: one error type within the timeout, then the failure policy.

Each test owns its redis-server (``own_redis``) so it can SIGKILL, SIGSTOP and restart it on the
same port. Timings are checked against generous bounds: the point is "bounded, never a hang".
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from gateway.limits.base import LimiterStats, LimiterUnavailable, Reservation, TenantLimits
from gateway.limits.failover import FailoverLimiter, FailureMode
from gateway.limits.memory import MemoryLimiter
from gateway.limits.redis import RedisLimiter, connect
from tests.contract.limits.conftest import wait_until
from tests.support.redis import RedisServer

LIMITS = TenantLimits(tokens_per_minute=6_000_000, requests_per_minute=600_000, max_concurrent=1000)
#: The default 50 ms timeout must hold even when a loaded CI machine is slow to schedule us.
BOUND_S = 2.0
#: For calls that must succeed: a 50 ms timeout can expire on a loaded CI machine. Calls to a
#: killed server fail at once (connection refused), so this does not slow the outage tests.
PATIENT_S = 10.0


def redis_limiter(server: RedisServer, timeout_s: float, stats: LimiterStats | None = None) -> RedisLimiter:
    return RedisLimiter(connect(server.url, timeout_s=timeout_s), timeout_s=timeout_s, stats=stats)


@pytest.fixture
async def fast(own_redis: RedisServer) -> AsyncIterator[RedisLimiter]:
    """A Redis limiter with the production default timeout of 50 ms."""
    limiter = redis_limiter(own_redis, 0.05)
    yield limiter
    await limiter.close()


@pytest.fixture
async def patient(own_redis: RedisServer) -> AsyncIterator[RedisLimiter]:
    """A Redis limiter on the same server that waits long enough to succeed on a loaded machine."""
    limiter = redis_limiter(own_redis, PATIENT_S)
    yield limiter
    await limiter.close()


async def elapsed_of(call: Callable[[], Awaitable[object]]) -> float:
    """Seconds ``call`` took to raise ``LimiterUnavailable`` (fails if it returned)."""
    start = time.monotonic()
    with pytest.raises(LimiterUnavailable):
        await call()
    return time.monotonic() - start


async def test_dead_redis_raises_limiter_unavailable_fast(
    fast: RedisLimiter, patient: RedisLimiter, own_redis: RedisServer
) -> None:
    r = await patient.reserve("acme", cost_tokens=1, limits=LIMITS, request_id="r1")
    own_redis.kill()
    assert (
        await elapsed_of(lambda: fast.reserve("acme", cost_tokens=1, limits=LIMITS, request_id="r2"))
        < BOUND_S
    )
    assert await elapsed_of(lambda: fast.settle(r, actual_cost_tokens=1)) < BOUND_S
    assert await elapsed_of(lambda: fast.in_flight("acme")) < BOUND_S


async def test_hung_redis_raises_limiter_unavailable_after_the_timeout(
    fast: RedisLimiter, own_redis: RedisServer
) -> None:
    await wait_until_answers(fast)  # a warm connection: only the hang can make the next call slow
    own_redis.pause()  # sockets stay open, nothing answers: only the timeout can end the call
    try:
        took = await elapsed_of(lambda: fast.reserve("acme", cost_tokens=1, limits=LIMITS, request_id="r2"))
        assert 0.04 <= took < BOUND_S
    finally:
        own_redis.resume()
    # Once it answers again, so does the limiter (a timed-out connection is not reused).
    await wait_until_answers(fast)


async def test_a_reserve_whose_reply_was_lost_is_released(
    own_redis: RedisServer, patient: RedisLimiter
) -> None:
    limits = TenantLimits(tokens_per_minute=60, token_burst=100, max_concurrent=1)
    fast = RedisLimiter(connect(own_redis.url, timeout_s=0.05), timeout_s=0.05, repair_delay_s=0.2)
    try:
        await wait_until_answers(fast)
        own_redis.pause()  # the command reaches the server's socket; the reply cannot come in time
        with pytest.raises(LimiterUnavailable):
            await fast.reserve("acme", cost_tokens=40, limits=limits, request_id="lost")
        own_redis.resume()
        await wait_until(lambda: fast.pending_repairs() == 0, "the repair to run")
        # Without the repair, the reserve that ran on resume would hold the only slot for 900 s.
        assert await patient.in_flight("acme") == 0
        r = await patient.reserve("acme", cost_tokens=100, limits=limits, request_id="next")
        assert r.allowed, "the slot and the 40 tokens came back"
    finally:
        await fast.close()


async def wait_until_answers(limiter: RedisLimiter) -> None:
    deadline = time.monotonic() + 20
    while True:
        try:
            await limiter.in_flight("acme")
            return
        except LimiterUnavailable:
            assert time.monotonic() < deadline, "Redis limiter never recovered"
            await asyncio.sleep(0.05)


def failover(
    server: RedisServer, mode: FailureMode, stats: LimiterStats, timeout_s: float
) -> FailoverLimiter:
    return FailoverLimiter(
        redis_limiter(server, timeout_s, stats),
        MemoryLimiter(share=0.5, stats=stats, name="fallback"),
        mode=mode,
        backoff_s=0.05,
        backoff_max_s=0.2,
        stats=stats,
    )


def transition_logs(caplog: pytest.LogCaptureFixture) -> tuple[int, int]:
    """(warnings that storage went down, infos that it came back) logged by the limiter."""
    records = [r for r in caplog.records if r.name == "sluice.limits"]
    down = sum(r.levelno == logging.WARNING and "unavailable" in r.getMessage() for r in records)
    up = sum(r.levelno == logging.INFO and "available again" in r.getMessage() for r in records)
    return down, up


async def test_fail_open_falls_back_and_resumes_when_redis_returns(
    own_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sluice.limits")
    stats = LimiterStats()
    limiter = failover(own_redis, "fail_open", stats, timeout_s=PATIENT_S)
    try:
        before = await limiter.reserve("acme", cost_tokens=1, limits=LIMITS, request_id="before")
        assert before.origin == "redis"
        own_redis.kill()
        during = [
            await limiter.reserve("acme", cost_tokens=1, limits=LIMITS, request_id=f"d{i}") for i in range(20)
        ]
        assert all(r.allowed and r.origin == "fallback" for r in during)
        assert stats.degraded
        # The limits the fallback enforces are this gateway's share (0.5) of the tenant's.
        assert during[0].concurrency is not None
        assert during[0].concurrency.limit == 500
        await limiter.settle(before, actual_cost_tokens=1)  # storage down: counted, not raised
        own_redis.start()
        await wait_until_resumed(limiter)  # reserves probe Redis after each backoff
        assert (stats.degraded, stats.transitions_total) == (False, 2)
        for r in during:
            await limiter.settle(r, actual_cost_tokens=1)
        assert await limiter.fallback.in_flight("acme") == 0, "fallback reservations settle on the fallback"
        assert stats.fail_open_total >= 20
        assert stats.storage_errors_total >= 2
        assert transition_logs(caplog) == (1, 1)
    finally:
        await limiter.close()


async def wait_until_resumed(limiter: FailoverLimiter) -> Reservation:
    """Reserve until a reservation comes from Redis again; return it (settled)."""
    for i in range(2000):
        r = await limiter.reserve("acme", cost_tokens=1, limits=LIMITS, request_id=f"resume{i}")
        await limiter.settle(r, actual_cost_tokens=1)
        if r.origin == "redis":
            return r
        await asyncio.sleep(0.01)
    pytest.fail("never resumed on Redis")


async def test_fail_closed_refuses_until_redis_returns(own_redis: RedisServer) -> None:
    stats = LimiterStats()
    limiter = failover(own_redis, "fail_closed", stats, timeout_s=PATIENT_S)
    try:
        own_redis.kill()
        for i in range(5):
            with pytest.raises(LimiterUnavailable):
                await limiter.reserve("acme", cost_tokens=1, limits=LIMITS, request_id=f"r{i}")
        assert stats.fail_closed_total == 5
        assert stats.fail_open_total == 0
        own_redis.start()
        resumed = None
        for i in range(2000):
            try:
                resumed = await limiter.reserve("acme", cost_tokens=1, limits=LIMITS, request_id=f"again{i}")
                break
            except LimiterUnavailable:
                await asyncio.sleep(0.01)
        assert resumed is not None
        assert resumed.origin == "redis"
        assert not stats.degraded
    finally:
        await limiter.close()


async def test_fail_open_under_load_survives_kill_and_restart(
    own_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sluice.limits")
    stats = LimiterStats()
    # A looser timeout than production: a 50 ms timeout on a loaded CI machine could add a
    # spurious outage (the 50 ms default is checked above).
    limiter = failover(own_redis, "fail_open", stats, timeout_s=PATIENT_S)
    origins: Counter[str] = Counter()
    refused: list[Reservation] = []
    stop = asyncio.Event()

    async def client(worker: int) -> int:
        n = 0
        while not stop.is_set():
            r = await limiter.reserve("acme", cost_tokens=10, limits=LIMITS, request_id=f"w{worker}-{n}")
            origins[r.origin] += 1
            if not r.allowed:
                refused.append(r)
            await asyncio.sleep(0.002)
            await limiter.settle(r, actual_cost_tokens=7)
            n += 1
        return n

    try:
        workers = asyncio.gather(*(client(w) for w in range(16)))
        await wait_until(lambda: origins["redis"] >= 50, "load on Redis")
        own_redis.kill()
        await wait_until(lambda: origins["fallback"] >= 50, "load on the fallback")
        on_redis_before = origins["redis"]
        own_redis.start()
        await wait_until(lambda: origins["redis"] >= on_redis_before + 50, "load back on Redis")
        stop.set()
        done = await workers  # any exception in a worker fails the test here
        assert sum(done) == sum(origins.values())
        assert refused == [], "no request may fail because Redis went away"
        assert await limiter.fallback.in_flight("acme") == 0
        assert stats.transitions_total >= 2
        assert not stats.degraded
        down, up = transition_logs(caplog)
        assert down == up == stats.transitions_total // 2, "logged once per transition"
    finally:
        stop.set()
        await limiter.close()
