"""A request placed again after a replica's own overload refusal is reserved once and settled once.

Real HTTP through a gateway with tenants in front of fake replicas, a real ``MemoryLimiter`` on a
hand-driven clock (see ``conftest``). A replica answers 429 (its own refusal): admission places
the request on another replica with the reservation it already holds, or, when none is left,
refuses it with Sluice's 429 and gives the reservation back whole.
"""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web

from gateway.config.settings import Settings
from gateway.limits.base import LimiterStats
from gateway.limits.memory import MemoryLimiter
from gateway.tenants.live import TENANCY
from tests.unit.gateway.fakes import FakeReplica, gateway_settings, make_app, url_of
from tests.unit.limits.fakes import FakeClock
from tests.unit.tenancy.conftest import (
    COMPLETION,
    GENEROUS,
    KEY_A,
    RESERVED,
    Scripted,
    bearer,
    tenancy_settings,
)


async def refuse(request: web.Request) -> web.StreamResponse:
    """A replica's own overload refusal (TGI past its concurrency limit)."""
    return web.json_response({"error": "Model is overloaded"}, status=429, headers={"Retry-After": "1"})


def _settings(urls: dict[str, str]) -> Settings:
    base = tenancy_settings(next(iter(urls.values())))
    return base.model_copy(update={"replicas": gateway_settings(urls).replicas})


async def _gateway(
    aiohttp_server: Any, aiohttp_client: Any, handlers: dict[str, Any]
) -> tuple[Any, Any, Any]:
    urls = {}
    replicas = {}
    for name, handler in handlers.items():
        replicas[name] = FakeReplica(handler=handler)
        urls[name] = await url_of(await aiohttp_server(replicas[name].app()))
    app, _, outcomes = make_app(_settings(urls))
    stats = LimiterStats()
    limiter = MemoryLimiter(clock=FakeClock(), stats=stats)
    app[TENANCY].use_limiter(limiter)
    client = await aiohttp_client(app)
    return client, app, (limiter, stats, outcomes, replicas)


async def _level(limiter: MemoryLimiter) -> float:
    probe = limiter.reserve_now("team-a", cost_tokens=0.0, limits=GENEROUS.to_limits(), request_id="probe")
    assert probe.tokens is not None
    limiter.settle_now(probe, actual_cost_tokens=0.0)
    return probe.tokens.remaining


async def test_placed_again_on_another_replica_with_the_same_reservation(
    aiohttp_server: Any, aiohttp_client: Any
) -> None:
    client, app, (limiter, stats, outcomes, replicas) = await _gateway(
        aiohttp_server, aiohttp_client, {"r1": refuse, "r2": Scripted(usage=(7, 3)).answer}
    )
    # The first placement goes to one of the two; make it the refusing one by trying until it is.
    for _ in range(8):
        resp = await client.post("/v1/completions", json=COMPLETION, headers=bearer(KEY_A))
        assert resp.status == 200
        if replicas["r1"].seen:
            break
    assert replicas["r1"].seen, "never placed on r1 first"
    budget = app[TENANCY].budget
    await budget.drain()
    answered = len(outcomes)
    # One reservation and one settle per request, the refused placement's included.
    assert stats.reserves_total == answered
    assert (budget.settles_started, stats.settles_total, stats.settles_noop_total) == (answered, answered, 0)
    assert await limiter.in_flight("team-a") == 0
    # Each charged its usage (7 + 2 x 3), nothing for the refused placement.
    assert await _level(limiter) == pytest.approx(1000.0 - answered * 13.0)
    assert resp.headers["x-ratelimit-remaining-tokens"] == str(int(1000.0 - (answered - 1) * 13.0 - RESERVED))


async def test_refused_by_every_replica_gives_the_reservation_back(
    aiohttp_server: Any, aiohttp_client: Any
) -> None:
    client, app, (limiter, stats, _, replicas) = await _gateway(
        aiohttp_server, aiohttp_client, {"r1": refuse}
    )

    resp = await client.post("/v1/completions", json=COMPLETION, headers=bearer(KEY_A))

    assert resp.status == 429
    assert (await resp.json())["error"]["code"] == "overloaded"
    # Refunded whole (nothing was charged): the headers show the bucket as it stands.
    assert resp.headers["x-ratelimit-remaining-tokens"] == "1000"
    budget = app[TENANCY].budget
    await budget.drain()
    assert len(replicas["r1"].seen) == 1
    assert stats.reserves_total == 1
    assert (budget.settles_started, stats.settles_total, stats.settles_noop_total) == (1, 1, 0)
    assert await limiter.in_flight("team-a") == 0
    # Its next placement was refused before reaching a replica: nothing charged.
    assert await _level(limiter) == pytest.approx(1000.0)
