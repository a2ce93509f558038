"""Many gateways, one budget: three ``sluice serve`` processes share one tenant's token bucket in
Redis (a single ``redis-server``, then a three-master Redis Cluster), under many concurrent clients.

The bound: what the tenant is charged never exceeds the bucket's capacity plus its refill over the
test's duration, plus at most one reservation per gateway. Three separate in-process budgets
would admit about three times the capacity; the test also checks that the budget was really
used (the clients were refused only once it was spent).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.tenancy.fleet import (
    RESERVED,
    Load,
    drive,
    emulator,
    gateway_config,
    gateways,
    model_of,
)
from tests.support.procs import free_port
from tests.support.redis import RedisNotInstalled, redis_cluster, redis_server

pytestmark = pytest.mark.timeout(240)

GATEWAYS = 3
#: 20 weighted tokens per second, 300 at once: about 9 requests of 32 at once, then 0.6 per second.
TOKENS_PER_MINUTE = 1200.0
TOKEN_BURST = 300.0
DURATION_S = 4.0
WORKERS = 24


@pytest.fixture(scope="module")
def replica() -> Iterator[str]:
    with emulator() as url:
        yield url


def _configs(replica_url: str, redis_url: str, *, cluster: bool) -> list[dict[str, object]]:
    limits = {
        "backend": "redis",
        # Generous timeout and fail_closed: a slow call on a loaded machine is a 503, never a
        # local fallback bucket that would blur the shared budget this test measures.
        "redis": {"url": redis_url, "cluster": cluster, "timeout_s": 2.0},
        "on_storage_error": "fail_closed",
        "expected_gateways": GATEWAYS,
    }
    tenant_limits = {"tokens_per_minute": TOKENS_PER_MINUTE, "token_burst": TOKEN_BURST}
    return [
        gateway_config(replica_url, free_port(), limits=limits, tenant_limits=tenant_limits)
        for _ in range(GATEWAYS)
    ]


async def _run(tmp_path: Path, replica_url: str, redis_url: str, *, cluster: bool) -> Load:
    with gateways(tmp_path, _configs(replica_url, redis_url, cluster=cluster)) as fleet:
        urls = [g.url for g in fleet]
        model = await model_of(urls[0])
        load = await drive(urls, model, duration_s=DURATION_S, workers=WORKERS)
        assert all(g.alive() for g in fleet)
    return load


def _check(load: Load) -> None:
    refill = TOKENS_PER_MINUTE / 60.0 * load.duration_s
    bound = TOKEN_BURST + refill + GATEWAYS * RESERVED
    assert set(load.statuses) <= {200, 429}, (load.statuses, load.codes)
    assert load.codes == {"rate_limit_exceeded": load.statuses[429]}
    assert load.prompt_mismatches == 0  # the reservation's prompt estimate was exact
    assert load.charged <= bound, f"charged {load.charged} > {bound} over {load.duration_s:.2f} s"
    # The budget was really spent, not refused early: at least the burst and half the refill.
    assert load.charged >= TOKEN_BURST - RESERVED + refill / 2
    assert load.statuses[429] > load.admitted  # the clients wanted far more than the budget


async def test_three_gateways_share_one_budget_on_redis(tmp_path: Path, replica: str) -> None:
    try:
        with redis_server(name="redis-shared-budget") as server:
            load = await _run(tmp_path, replica, server.url, cluster=False)
    except RedisNotInstalled as exc:
        pytest.fail(str(exc))
    _check(load)


async def test_three_gateways_share_one_budget_on_redis_cluster(tmp_path: Path, replica: str) -> None:
    try:
        with redis_cluster(3) as cluster:
            load = await _run(tmp_path, replica, cluster.url, cluster=True)
    except RedisNotInstalled as exc:
        pytest.fail(str(exc))
    _check(load)
