"""Redis dies, hangs and comes back: one error type within the timeout, then the failure policy.

Each test owns its redis-server (``own_redis``) so it can SIGKILL, SIGSTOP and restart it on the
same port. Timings are checked against generous bounds: the point is "bounded, never a hang".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest

from gateway.limits.base import LimiterStats, LimiterUnavailable, Reservation, TenantLimits
from gateway.limits.failover import FailoverLimiter, FailureMode
from gateway.limits.memory import DEFAULT_LEASE_TTL_S, MemoryLimiter
from gateway.limits.redis import RedisLimiter, connect
from tests.contract.limits.conftest import wait_until
from tests.support.redis import RedisServer
from tests.support.speed import scaled

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
    assert await elapsed_of(fast.ping) < BOUND_S


async def test_hung_redis_raises_limiter_unavailable_after_the_timeout(
    fast: RedisLimiter, own_redis: RedisServer
) -> None:
    await wait_until_answers(fast)  # a warm connection: only the hang can make the next call slow
    own_redis.pause()  # sockets stay open, nothing answers: only the timeout can end the call
    try:
        took = await elapsed_of(lambda: fast.reserve("acme", cost_tokens=1, limits=LIMITS, request_id="r2"))
        assert 0.04 <= took < BOUND_S
        assert 0.04 <= await elapsed_of(fast.ping) < BOUND_S
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


#: Slow refill (0.001 tokens per second): a refund is the only way tokens come back in a test.
REFUND_LIMITS = TenantLimits(tokens_per_minute=0.06, token_burst=100, max_concurrent=1)


@contextlib.contextmanager
def scripts_refused(server: RedisServer) -> Iterator[None]:
    """Redis refuses every script call (NOPERM) until the block ends: a call that fails without
    having run on the server, as one that never reached it does."""
    with server.client() as admin:
        admin.execute_command("ACL", "SETUSER", "default", "-evalsha", "-eval")
        try:
            yield
        finally:
            admin.execute_command("ACL", "SETUSER", "default", "+@all")


def repairing_limiter(
    server: RedisServer,
    stats: LimiterStats,
    *,
    repair_delay_s: float = 0.05,
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
) -> RedisLimiter:
    """A patient Redis limiter whose repairs start after ``repair_delay_s``, retry every 50-200 ms."""
    return RedisLimiter(
        connect(server.url, timeout_s=PATIENT_S),
        timeout_s=PATIENT_S,
        stats=stats,
        repair_delay_s=repair_delay_s,
        repair_backoff_max_s=0.2,
        lease_ttl_s=lease_ttl_s,
    )


async def assert_refunded(limiter: RedisLimiter) -> None:
    """The slot and the 80 tokens a settle of 90 reserved -> 10 actual refunds are back."""
    assert await limiter.in_flight("acme") == 0
    again = await limiter.reserve("acme", cost_tokens=90, limits=REFUND_LIMITS, request_id="again")
    assert again.allowed, again


async def test_a_failed_settle_is_retried_until_storage_applies_it(own_redis: RedisServer) -> None:
    stats = LimiterStats()
    limiter = repairing_limiter(own_redis, stats)
    try:
        r = await limiter.reserve("acme", cost_tokens=90, limits=REFUND_LIMITS, request_id="r1")
        with scripts_refused(own_redis):
            with pytest.raises(LimiterUnavailable):
                await limiter.settle(r, actual_cost_tokens=10)
            # Refused again and again (one repair used to give up after its single attempt).
            await wait_until(lambda: stats.repair_retries_total >= 3, "the repair to be retried")
            assert limiter.pending_repairs() == stats.repairs_pending == 1
        assert await limiter.wait_repairs(PATIENT_S) == 0
        assert (stats.repairs_total, stats.repairs_applied_total, stats.repairs_abandoned_total) == (1, 1, 0)
        assert stats.repairs_pending == 0
        await assert_refunded(limiter)
    finally:
        await limiter.close()


async def test_close_runs_pending_repairs_at_once(own_redis: RedisServer) -> None:
    stats = LimiterStats()
    # The first attempt would wait a minute: close must not wait for it, nor drop it.
    limiter = repairing_limiter(own_redis, stats, repair_delay_s=60.0)
    r = await limiter.reserve("acme", cost_tokens=90, limits=REFUND_LIMITS, request_id="r1")
    with scripts_refused(own_redis), pytest.raises(LimiterUnavailable):
        await limiter.settle(r, actual_cost_tokens=10)
    assert limiter.pending_repairs() == 1
    await asyncio.wait_for(limiter.close(), PATIENT_S + 5.0)
    assert (stats.repairs_applied_total, stats.repairs_pending) == (1, 0)
    checker = repairing_limiter(own_redis, LimiterStats())
    try:
        await assert_refunded(checker)
    finally:
        await checker.close()


async def test_a_repair_gives_up_when_its_lease_has_expired_or_at_close(own_redis: RedisServer) -> None:
    stats = LimiterStats()
    # Leases of half a second: the settle has nothing left to repair after that.
    limiter = repairing_limiter(own_redis, stats, lease_ttl_s=0.5)
    second = repairing_limiter(own_redis, stats, repair_delay_s=60.0)
    try:
        with scripts_refused(own_redis):
            r = _allowed("r1")
            with pytest.raises(LimiterUnavailable):
                await limiter.settle(r, actual_cost_tokens=10)
            with pytest.raises(LimiterUnavailable):
                await second.settle(_allowed("r2"), actual_cost_tokens=10)
            await wait_until(lambda: limiter.pending_repairs() == 0, "the repair to give up")
            assert stats.repairs_abandoned_total == 1
            await asyncio.wait_for(second.close(), PATIENT_S + 5.0)  # its last attempt fails too
        assert (stats.repairs_total, stats.repairs_abandoned_total, stats.repairs_pending) == (2, 2, 0)
        assert stats.repairs_applied_total == 0
    finally:
        await limiter.close()


def _allowed(request_id: str) -> Reservation:
    """An allowed reservation of 90 tokens for ``acme`` (what a reserve would have returned)."""
    return Reservation(
        request_id=request_id,
        tenant="acme",
        allowed=True,
        cost_tokens=90,
        limits=REFUND_LIMITS,
        tokens=None,
        requests=None,
        concurrency=None,
        blocked_by=frozenset(),
        oversize=False,
        retry_after_s=0.0,
        origin="redis",
    )


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
    redis = redis_limiter(server, timeout_s, stats)
    return FailoverLimiter(
        redis,
        MemoryLimiter(share=0.5, stats=stats, name="fallback"),
        mode=mode,
        probe=redis.ping,
        probe_interval_s=0.05,
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
        await wait_until_resumed(limiter)  # the background PING finds Redis back
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


@pytest.mark.parametrize("outage", ["killed", "hung"])
async def test_fail_closed_service_returns_within_a_second_of_redis_answering(
    own_redis: RedisServer, outage: str
) -> None:
    """The production probe interval (0.25 s), no request traffic during the outage: the
    background PING alone finds Redis back, restarted on its port (killed) or resumed after a
    SIGSTOP (hung: connections accepted, nothing answered). Requests meanwhile fail at once."""
    stats = LimiterStats()
    redis = redis_limiter(own_redis, 0.2, stats)  # 0.2 s: a busy machine's first connect fits
    limiter = FailoverLimiter(
        redis, MemoryLimiter(stats=stats, name="fallback"), mode="fail_closed", probe=redis.ping, stats=stats
    )
    try:
        await limiter.reserve("acme", cost_tokens=1, limits=LIMITS, request_id="before")
        if outage == "killed":
            own_redis.kill()
        else:
            own_redis.pause()
        with pytest.raises(LimiterUnavailable):
            await limiter.reserve("acme", cost_tokens=1, limits=LIMITS, request_id="marks-down")
        assert stats.degraded
        start = time.monotonic()
        for i in range(200):
            with pytest.raises(LimiterUnavailable):
                await limiter.reserve("acme", cost_tokens=1, limits=LIMITS, request_id=f"down{i}")
        assert time.monotonic() - start < scaled(0.2), "refusals never wait on the dead connection"
        await asyncio.sleep(1.0)  # a few probes fail
        assert limiter.probes_total >= 2
        if outage == "killed":
            await asyncio.to_thread(own_redis.start)  # returns once it answers PING
        else:
            own_redis.resume()
        await wait_until(lambda: not stats.degraded, "service back within 1 s", timeout_s=scaled(1.0))
        resumed = await limiter.reserve("acme", cost_tokens=1, limits=LIMITS, request_id="after")
        assert resumed.origin == "redis"
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
