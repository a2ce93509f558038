"""The Redis limiter on a three-master Redis Cluster this session starts itself.

The contract tests named ``*_everywhere`` already run here (``backend_or_cluster``); these add
what is particular to a cluster: every key of a call in one slot, and scripts on every primary.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from gateway.limits.base import TenantLimits
from gateway.limits.redis import RedisLimiter, connect
from tests.contract.limits.conftest import CONTRACT_TIMEOUT_S, flush, one_at_a_time_rounds
from tests.support.redis import RedisClusterNodes

LIMITS = TenantLimits(tokens_per_minute=600, requests_per_minute=60, max_concurrent=10)
#: Enough tenants that their hash tags land on all three masters.
TENANTS = [f"tenant-{i}" for i in range(12)]


@pytest.fixture
async def limiter(redis_cluster_procs: RedisClusterNodes) -> AsyncIterator[RedisLimiter]:
    flush(redis_cluster_procs.nodes)
    client = connect(redis_cluster_procs.url, cluster=True, timeout_s=CONTRACT_TIMEOUT_S)
    limiter = RedisLimiter(client, timeout_s=CONTRACT_TIMEOUT_S)
    yield limiter
    await limiter.close()


async def test_each_tenants_keys_share_one_slot_across_the_cluster(
    limiter: RedisLimiter, redis_cluster_procs: RedisClusterNodes
) -> None:
    for tenant in TENANTS:
        r = await limiter.reserve(tenant, cost_tokens=10, limits=LIMITS, request_id="r1")
        assert r.allowed
        await limiter.reserve(tenant, cost_tokens=10, limits=LIMITS, request_id="r2")
        await limiter.settle(r, actual_cost_tokens=4)
    holders: dict[str, set[int]] = {}
    for index, node in enumerate(redis_cluster_procs.nodes):
        with node.client() as client:
            for raw in client.keys("*"):
                key = raw.decode()
                tenant = key.split("{", 1)[1].split("}", 1)[0]
                holders.setdefault(tenant, set()).add(index)
                assert client.execute_command("CLUSTER KEYSLOT", key) == client.execute_command(
                    "CLUSTER KEYSLOT", tenant
                )
    assert set(holders) == set(TENANTS)
    assert all(len(nodes) == 1 for nodes in holders.values()), "a tenant's keys live on one node"
    assert len(set().union(*holders.values())) == 3, "tenants spread over every master"


async def test_script_flush_on_every_node_is_recovered(
    limiter: RedisLimiter, redis_cluster_procs: RedisClusterNodes
) -> None:
    for tenant in TENANTS:
        assert (await limiter.reserve(tenant, cost_tokens=1, limits=LIMITS, request_id="r1")).allowed
    for node in redis_cluster_procs.nodes:
        with node.client() as client:
            client.script_flush()
    for tenant in TENANTS:
        assert (await limiter.reserve(tenant, cost_tokens=1, limits=LIMITS, request_id="r2")).allowed
        assert await limiter.in_flight(tenant) == 2


async def test_load_scripts_reaches_every_primary(
    limiter: RedisLimiter, redis_cluster_procs: RedisClusterNodes
) -> None:
    for node in redis_cluster_procs.nodes:
        with node.client() as client:
            client.script_flush()
    await limiter.load_scripts()
    shas = [s.sha for s in (limiter._reserve, limiter._settle, limiter._in_flight)]
    for node in redis_cluster_procs.nodes:
        with node.client() as client:
            assert client.script_exists(*shas) == [True, True, True]


def noscript_errors(cluster: RedisClusterNodes) -> int:
    """NOSCRIPT error replies sent by every node of ``cluster`` (``INFO errorstats``)."""
    total = 0
    for node in cluster.nodes:
        with node.client() as client:
            stats = client.info("errorstats")
        total += int(stats.get("errorstat_NOSCRIPT", {}).get("count", 0))
    return total


async def test_a_settle_never_meets_noscript_behind_the_next_reserve(
    limiter: RedisLimiter, redis_cluster_procs: RedisClusterNodes
) -> None:
    """redis-py's path (a cluster): the first call to meet NOSCRIPT loads every script, so the
    settle of a one-at-a-time tenant's request is never answered a load and a round trip late,
    behind the same tenant's next reserve (which would still count the slot: a spurious 429). On
    fresh nodes and after every node's scripts were flushed."""
    for node in redis_cluster_procs.nodes:
        with node.client() as client:
            client.script_flush()
            client.config_resetstat()
    for flushed in (False, True):
        if flushed:
            for node in redis_cluster_procs.nodes:
                with node.client() as client:
                    client.script_flush()
        before = noscript_errors(redis_cluster_procs)
        await one_at_a_time_rounds(limiter, f"flushed={flushed}")
        assert noscript_errors(redis_cluster_procs) - before == 1, "only the first reserve met NOSCRIPT"
