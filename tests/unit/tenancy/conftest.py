"""A gateway with tenants in front of a fake replica whose answers a test controls (real HTTP).

The limiter is a real ``MemoryLimiter`` on a hand-driven clock, so bucket levels, Retry-After and
the ``x-ratelimit-*`` headers are exact numbers. Requests go to ``/v1/completions`` with the prompt
as token ids: the reservation's prompt estimate is then exact (20 tokens), and ``max_tokens: 10``
caps the predicted output at 10, so a request reserves 20 + 2 x 10 = 40 weighted tokens.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.config.settings import Settings
from gateway.limits.base import LimiterStats, TenantLimits
from gateway.limits.config import LimitsSettings, TenantLimitSettings, TokenWeightSettings
from gateway.limits.memory import MemoryLimiter
from gateway.observability.outcome import RequestOutcome
from gateway.tenants import AuthSettings, TenantSettings, TenantsSettings, hash_api_key
from gateway.tenants.live import TENANCY, Tenancy
from predictor import StepModel, StepParams
from tests.unit.gateway.fakes import MODEL, FakeReplica, gateway_settings, make_app, url_of
from tests.unit.limits.fakes import FakeClock

KEY_A = "sk-test-team-a-7f3c9e1d2b"
KEY_B = "sk-test-team-b-0a8d6c4e5f"
ADMIN_TOKEN = "sk-admin-test-93b1c7"
PROMPT_TOKENS = 20
MAX_TOKENS = 10
#: What one request reserves with weights prompt 1, output 2.
RESERVED = PROMPT_TOKENS + 2 * MAX_TOKENS
COMPLETION: dict[str, Any] = {"model": MODEL, "prompt": [7] * PROMPT_TOKENS, "max_tokens": MAX_TOKENS}
GENEROUS = TenantLimitSettings(tokens_per_minute=600.0, token_burst=1000.0)


def fitted_step_model(per_decode_seq_s: float) -> StepModel:
    """A fitted-looking step model for pricing tests: 10 ms a step, 20 us per prompt token,
    ``per_decode_seq_s`` per decoding sequence (its output token's GPU time over a prompt token's
    grows with it)."""
    return StepModel(
        StepParams(
            base_s=0.010,
            per_token_s=0.0,
            per_decode_seq_s=per_decode_seq_s,
            per_compute_token_s=20e-6,
            per_kv_token_s=0.0,
            knee_tokens=200.0,
        )
    )


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def tenancy_settings(
    replica_url: str,
    *,
    limits: TenantLimitSettings = GENEROUS,
    auth: AuthSettings | None = None,
    with_tenants: bool = True,
) -> Settings:
    """One replica; tenants ``team-a`` (``KEY_A``, ``limits``) and ``team-b`` (``KEY_B``,
    unlimited); token weights pinned to prompt 1, output 2."""
    base = gateway_settings({"r1": replica_url})
    tenants = TenantsSettings(
        auth=auth or AuthSettings(),
        tenants={
            "team-a": TenantSettings(api_keys=[hash_api_key(KEY_A)], limits=limits),
            "team-b": TenantSettings(api_keys=[hash_api_key(KEY_B)]),
        }
        if with_tenants
        else {},
    )
    return Settings(
        replicas=base.replicas,
        health=base.health,
        server=base.server,
        scrape=base.scrape,
        tenants=tenants,
        limits=LimitsSettings(token_weights=TokenWeightSettings(prompt=1.0, output=2.0)),
    )


def usage_json(prompt: int = PROMPT_TOKENS, completion: int = MAX_TOKENS) -> dict[str, Any]:
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "model": MODEL,
        "choices": [{"index": 0, "text": "x" * completion, "finish_reason": "length"}],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }


def completion_chunk(text: str) -> bytes:
    payload = {
        "id": "cmpl-1",
        "object": "text_completion",
        "model": MODEL,
        "choices": [{"index": 0, "text": text}],
    }
    return f"data: {json.dumps(payload)}\n\n".encode()


@dataclass
class Scripted:
    """Replica behaviours a test picks: answer with usage, stream, fail, or hang until released."""

    usage: tuple[int, int] = (PROMPT_TOKENS, MAX_TOKENS)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    async def answer(self, request: web.Request) -> web.StreamResponse:
        self.arrived.set()
        return web.json_response(usage_json(*self.usage))

    async def stream(self, request: web.Request) -> web.StreamResponse:
        self.arrived.set()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        prompt, completion = self.usage
        for _ in range(completion):
            await response.write(completion_chunk("x"))
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def fail(self, request: web.Request) -> web.StreamResponse:
        self.arrived.set()
        return web.json_response({"error": {"message": "boom"}}, status=500)

    async def hang(self, request: web.Request) -> web.StreamResponse:
        """Hold the request (JSON answer) until ``release`` is set."""
        self.arrived.set()
        await self.release.wait()
        return web.json_response(usage_json(*self.usage))

    async def stream_then_hang(self, request: web.Request) -> web.StreamResponse:
        """Stream two tokens, then nothing until ``release`` is set (a client may leave meanwhile)."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(completion_chunk("a") + completion_chunk("b"))
        self.arrived.set()
        await self.release.wait()
        return response


@dataclass
class TenantGateway:
    client: TestClient[web.Request, web.Application]
    app: web.Application
    tenancy: Tenancy
    limiter: MemoryLimiter
    stats: LimiterStats
    clock: FakeClock
    outcomes: list[RequestOutcome]
    replica: FakeReplica
    replica_server: TestServer

    async def post(
        self,
        key: str | None = KEY_A,
        body: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        sent = {**(headers or {}), **({} if key is None else bearer(key))}
        return await self.client.post("/v1/completions", json=body or COMPLETION, headers=sent)

    async def level(self, tenant: str = "team-a", limits: TenantLimits | None = None) -> float:
        """The tenant's token bucket level now (a zero-cost probe, settled at once)."""
        chosen = limits or GENEROUS.to_limits()
        probe = self.limiter.reserve_now(tenant, cost_tokens=0.0, limits=chosen, request_id="probe")
        assert probe.tokens is not None
        self.limiter.settle_now(probe, actual_cost_tokens=0.0)
        return probe.tokens.remaining


StartTenantGateway = Callable[..., Awaitable[TenantGateway]]


@pytest.fixture
async def start_tenant_gateway(aiohttp_server: Any, aiohttp_client: Any) -> StartTenantGateway:
    """Start a fake replica (``handler``) and a gateway with tenants in front of it."""

    async def start(
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]] | None = None,
        *,
        settings: Callable[[str], Settings] = tenancy_settings,
    ) -> TenantGateway:
        replica = FakeReplica(handler=handler)
        server = await aiohttp_server(replica.app())
        app, _store, outcomes = make_app(settings(await url_of(server)))
        clock = FakeClock()
        stats = LimiterStats()
        limiter = MemoryLimiter(clock=clock, stats=stats)
        tenancy = app[TENANCY]
        tenancy.use_limiter(limiter)
        client = await aiohttp_client(app)
        return TenantGateway(client, app, tenancy, limiter, stats, clock, outcomes, replica, server)

    return start
