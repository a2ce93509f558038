"""Tenants meet admission on the live path (real HTTP, a fake replica, a real ``MemoryLimiter``):
the class header is honoured only for the classes a tenant may use, and a request whose client
leaves while it waits in Sluice's queue is dropped there with its budget reservation settled
(nothing charged: it never reached a replica)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import pytest

from gateway.admission import AdmissionSettings, ClassSettings, Outcome, RetryAfterSettings
from gateway.admission.live import ADMISSION
from gateway.config.settings import Settings
from gateway.limits.config import LimitsSettings, TokenWeightSettings
from gateway.limits.memory import MemoryLimiter
from gateway.tenants import TenantSettings, TenantsSettings, hash_api_key
from gateway.tenants.live import TENANCY
from tests.unit.gateway.fakes import FakeReplica, gateway_settings, make_app, url_of, wait_for
from tests.unit.limits.fakes import FakeClock
from tests.unit.tenancy.conftest import (
    COMPLETION,
    GENEROUS,
    KEY_A,
    RESERVED,
    Scripted,
    StartTenantGateway,
    bearer,
    tenancy_settings,
)
from tests.unit.tenancy.test_middleware import production_runner

#: Tenants and the classes they may ask for by header.
KEYS = {
    "any": "sk-test-class-any-1a2b3c",  # no policy: any configured class
    "interactive-only": "sk-test-class-io-4d5e6f",  # may use interactive only; no default
    "batch-by-default": "sk-test-class-bd-7a8b9c",  # batch unless it asks for interactive
    "batch-only": "sk-test-class-bo-0d1e2f",  # batch, whatever it asks for
}


def class_settings(replica_url: str) -> Settings:
    base = gateway_settings({"r1": replica_url})
    policies: dict[str, dict[str, Any]] = {
        "any": {},
        "interactive-only": {"allowed_classes": ["interactive"]},
        "batch-by-default": {"default_class": "batch", "allowed_classes": ["batch", "interactive"]},
        "batch-only": {"default_class": "batch", "allowed_classes": ["batch"]},
    }
    tenants = {
        name: TenantSettings(api_keys=[hash_api_key(KEYS[name])], **policy)
        for name, policy in policies.items()
    }
    return Settings(
        replicas=base.replicas,
        health=base.health,
        server=base.server,
        scrape=base.scrape,
        tenants=TenantsSettings(tenants=tenants),
        limits=LimitsSettings(token_weights=TokenWeightSettings(prompt=1.0, output=2.0)),
    )


@pytest.mark.parametrize(
    ("tenant", "header", "expected"),
    [
        pytest.param("any", None, "interactive", id="no-policy-no-header-admission-default"),
        pytest.param("any", "batch", "batch", id="no-policy-header-honoured"),
        pytest.param("interactive-only", "batch", "interactive", id="not-allowed-header-ignored"),
        pytest.param("interactive-only", "interactive", "interactive", id="allowed-header"),
        pytest.param("batch-by-default", None, "batch", id="tenant-default"),
        pytest.param("batch-by-default", "interactive", "interactive", id="allowed-header-beats-default"),
        pytest.param("batch-only", "interactive", "batch", id="cannot-promote-itself"),
        pytest.param("batch-only", "no-such-class", "batch", id="unknown-class-ignored"),
    ],
)
async def test_the_class_header_is_honoured_only_for_classes_the_tenant_may_use(
    start_tenant_gateway: StartTenantGateway, tenant: str, header: str | None, expected: str
) -> None:
    gw = await start_tenant_gateway(Scripted().answer, settings=class_settings)
    targets = AdmissionSettings().classes[expected]

    resp = await gw.post(KEYS[tenant], headers={} if header is None else {"x-sluice-class": header})
    await resp.read()

    assert resp.status == 200
    assert resp.headers["x-sluice-class"] == expected
    (outcome,) = gw.outcomes
    assert (outcome.tenant, outcome.request_class) == (tenant, expected)
    assert (outcome.ttft_target_s, outcome.tpot_target_s) == (targets.ttft_target_s, targets.tpot_target_s)


def one_at_a_time(replica_url: str) -> Settings:
    """``tenancy_settings`` with admission letting one request at a time onto the (uncalibrated)
    replica and queueing the rest for up to 30 s."""
    admission = AdmissionSettings(
        unmodelled_max_in_flight=1,
        retry_after=RetryAfterSettings(no_replica_s=0.2),
        classes={"interactive": ClassSettings(max_queue_wait_s=30.0)},
    )
    return tenancy_settings(replica_url).model_copy(update={"admission": admission})


async def _level(limiter: MemoryLimiter) -> float:
    """team-a's token bucket level now (a zero-cost probe, settled at once)."""
    probe = limiter.reserve_now("team-a", cost_tokens=0.0, limits=GENEROUS.to_limits(), request_id="probe")
    assert probe.tokens is not None
    limiter.settle_now(probe, actual_cost_tokens=0.0)
    return probe.tokens.remaining


async def test_client_gone_while_queued_is_dropped_and_its_reservation_settled(aiohttp_server: Any) -> None:
    """Served as ``run_app`` serves it (the disconnect monitor, not a handler cancellation, notices)."""
    script = Scripted()
    replica = FakeReplica(handler=script.hang)
    replica_server = await aiohttp_server(replica.app())
    app, _, outcomes = make_app(one_at_a_time(await url_of(replica_server)))
    limiter = MemoryLimiter(clock=FakeClock())
    tenancy = app[TENANCY]
    tenancy.use_limiter(limiter)
    async with production_runner(app) as url, aiohttp.ClientSession() as client:
        admission = app[ADMISSION]

        async def post() -> aiohttp.ClientResponse:
            return await client.post(url + "/v1/completions", json=COMPLETION, headers=bearer(KEY_A))

        first = asyncio.create_task(post())
        await asyncio.wait_for(script.arrived.wait(), 10)
        leaving = asyncio.create_task(post())
        await wait_for(lambda: admission.queued() == 1)
        assert await limiter.in_flight("team-a") == 2  # both reserved their budget
        assert await _level(limiter) == pytest.approx(1000.0 - 2 * RESERVED)

        leaving.cancel()  # its client closes the connection while it waits
        with contextlib.suppress(asyncio.CancelledError):
            await leaving
        await wait_for(lambda: admission.queued() == 0, timeout_s=5.0)
        await wait_for(lambda: tenancy.budget.settles_started == 1, timeout_s=5.0)
        await tenancy.budget.drain()

        # Dropped from the queue, never sent, its reservation given back in full.
        assert len(replica.seen) == 1
        (gone,) = outcomes
        assert (gone.decision, gone.reason) == ("cancelled", "client_disconnected")
        assert (gone.status, gone.error) == (499, "client_disconnected")
        assert gone.replica is None
        assert admission.stats.count(outcome=Outcome.CANCELLED) == 1
        assert (limiter.stats.settles_total, limiter.stats.settles_noop_total) == (1, 0)
        assert await limiter.in_flight("team-a") == 1
        assert await _level(limiter) == pytest.approx(1000.0 - RESERVED)

        script.release.set()
        async with await first as resp:
            assert resp.status == 200
        await wait_for(lambda: tenancy.budget.settles_started == 2, timeout_s=5.0)
        await tenancy.budget.drain()
        assert await limiter.in_flight("team-a") == 0
