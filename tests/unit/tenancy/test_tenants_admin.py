"""``GET /sluice/v1/tenants[/{id}]`` and the tenant gauges' refresh.

A real gateway (aiohttp, a ``MemoryLimiter`` on a hand-driven clock) in front of a fake replica:
the API shows the limits, the buckets as the limiter holds them now, the requests in flight and
the recent 429s by reason; the gauges follow a settle and the refill of an idle tenant.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from gateway.config.settings import Settings
from gateway.limits.config import TenantLimitSettings
from gateway.observability.metrics import METRICS
from gateway.tenants import AuthSettings, hash_api_key
from gateway.tenants.admin_api import TENANTS_ADMIN
from gateway.tenants.recent import RecentRefusals
from tests.support.speed import scaled
from tests.unit.gateway.fakes import wait_for
from tests.unit.limits.fakes import FakeClock
from tests.unit.tenancy.conftest import ADMIN_TOKEN, Scripted, StartTenantGateway, bearer, tenancy_settings

#: 10 weighted tokens per second, a bucket of 200, two at once; one request reserves and uses 40.
TIGHT = TenantLimitSettings(tokens_per_minute=600.0, token_burst=200.0, max_concurrent=2)


def tight(url: str) -> Settings:
    return tenancy_settings(url, limits=TIGHT)


def guarded(url: str) -> Settings:
    return tenancy_settings(url, limits=TIGHT, auth=AuthSettings(admin_token_hash=hash_api_key(ADMIN_TOKEN)))


async def _tenant(gw: Any, name: str = "team-a", token: str | None = None) -> dict[str, Any]:
    resp = await gw.client.get(f"/sluice/v1/tenants/{name}", headers=bearer(token) if token else {})
    assert resp.status == 200, await resp.text()
    body: dict[str, Any] = await resp.json()
    return body


async def test_lists_every_tenant_with_limits_and_full_buckets(
    start_tenant_gateway: StartTenantGateway,
) -> None:
    gw = await start_tenant_gateway(Scripted().answer, settings=tight)
    resp = await gw.client.get("/sluice/v1/tenants")
    body = await resp.json()

    assert resp.status == 200
    assert body["token_weights"] == {"input": 1.0, "output": 2.0, "request": 0.0, "context": 0.0}
    assert [t["id"] for t in body["data"]] == ["team-a", "team-b"]
    a, b = body["data"]
    assert a["limits"]["tokens_per_minute"] == 600.0
    assert a["limits"]["max_concurrent"] == 2
    assert a["buckets"]["tokens"] == {
        "remaining": 200.0,
        "capacity": 200.0,
        "limit_per_minute": 600.0,
        "reset_after_s": 0.0,
    }
    assert a["buckets"]["requests"] is None
    assert (a["in_flight"], a["levels_from"]) == (0, "memory")
    assert a["recent_429s"] == {"window_s": 300.0, "total": 0, "by_reason": {}}
    assert b["buckets"] == {"tokens": None, "requests": None}


async def test_shows_levels_in_flight_and_recent_429s(start_tenant_gateway: StartTenantGateway) -> None:
    script = Scripted()
    both = asyncio.Barrier(3)

    async def hang_both(request: web.Request) -> web.StreamResponse:
        await both.wait()
        return await script.hang(request)

    gw = await start_tenant_gateway(hang_both, settings=tight)
    held = [asyncio.create_task(gw.post()) for _ in range(2)]
    await asyncio.wait_for(both.wait(), 10)
    refused = await gw.post()
    during = await _tenant(gw)
    script.release.set()
    assert [r.status for r in await asyncio.gather(*held)] == [200, 200]
    await gw.tenancy.budget.drain()
    gw.clock.advance(1.0)  # 10 tokens of refill
    after = await _tenant(gw)

    assert refused.status == 429
    assert during["in_flight"] == 2
    assert during["buckets"]["tokens"]["remaining"] == 120.0  # 200 - 2 x 40
    assert during["recent_429s"]["by_reason"] == {"concurrency": 1}
    assert after["in_flight"] == 0
    assert after["buckets"]["tokens"]["remaining"] == 130.0
    assert after["recent_429s"]["total"] == 1


async def test_reading_takes_nothing(start_tenant_gateway: StartTenantGateway) -> None:
    gw = await start_tenant_gateway(Scripted().answer, settings=tight)
    for _ in range(20):
        await _tenant(gw)
    assert [(await gw.post()).status for _ in range(2)] == [200, 200]


async def test_an_unknown_tenant_is_a_404(start_tenant_gateway: StartTenantGateway) -> None:
    gw = await start_tenant_gateway(Scripted().answer, settings=tight)
    resp = await gw.client.get("/sluice/v1/tenants/team-z")
    body = await resp.json()

    assert resp.status == 404
    assert body["error"]["code"] == "tenant_not_found"
    assert "team-z" in body["error"]["message"]


async def test_needs_the_admin_token_when_one_is_set(start_tenant_gateway: StartTenantGateway) -> None:
    gw = await start_tenant_gateway(Scripted().answer, settings=guarded)
    without = await gw.client.get("/sluice/v1/tenants")
    tenant_key = await gw.client.get("/sluice/v1/tenants", headers=bearer("sk-test-team-a-7f3c9e1d2b"))

    assert (without.status, tenant_key.status) == (401, 401)
    assert (await _tenant(gw, token=ADMIN_TOKEN))["id"] == "team-a"


def _gauge(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {name} in the exposition")


async def test_gauges_follow_the_settle_and_refill_of_an_idle_tenant(
    start_tenant_gateway: StartTenantGateway,
) -> None:
    script = Scripted()
    gw = await start_tenant_gateway(script.hang, settings=tight)
    metrics = gw.app[METRICS]
    admin = gw.app[TENANTS_ADMIN]
    held = asyncio.create_task(gw.post())
    await asyncio.wait_for(script.arrived.wait(), 10)
    scraped = metrics.exposition()[0].decode()
    remaining = 'sluice_tenant_bucket_remaining{bucket="tokens",tenant="team-a"}'
    in_flight = 'sluice_tenant_in_flight_requests{tenant="team-a"}'
    assert (_gauge(scraped, remaining), _gauge(scraped, in_flight)) == (160.0, 1.0)
    script.release.set()
    await held
    await gw.tenancy.budget.drain()
    gw.clock.advance(2.0)  # idle: 20 tokens of refill, no request
    await admin.refresh_gauges(metrics)
    scraped = metrics.exposition()[0].decode()

    assert (_gauge(scraped, remaining), _gauge(scraped, in_flight)) == (180.0, 0.0)


def test_recent_refusals_forget_what_left_the_window() -> None:
    clock = FakeClock()
    recent = RecentRefusals(slot_s=10.0, slots=3, max_keys=2, clock=clock)
    recent.count("a", "tokens")
    clock.advance(10.0)
    recent.count("a", "tokens")
    recent.count("a", "concurrency")
    recent.count("a", "requests")  # a third pair: beyond max_keys, counted as "other"
    assert recent.by_reason("a") == {"tokens": 2, "concurrency": 1, "other": 1}
    clock.advance(20.0)
    assert recent.by_reason("a") == {"tokens": 1, "concurrency": 1, "other": 1}
    clock.advance(10.0)
    assert recent.by_reason("a") == {}
    assert recent.by_reason("b") == {}


async def test_the_running_gateway_refreshes_the_gauges_on_its_own(
    start_tenant_gateway: StartTenantGateway,
) -> None:
    gw = await start_tenant_gateway(Scripted().answer, settings=tight)
    metrics = gw.app[METRICS]
    remaining = 'sluice_tenant_bucket_remaining{bucket="tokens",tenant="team-a"}'
    assert (await gw.post()).status == 200
    await gw.tenancy.budget.drain()
    assert _gauge(metrics.exposition()[0].decode(), remaining) == 160.0
    gw.clock.advance(3.0)  # idle: 30 tokens of refill, no request, no explicit refresh

    await wait_for(lambda: _gauge(metrics.exposition()[0].decode(), remaining) == 190.0, scaled(10.0))
