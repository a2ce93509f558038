"""What only the Redis backend promises: hash-tagged keys, EVALSHA with NOSCRIPT recovery, one
round trip per call, and an over-limit cache that keeps a flood away from Redis."""

from __future__ import annotations

import contextlib
import re
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator

import pytest
from redis.crc import key_slot

from gateway.limits.base import LimiterStats, TenantLimits
from gateway.limits.cache import OverLimitCache
from gateway.limits.redis import RedisLimiter, connect
from tests.contract.limits.conftest import CONTRACT_TIMEOUT_S, flush
from tests.support.redis import RedisServer, require_binary

#: Slow refill (10 tokens and 1 request take 10 s to come back) so no key expires mid-test.
LIMITS = TenantLimits(tokens_per_minute=60, requests_per_minute=6, max_concurrent=10)
TENANTS = ("alpha", "beta.team", "t-3_x")


@pytest.fixture
async def limiter(redis_server_proc: RedisServer) -> AsyncIterator[RedisLimiter]:
    flush([redis_server_proc])
    client = connect(redis_server_proc.url, timeout_s=CONTRACT_TIMEOUT_S)
    limiter = RedisLimiter(client, timeout_s=CONTRACT_TIMEOUT_S)
    yield limiter
    await limiter.close()


def calls(server: RedisServer, command: str) -> int:
    """How many times the server ran ``command`` (``INFO commandstats``; 0 if never)."""
    with server.client() as client:
        stats = client.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


async def test_every_key_is_hash_tagged_by_its_tenant(
    limiter: RedisLimiter, redis_server_proc: RedisServer
) -> None:
    for tenant in TENANTS:
        r = await limiter.reserve(tenant, cost_tokens=10, limits=LIMITS, request_id="r1")
        await limiter.reserve(tenant, cost_tokens=10, limits=LIMITS, request_id="r2")
        await limiter.settle(r, actual_cost_tokens=3)
    with redis_server_proc.client() as client:
        keys = sorted(k.decode() for k in client.keys("*"))
    pattern = re.compile(r"^sluice:\{(?P<tenant>[^{}]+)\}:(tokens|requests|leases)$")
    expected = sorted(f"sluice:{{{t}}}:{kind}" for t in TENANTS for kind in ("tokens", "requests", "leases"))
    assert keys == expected
    for key in keys:
        match = pattern.match(key)
        assert match is not None, key
        assert key_slot(key.encode()) == key_slot(match["tenant"].encode()), "one slot per tenant"


async def test_keys_expire_once_buckets_are_full_again(
    limiter: RedisLimiter, redis_server_proc: RedisServer
) -> None:
    await limiter.reserve("alpha", cost_tokens=10, limits=LIMITS, request_id="r1")
    with redis_server_proc.client() as client:
        ttls = {k.decode(): client.pttl(k) for k in client.keys("*")}
    # 10 tokens at 1/s and 1 request at 0.1/s refill in 10 s; leases live lease_ttl_s.
    assert 0 < ttls["sluice:{alpha}:tokens"] <= 10_001
    assert 0 < ttls["sluice:{alpha}:requests"] <= 10_001
    assert 0 < ttls["sluice:{alpha}:leases"] <= limiter.lease_ttl_s * 1000


@pytest.mark.parametrize(
    "tenant", [pytest.param("a{b", id="open-brace"), pytest.param("a}b", id="close-brace")]
)
async def test_tenant_names_with_braces_are_refused(limiter: RedisLimiter, tenant: str) -> None:
    with pytest.raises(ValueError, match="braces"):
        await limiter.reserve(tenant, cost_tokens=1, limits=LIMITS, request_id="r")


