"""Keys issued and revoked on one gateway apply on another through Redis.

Two gateways (real aiohttp servers, ``limits.backend: redis`` on a real ``redis-server``) in front
of one fake replica; clients are the real ``openai`` SDK. A key issued on gateway A through the
admin API opens gateway B within a (scaled) second; revoked on B, it is a 401 on A within a
second; listing shows its id and prefix, never the secret; ``sluice keys`` does the same from
the command line.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from typing import Any

import aiohttp
import openai
import pytest

from gateway.cli import main
from gateway.config.settings import Settings
from gateway.limits.config import LimitsSettings, RedisSettings, TokenWeightSettings
from gateway.tenants import AuthSettings, hash_api_key
from tests.support.redis import RedisNotInstalled, RedisServer, redis_server
from tests.support.speed import scaled
from tests.unit.gateway.fakes import MODEL, FakeReplica, make_app, url_of
from tests.unit.tenancy.conftest import ADMIN_TOKEN, KEY_A, Scripted, tenancy_settings

pytestmark = pytest.mark.timeout(120)

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    try:
        with redis_server(name="redis-keys") as server:
            yield server
    except RedisNotInstalled as exc:
        pytest.fail(str(exc))


async def _gateways(aiohttp_server: Any, redis_url: str, prefix: str) -> tuple[str, str]:
    replica = await aiohttp_server(FakeReplica(handler=Scripted().answer).app())
    replica_url = await url_of(replica)

    def settings() -> Settings:
        base = tenancy_settings(replica_url, auth=AuthSettings(admin_token_hash=hash_api_key(ADMIN_TOKEN)))
        limits = LimitsSettings(
            backend="redis",
            redis=RedisSettings(url=redis_url, timeout_s=2.0, key_prefix=prefix),
            token_weights=TokenWeightSettings(prompt=1.0, output=2.0),
        )
        return base.model_copy(update={"limits": limits})

    urls = []
    for _ in range(2):
        app, _store, _outcomes = make_app(settings())
        urls.append(await url_of(await aiohttp_server(app)))
    return urls[0], urls[1]


async def _complete(gateway: str, key: str) -> int:
    """The status a real SDK call with ``key`` gets from ``gateway`` (200, or the error's)."""
    client = openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0)
    try:
        await client.completions.create(model=MODEL, prompt=[7] * 20, max_tokens=10)
    except openai.APIStatusError as exc:
        return exc.status_code
    finally:
        await client.close()
    return 200


async def _admin(method: str, url: str) -> Any:
    async with aiohttp.ClientSession() as session, session.request(method, url, headers=ADMIN) as resp:
        assert resp.status in (200, 201), await resp.text()
        return await resp.json()


async def test_a_key_issued_on_one_gateway_opens_the_other_and_revoking_closes_both(
    aiohttp_server: Any, redis: RedisServer
) -> None:
    a, b = await _gateways(aiohttp_server, redis.url, "keys-api")
    assert (await _complete(a, KEY_A), await _complete(b, KEY_A)) == (200, 200)  # YAML keys still work

    issued = await _admin("POST", f"{a}/sluice/v1/tenants/team-a/keys")
    secret = issued["secret"]
    assert issued["source"] == "redis"
    await asyncio.sleep(scaled(1.0))
    assert await _complete(b, secret) == 200

    listed = (await _admin("GET", f"{b}/sluice/v1/tenants/team-a/keys"))["data"]
    mine = [k for k in listed if k["id"] == issued["id"]]
    assert [k["prefix"] for k in mine] == [secret[:14]]
    assert secret not in str(listed)
    assert "sha256:" not in str(listed)
    with redis.client() as client:
        stored = str(client.hgetall("keys-api:{apikeys}:records"))
    assert secret not in stored
    assert hash_api_key(secret) in stored

    await _admin("DELETE", f"{b}/sluice/v1/tenants/team-a/keys/{issued['id']}")
    assert await _complete(b, secret) == 401
    await asyncio.sleep(scaled(1.0))
    assert await _complete(a, secret) == 401
    assert await _complete(a, KEY_A) == 200


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


async def test_sluice_keys_round_trip_on_redis(
    aiohttp_server: Any, redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = await _gateways(aiohttp_server, redis.url, "keys-cli")
    monkeypatch.setenv("SLUICE_ADMIN_TOKEN", ADMIN_TOKEN)
    monkeypatch.setenv("SLUICE_ADMIN_URL", a)

    code, out, err = await asyncio.to_thread(_cli, "keys", "issue", "--tenant", "team-a")
    assert code == 0, err
    secret = out.strip()
    key_id = err.split()[1]
    await asyncio.sleep(scaled(1.0))
    assert await _complete(b, secret) == 200

    code, out, _ = await asyncio.to_thread(_cli, "keys", "list", "--url", b)
    assert code == 0
    assert key_id in out
    assert secret[:14] in out
    assert secret not in out

    code, _, err = await asyncio.to_thread(_cli, "keys", "revoke", "--tenant", "team-a", key_id, "--url", b)
    assert code == 0, err
    await asyncio.sleep(scaled(1.0))
    assert await _complete(a, secret) == 401

    monkeypatch.delenv("SLUICE_ADMIN_TOKEN")
    code, _, err = await asyncio.to_thread(_cli, "keys", "list")
    assert code == 1
    assert "401" in err
