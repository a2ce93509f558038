"""Redis dies under load and comes back: a real ``sluice serve`` and the test's own ``redis-server``.

fail_open: no request fails because of it (answers come from this gateway's local buckets while
Redis is down), the gateway keeps running, each up/down transition is logged exactly once (as
many log lines as ``sluice_redis_transitions_total`` counts), and the shared budget in Redis is
used again after the restart, without restarting the gateway. fail_closed: 503
(``rate_limit_unavailable``) while Redis is down, 200 again once it is back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.tenancy.fleet import Gateway, drive, emulator, gateway_config, gateways, model_of
from tests.support.procs import free_port
from tests.support.redis import RedisNotInstalled, RedisServer, redis_server

pytestmark = pytest.mark.timeout(240)

DOWN = "rate-limit storage redis unavailable"
UP = "rate-limit storage redis available again"
#: Budgets the load never reaches: every refusal would be Redis's fault.
ROOMY = {"tokens_per_minute": 1.0e9, "requests_per_minute": 1.0e7, "max_concurrent": 1000}


@pytest.fixture(scope="module")
def replica() -> Iterator[str]:
    with emulator(seed=2) as url:
        yield url


@pytest.fixture
def redis_proc() -> Iterator[RedisServer]:
    try:
        with redis_server(name="redis-failure") as server:
            yield server
    except RedisNotInstalled as exc:
        pytest.fail(str(exc))


def _config(replica_url: str, redis_url: str, mode: str) -> dict[str, object]:
    limits = {
        "backend": "redis",
        "redis": {"url": redis_url, "timeout_s": 0.2},
        "on_storage_error": mode,
        "retry_backoff_s": 0.2,
    }
    config = gateway_config(replica_url, free_port(), limits=limits, tenant_limits=ROOMY)
    # Every transition's line written, none counted into a later one: the test counts them.
    config["logging"]["repeat_window_s"] = 0
    return config


async def _outage(redis: RedisServer, *, after_s: float, down_s: float) -> None:
    await asyncio.sleep(after_s)
    redis.kill()
    await asyncio.sleep(down_s)
    await asyncio.to_thread(redis.start)  # same port, empty (persistence is off)


async def _metric(gateway: Gateway, name: str) -> float:
    async with aiohttp.ClientSession() as session, session.get(gateway.url + "/metrics") as resp:
        text = await resp.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise AssertionError(f"{name} not exported")


def _script_calls(redis: RedisServer) -> int:
    """EVALSHA calls this server process answered (its counters start at zero on a restart)."""
    with redis.client() as client:
        stats = client.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


async def test_fail_open_survives_a_redis_restart(
    tmp_path: Path, replica: str, redis_proc: RedisServer
) -> None:
    with gateways(tmp_path, [_config(replica, redis_proc.url, "fail_open")]) as (gateway,):
        model = await model_of(gateway.url)
        outage = asyncio.create_task(_outage(redis_proc, after_s=1.5, down_s=1.5))
        load = await drive([gateway.url], model, duration_s=6.0, workers=8)
        await outage

        assert gateway.alive()
        assert dict(load.statuses) == {200: load.admitted}, (load.statuses, load.codes)
        log = gateway.log()
        transitions = await _metric(gateway, "sluice_redis_transitions_total")
        assert log.count(DOWN) >= 1
        assert log.count(DOWN) + log.count(UP) == transitions  # one line per transition
        assert log.count(UP) == log.count(DOWN)  # it ends up, not degraded
        assert await _metric(gateway, "sluice_redis_degraded") == 0.0
        assert await _metric(gateway, "sluice_redis_fail_open_total") > 0
        assert _script_calls(redis_proc) > 0  # the restarted Redis keeps the budget again
        assert "Traceback" not in log


async def test_fail_closed_answers_503_then_recovers(
    tmp_path: Path, replica: str, redis_proc: RedisServer
) -> None:
    with gateways(tmp_path, [_config(replica, redis_proc.url, "fail_closed")]) as (gateway,):
        model = await model_of(gateway.url)
        outage = asyncio.create_task(_outage(redis_proc, after_s=1.0, down_s=1.5))
        load = await drive([gateway.url], model, duration_s=4.0, workers=4, pause_after_refusal_s=0.05)
        await outage
        recovered = await _first_success_after_restart(gateway, model)

        assert gateway.alive()
        assert set(load.statuses) <= {200, 503}, load.statuses
        assert load.statuses[503] > 0
        assert load.codes == {"rate_limit_unavailable": load.statuses[503]}
        assert load.statuses[200] > 0
        assert recovered
        # Nothing fails before the outage: the first refusal comes after Redis was killed.
        first_refusal = min(t for t, status in load.timeline if status == 503)
        assert first_refusal >= 0.9


async def _first_success_after_restart(gateway: Gateway, model: str, timeout_s: float = 20.0) -> bool:
    """Whether a request succeeds again within ``timeout_s`` (the next probe finds Redis back)."""
    body = {"model": model, "prompt": [11] * 4, "max_tokens": 2}
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            headers = {"Authorization": "Bearer sk-integration-team-a-4c1e"}
            async with session.post(gateway.url + "/v1/completions", json=body, headers=headers) as resp:
                if resp.status == 200:
                    return True
            await asyncio.sleep(0.1)
    return False
