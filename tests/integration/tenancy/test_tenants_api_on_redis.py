"""``GET /sluice/v1/tenants`` reads the shared budget from Redis, without touching it.

Two gateways (real aiohttp servers) share team-a's buckets in a real ``redis-server``; requests
go through gateway A with the real ``openai`` SDK, and gateway B's admin API shows the level they
left. Reading creates no key for an idle tenant and leaves the expiry of a used one alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import aiohttp
import openai
import pytest

from gateway.config.settings import Settings
from gateway.limits.config import LimitsSettings, RedisSettings, TenantLimitSettings, TokenWeightSettings
from tests.support.redis import RedisNotInstalled, RedisServer, redis_server
from tests.unit.gateway.fakes import MODEL, FakeReplica, make_app, url_of
from tests.unit.tenancy.conftest import KEY_A, RESERVED, Scripted, tenancy_settings

pytestmark = pytest.mark.timeout(120)

PREFIX = "tenants-api"
LIMITS = TenantLimitSettings(tokens_per_minute=60.0, token_burst=1000.0, max_concurrent=8)


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    try:
        with redis_server(name="redis-tenants-api") as server:
            yield server
    except RedisNotInstalled as exc:
        pytest.fail(str(exc))


async def test_gateway_b_shows_the_level_requests_through_a_left(
    aiohttp_server: Any, redis: RedisServer
) -> None:
    replica_url = await url_of(await aiohttp_server(FakeReplica(handler=Scripted().answer).app()))

    def settings() -> Settings:
        base = tenancy_settings(replica_url, limits=LIMITS)
        limits = LimitsSettings(
            backend="redis",
            redis=RedisSettings(url=redis.url, timeout_s=2.0, key_prefix=PREFIX),
            on_storage_error="fail_closed",
            token_weights=TokenWeightSettings(prompt=1.0, output=2.0),
        )
        return base.model_copy(update={"limits": limits})

    a, b = [await url_of(await aiohttp_server(make_app(settings())[0])) for _ in range(2)]
    client = openai.AsyncOpenAI(base_url=f"{a}/v1", api_key=KEY_A, max_retries=0)
    try:
        for _ in range(3):
            await client.completions.create(model=MODEL, prompt=[7] * 20, max_tokens=10)
    finally:
        await client.close()

    async with aiohttp.ClientSession() as session:
        with redis.client() as raw:
            ttl_before = raw.pttl(f"{PREFIX}:{{team-a}}:tokens")
            async with session.get(f"{b}/sluice/v1/tenants") as resp:
                listed = await resp.json()
            ttl_after = raw.pttl(f"{PREFIX}:{{team-a}}:tokens")
            idle_keys = raw.keys(f"{PREFIX}:{{team-b}}:*")

    team_a = next(t for t in listed["data"] if t["id"] == "team-a")
    tokens = team_a["buckets"]["tokens"]
    # Three requests settled at what they reserved; at most a few seconds of refill (1 a second).
    assert 1000 - 3 * RESERVED <= tokens["remaining"] < 1000 - 3 * RESERVED + 30
    assert (tokens["capacity"], tokens["limit_per_minute"]) == (1000.0, 60.0)
    assert (team_a["in_flight"], team_a["levels_from"]) == (0, "redis")
    assert 0 < ttl_after <= ttl_before  # the read did not push the bucket's expiry out
    assert idle_keys == []  # nor create keys for the idle tenant
