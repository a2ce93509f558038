"""One bound per Redis call: the limiter's own ``timeout_s``, not redis-py's socket timeout.

``connect`` builds clients without a per-command socket timeout (it would arm two more timers per
command for the same bound, on the request path), so these tests show that the limiter's
``asyncio.timeout`` alone still cuts every kind of call to a hung server (SIGSTOP: sockets open,
nothing answers) at ``timeout_s``, and that the limiter answers again once the server does.
Timings: the lower bound is exact (a timeout cannot fire early); the upper one is generous.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import redis.asyncio

from gateway.limits.base import LimiterUnavailable, TenantLimits
from gateway.limits.redis import RedisLimiter, connect
from tests.support.redis import RedisServer

LIMITS = TenantLimits(tokens_per_minute=6_000_000, requests_per_minute=600_000, max_concurrent=1000)
#: Longer than any redis-py default would cut a read at, short enough for a test.
TIMEOUT_S = 0.3
#: Scheduling slack on a loaded machine, on top of ``TIMEOUT_S``.
SLACK_S = 3.0


@pytest.fixture
async def limiter(own_redis: RedisServer) -> AsyncIterator[RedisLimiter]:
    # Repairs of the failed calls wait longer than the test lasts (``close`` cancels them), so
    # the lease counts below are the calls' own doing.
    client = connect(own_redis.url, timeout_s=TIMEOUT_S)
    limiter = RedisLimiter(client, timeout_s=TIMEOUT_S, repair_delay_s=600.0)
    yield limiter
    await limiter.close()


async def answers(limiter: RedisLimiter) -> None:
    """Wait (up to 20 s) until ``limiter`` completes a call."""
    deadline = time.monotonic() + 20
    while True:
        try:
            await limiter.in_flight("acme")
            return
        except LimiterUnavailable:
            assert time.monotonic() < deadline, "the Redis limiter never answered"
            await asyncio.sleep(0.05)


async def seconds_to_fail(call: Callable[[], Awaitable[object]]) -> float:
    start = time.monotonic()
    with pytest.raises(LimiterUnavailable):
        await call()
    return time.monotonic() - start


def test_clients_arm_no_per_command_socket_timer(own_redis: RedisServer) -> None:
    client = connect(own_redis.url, timeout_s=0.05)
    assert isinstance(client, redis.asyncio.Redis)
    kwargs = client.connection_pool.connection_kwargs
    assert kwargs["socket_timeout"] is None
    assert kwargs["socket_connect_timeout"] == 0.05  # connecting stays bounded on its own


async def test_a_hung_redis_is_cut_at_the_limiters_timeout(
    limiter: RedisLimiter, own_redis: RedisServer
) -> None:
    reservation = await limiter.reserve("acme", cost_tokens=5, limits=LIMITS, request_id="r1")
    await answers(limiter)  # warm pooled connections: only the hang can make the next calls slow
    own_redis.pause()
    try:
        calls: list[Callable[[], Awaitable[object]]] = [
            lambda: limiter.reserve("acme", cost_tokens=1, limits=LIMITS, request_id="r2"),
            lambda: limiter.settle(reservation, actual_cost_tokens=5),
            lambda: limiter.in_flight("acme"),
        ]
        for call in calls:
            took = await seconds_to_fail(call)
            assert TIMEOUT_S <= took < TIMEOUT_S + SLACK_S
        # Many calls at once on the pool: each is cut, none waits for another's timeout.
        started = time.monotonic()
        results = await asyncio.gather(
            *(limiter.in_flight("acme") for _ in range(16)), return_exceptions=True
        )
        assert all(isinstance(r, LimiterUnavailable) for r in results)
        assert time.monotonic() - started < TIMEOUT_S + SLACK_S
    finally:
        own_redis.resume()
    # The connections the timeouts cut are not reused with a stale reply in them.
    # r1 holds its lease; r2 too when the server ran it on waking (its reply was lost: what the
    # delayed repair is for). A stale reply read by a later call would not be such a count.
    await answers(limiter)
    assert await limiter.in_flight("acme") in (1, 2)
    third = await limiter.reserve("acme", cost_tokens=1, limits=LIMITS, request_id="r3")
    assert third.allowed
    assert third.request_id == "r3"