async def test_calls_use_evalsha_and_survive_script_flush(
    limiter: RedisLimiter, redis_server_proc: RedisServer
) -> None:
    assert (await limiter.reserve("alpha", cost_tokens=1, limits=LIMITS, request_id="r1")).allowed
    with redis_server_proc.client() as client:
        client.script_flush()
    before, loads_before = calls(redis_server_proc, "evalsha"), calls(redis_server_proc, "script|load")
    # The server forgot the script: redis-py's Script gets NOSCRIPT, loads it and retries once.
    r = await limiter.reserve("alpha", cost_tokens=1, limits=LIMITS, request_id="r2")
    assert r.allowed
    await limiter.settle(r, actual_cost_tokens=1)
    assert await limiter.in_flight("alpha") == 1
    # Each of the three scripts: one EVALSHA refused with NOSCRIPT, SCRIPT LOAD, one that runs.
    assert calls(redis_server_proc, "evalsha") - before == 3 * 2
    assert calls(redis_server_proc, "script|load") - loads_before == 3
    assert calls(redis_server_proc, "eval") == 0, "scripts are never sent whole by EVAL"


async def test_load_scripts_registers_every_script(
    limiter: RedisLimiter, redis_server_proc: RedisServer
) -> None:
    with redis_server_proc.client() as client:
        client.script_flush()
        await limiter.load_scripts()
        shas = [s.sha for s in (limiter._reserve, limiter._settle, limiter._in_flight)]
        assert client.script_exists(*shas) == [True, True, True]


async def test_each_call_is_one_evalsha_round_trip(
    limiter: RedisLimiter, redis_server_proc: RedisServer
) -> None:
    await limiter.load_scripts()
    await limiter.in_flight("warm-up")  # the connection's handshake is not part of the calls below
    with monitor(redis_server_proc) as seen:
        r = await limiter.reserve("alpha", cost_tokens=5, limits=LIMITS, request_id="r1")
        await limiter.settle(r, actual_cost_tokens=2)
        await limiter.in_flight("alpha")
    from_client = [line for line in seen() if " lua]" not in line]
    assert [line.split()[3].strip('"').lower() for line in from_client] == ["evalsha"] * 3, from_client


@contextlib.contextmanager
def monitor(server: RedisServer) -> Iterator[Callable[[], list[str]]]:
    """Record every command the server runs (``redis-cli MONITOR``); call the result after the block.

    Lines look like ``1700000000.1 [0 127.0.0.1:5555] "evalsha" ...``; commands run by a script
    show ``[0 lua]`` instead of a client address.
    """
    out = server.dir / "monitor.txt"
    with out.open("w") as sink:
        proc = subprocess.Popen(
            [require_binary("redis-cli"), "-p", str(server.port), "monitor"],
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 10
        while not out.read_text().startswith("OK"):
            assert time.monotonic() < deadline, "redis-cli monitor did not start"
            time.sleep(0.01)
        lines: list[str] = []
        yield lambda: lines
        time.sleep(0.2)  # let the last commands reach the monitor
    finally:
        proc.terminate()
        proc.wait(10)
    lines.extend(line for line in out.read_text().splitlines()[1:] if line.strip())


async def test_over_limit_cache_keeps_a_flood_away_from_redis(redis_server_proc: RedisServer) -> None:
    flush([redis_server_proc])
    stats = LimiterStats()
    inner = RedisLimiter(
        connect(redis_server_proc.url, timeout_s=CONTRACT_TIMEOUT_S), timeout_s=CONTRACT_TIMEOUT_S
    )
    limiter = OverLimitCache(inner, stats=stats)
    limits = TenantLimits(tokens_per_minute=60, token_burst=10)  # 1 token/s
    try:
        assert (await limiter.reserve("alpha", cost_tokens=10, limits=limits, request_id="r0")).allowed
        before = calls(redis_server_proc, "evalsha")
        flood = [
            await limiter.reserve("alpha", cost_tokens=5, limits=limits, request_id=f"f{i}")
            for i in range(100)
        ]
        assert calls(redis_server_proc, "evalsha") - before == 1, "only the first rejection asks Redis"
        assert not any(r.allowed for r in flood)
        assert [r.from_cache for r in flood] == [False] + [True] * 99
        assert stats.local_cache_rejections_total == 99
        last = flood[-1]
        assert last.retry_after_s is not None
        assert 0 < last.retry_after_s <= 5
        # Another tenant is not affected.
        assert (await limiter.reserve("beta", cost_tokens=10, limits=limits, request_id="b")).allowed
    finally:
        await limiter.close()
