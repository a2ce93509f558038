"""The limiter's pipelined script calls (``gateway.limits.pipelined``) on a real redis-server.

A plain ``redis://`` client's script calls share one connection whose replies are matched to the
callers in order: many concurrent calls must each get their own reply, a password and a database
number in the URL must be honoured, a server restart must cost no call, and clients the fast path
does not speak for (a cluster, TLS, decoded replies) must keep redis-py's path.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator

import pytest
import redis.asyncio
import uvloop

from gateway.limits.base import TenantLimits
from gateway.limits.pipelined import Packed, PipelinedScripts, for_client, pack
from gateway.limits.redis import RedisLimiter, connect
from tests.contract.limits.conftest import one_at_a_time_rounds
from tests.support.redis import RedisServer

LIMITS = TenantLimits(tokens_per_minute=6_000_000, requests_per_minute=600_000, max_concurrent=10_000)
#: Generous: a loaded 2-core machine must not flake.
TIMEOUT_S = 30.0


@pytest.fixture
async def limiter(own_redis: RedisServer) -> AsyncIterator[RedisLimiter]:
    limiter = RedisLimiter(connect(own_redis.url, timeout_s=TIMEOUT_S), timeout_s=TIMEOUT_S)
    yield limiter
    await limiter.close()


def fast_path(limiter: RedisLimiter) -> PipelinedScripts:
    fast = limiter._fast
    assert isinstance(fast, PipelinedScripts), "a plain redis:// client takes the pipelined path"
    return fast


async def test_concurrent_calls_share_one_connection_and_each_gets_its_own_reply(
    limiter: RedisLimiter, own_redis: RedisServer
) -> None:
    ids = [f"r{i}" for i in range(300)]
    tenants = [f"t{i % 7}" for i in range(300)]
    costs = [float(i % 13) for i in range(300)]
    reservations = await asyncio.gather(
        *(
            limiter.reserve(t, cost_tokens=c, limits=LIMITS, request_id=i)
            for t, c, i in zip(tenants, costs, ids, strict=True)
        )
    )
    assert [r.request_id for r in reservations] == ids
    assert all(r.allowed for r in reservations)
    # Each reply is its own call's: the in-flight count a reserve sees counts its own lease, and
    # a tenant's counts are 1..n, each once.
    for tenant in set(tenants):
        seen = sorted(r.concurrency.in_flight for r in reservations if r.tenant == tenant and r.concurrency)
        assert seen == list(range(1, tenants.count(tenant) + 1)), tenant
    assert fast_path(limiter).connects == 1
    counts = await asyncio.gather(*(limiter.in_flight(t) for t in sorted(set(tenants))))
    assert counts == [tenants.count(t) for t in sorted(set(tenants))]
    await asyncio.gather(*(limiter.settle(r, actual_cost_tokens=0.0) for r in reservations))
    assert sum(await asyncio.gather(*(limiter.in_flight(t) for t in set(tenants)))) == 0
    assert fast_path(limiter).connects == 1


async def test_a_server_restart_costs_no_call(limiter: RedisLimiter, own_redis: RedisServer) -> None:
    assert await limiter.in_flight("acme") == 0
    own_redis.kill()
    own_redis.start()
    # The old socket is stale (and the restarted server has no scripts): the call reconnects,
    # loads the script and answers.
    r = await limiter.reserve("acme", cost_tokens=1.0, limits=LIMITS, request_id="after")
    assert r.allowed
    assert await limiter.in_flight("acme") == 1
    assert fast_path(limiter).connects == 2


def noscript_errors(server: RedisServer) -> int:
    """How many NOSCRIPT error replies ``server`` has sent (``INFO errorstats``)."""
    admin = redis.Redis.from_url(server.url)
    try:
        stats = admin.info("errorstats")
    finally:
        admin.close()
    return int(stats.get("errorstat_NOSCRIPT", {}).get("count", 0))


async def test_every_connection_loads_the_scripts_before_its_first_call(
    limiter: RedisLimiter, own_redis: RedisServer
) -> None:
    """A call that met NOSCRIPT would be answered a load and a round trip later, behind calls
    sent after it (a settle behind the same tenant's next reserve: a spurious concurrency 429).
    On a fresh server and on a restarted one, no call meets it."""
    for restart in (False, True):
        if restart:
            own_redis.kill()
            own_redis.start()
        await one_at_a_time_rounds(limiter, f"restart={restart}")
        assert noscript_errors(own_redis) == 0
    assert fast_path(limiter).connects == 2


def no_password(server: RedisServer) -> None:
    """Undo ``requirepass s3cret``."""
    admin = redis.Redis.from_url(f"redis://:s3cret@127.0.0.1:{server.port}/0")
    try:
        admin.config_set("requirepass", "")
    finally:
        admin.close()


async def test_password_and_database_from_the_url(own_redis: RedisServer) -> None:
    with own_redis.client() as admin:
        admin.config_set("requirepass", "s3cret")
    url = f"redis://:s3cret@127.0.0.1:{own_redis.port}/3"
    limiter = RedisLimiter(connect(url, timeout_s=TIMEOUT_S), timeout_s=TIMEOUT_S)
    try:
        fast = fast_path(limiter)
        assert (fast.db, fast.port) == (3, own_redis.port)
        r = await limiter.reserve("acme", cost_tokens=1.0, limits=LIMITS, request_id="db3")
        assert r.allowed
        plain = redis.asyncio.Redis.from_url(url)
        try:
            assert await plain.zcard("sluice:{acme}:leases") == 1  # in database 3
        finally:
            await plain.aclose()
        other = redis.asyncio.Redis.from_url(f"redis://:s3cret@127.0.0.1:{own_redis.port}/0")
        try:
            assert await other.zcard("sluice:{acme}:leases") == 0
        finally:
            await other.aclose()
    finally:
        await limiter.close()
        no_password(own_redis)


async def test_a_wrong_password_is_an_error_not_a_hang(own_redis: RedisServer) -> None:
    with own_redis.client() as admin:
        admin.config_set("requirepass", "s3cret")
    try:
        url = f"redis://:wrong@127.0.0.1:{own_redis.port}/0"
        limiter = RedisLimiter(connect(url, timeout_s=TIMEOUT_S), timeout_s=TIMEOUT_S)
        try:
            with pytest.raises(Exception, match=r"(?i)pass|auth"):
                await limiter.reserve("acme", cost_tokens=1.0, limits=LIMITS, request_id="x")
        finally:
            await limiter.close()
    finally:
        no_password(own_redis)


def test_other_clients_keep_redis_pys_path(own_redis: RedisServer) -> None:
    assert for_client(redis.asyncio.Redis.from_url(own_redis.url, decode_responses=True), 1.0) is None
    assert for_client(redis.asyncio.Redis.from_url("rediss://127.0.0.1:1"), 1.0) is None
    assert for_client(redis.asyncio.Redis.from_url("unix:///tmp/none.sock"), 1.0) is None
    assert for_client(object(), 1.0) is None
    assert for_client(connect(own_redis.url), 1.0) is not None


def test_pack_encodes_as_redis_py_does() -> None:
    assert pack("EVALSHA", b"ab", 2, 0.5, "é") == (
        b"*5\r\n$7\r\nEVALSHA\r\n$2\r\nab\r\n$1\r\n2\r\n$3\r\n0.5\r\n$2\r\n\xc3\xa9\r\n"
    )


def test_packed_arguments_are_the_packed_commands_parts() -> None:
    whole = pack("EVALSHA", "sha", 2, "k1", "k2", "id", 0.5, -1, 60.0)
    head = b"*9\r\n" + pack("EVALSHA", "sha")[len(b"*2\r\n") :]
    keys, rest = Packed.keys(("k1", "k2")), Packed(-1, 60.0)
    assert (keys.count, rest.count) == (3, 2)
    assert whole == head + keys.data + pack("id", 0.5)[len(b"*2\r\n") :] + rest.data


async def test_pre_encoded_and_plain_arguments_make_the_same_call(
    limiter: RedisLimiter, own_redis: RedisServer
) -> None:
    """The limiter's pipelined calls pass a tenant's keys and bucket parameters pre-encoded: the
    server sees the command redis-py's path sends (the same reservation, the same counts)."""
    fast = fast_path(limiter)
    keys = limiter.keys("acme")
    args = ("p1", 3.0, 1000.0, 60_000.0, 10.0, 600.0, 5, 60.0)
    plain = await fast.evalsha(limiter._reserve, (keys.tokens, keys.requests, keys.leases), args)
    packed = await fast.evalsha(
        limiter._reserve,
        Packed.keys((keys.tokens, keys.requests, keys.leases)),
        ("p2", 3.0, Packed(*args[2:])),
    )
    assert plain[0] == packed[0] == 1  # both allowed
    assert (int(plain[4]), int(packed[4])) == (1, 2)  # the second saw the first's lease
    assert await limiter.in_flight("acme") == 2


async def test_a_call_past_its_deadline_raises_and_its_reply_goes_to_nobody(
    own_redis: RedisServer,
) -> None:
    """A deadline ends the wait for a reply (``TimeoutError``); the reply, when it comes, is
    dropped, and the connection (heard from recently) stays: the next call gets its own reply."""
    limiter = RedisLimiter(connect(own_redis.url, timeout_s=TIMEOUT_S), timeout_s=TIMEOUT_S)
    try:
        fast = fast_path(limiter)
        keys = (limiter.keys("acme").leases,)
        assert await fast.evalsha(limiter._in_flight, keys, ()) == 0
        loop = asyncio.get_running_loop()
        os.kill(own_redis.pid, signal.SIGSTOP)
        try:
            started = loop.time()
            with pytest.raises(TimeoutError):
                await fast.evalsha(
                    limiter._reserve,
                    Packed.keys((limiter.keys("acme").tokens, limiter.keys("acme").requests, keys[0])),
                    ("late", 1.0, Packed(-1.0, 0.0, -1.0, 0.0, -1, 60.0)),
                    deadline=started + 0.1,
                )
            assert loop.time() - started >= 0.1
            with pytest.raises(TimeoutError):  # already past: not even written
                await fast.evalsha(limiter._in_flight, keys, (), deadline=loop.time() - 1.0)
        finally:
            os.kill(own_redis.pid, signal.SIGCONT)
        assert await fast.evalsha(limiter._in_flight, keys, (), deadline=loop.time() + TIMEOUT_S) in (0, 1)
        assert fast.connects == 1
    finally:
        await limiter.close()


async def test_a_reply_after_a_cancelled_call_goes_to_nobody(
    limiter: RedisLimiter, own_redis: RedisServer
) -> None:
    """A call cancelled while its reply is on its way: the reply is dropped, the next call gets
    its own (SIGSTOP holds the reply back; the connection has answered recently, so it stays).
    The server is stopped before the call is written: stopped after, it may already have
    answered (a loaded scripts' call is answered in well under a millisecond)."""
    assert await limiter.in_flight("acme") == 0
    fast = fast_path(limiter)
    os.kill(own_redis.pid, signal.SIGSTOP)
    try:
        call = asyncio.ensure_future(limiter.reserve("acme", cost_tokens=1.0, limits=LIMITS, request_id="c1"))
        await asyncio.sleep(0.05)  # written, unanswered
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    finally:
        os.kill(own_redis.pid, signal.SIGCONT)
    assert await limiter.in_flight("acme") in (0, 1)  # c1 ran or not; this is in_flight's reply
    r = await limiter.reserve("acme", cost_tokens=1.0, limits=LIMITS, request_id="c2")
    assert r.allowed
    assert r.request_id == "c2"
    assert fast.connects == 1


def test_the_fast_path_runs_on_uvloop(own_redis: RedisServer) -> None:
    """The gateway serves on uvloop, whose transports are not ``asyncio.Transport`` subclasses."""

    async def calls() -> tuple[bool, int, int]:
        limiter = RedisLimiter(connect(own_redis.url, timeout_s=TIMEOUT_S), timeout_s=TIMEOUT_S)
        try:
            r = await limiter.reserve("acme", cost_tokens=1.0, limits=LIMITS, request_id="uv")
            return r.allowed, await limiter.in_flight("acme"), fast_path(limiter).connects
        finally:
            await limiter.close()

    assert uvloop.run(calls()) == (True, 1, 1)
