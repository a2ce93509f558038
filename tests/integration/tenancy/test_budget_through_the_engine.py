"""A tenant over its budget is refused by the admission engine, with the answer it always had.

A real gateway (``build_app``, served over TCP as ``run_app`` serves it), the test's own
``redis-server`` holding the tenant's bucket, a real emulated replica. The budget is the engine's
port (``AdmissionEngine.budget_cost`` prices it; the tenancy middleware only authenticates), and
its refusals keep their status, ``Retry-After``, ``x-ratelimit-*`` headers, OpenAI body and
access-log fields. Routes that bypass admission (``/v1/models``, ``/metrics``, ``/healthz``)
touch no budget: Redis runs no script for them and they carry no ``x-ratelimit-*`` header.
"""

from __future__ import annotations

import math
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.admission.live import ADMISSION
from gateway.app import build_app
from gateway.config.settings import Settings
from gateway.config.store import SettingsStore
from gateway.http.rate_limit_headers import go_duration
from gateway.keys import OUTCOME_LISTENERS
from gateway.observability.outcome import RequestOutcome
from gateway.tenants.live import TENANCY
from tests.integration.tenancy.fleet import (
    KEY,
    MAX_TOKENS,
    PROMPT_TOKENS,
    RESERVED,
    TENANT,
    emulator,
    gateway_config,
    model_of,
)
from tests.support.procs import free_port
from tests.support.redis import RedisNotInstalled, RedisServer, redis_server

pytestmark = pytest.mark.timeout(120)

#: One weighted token a second, 40 at once: one request of 32 fits, a second must wait ~24 s.
TOKENS_PER_MINUTE = 60.0
TOKEN_BURST = 40.0
BEARER = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def replica() -> Iterator[str]:
    with emulator(seed=3) as url:
        yield url


@pytest.fixture
def redis_proc() -> Iterator[RedisServer]:
    try:
        with redis_server(name="redis-engine-budget") as server:
            yield server
    except RedisNotInstalled as exc:
        pytest.fail(str(exc))


@asynccontextmanager
async def serve(app: web.Application) -> AsyncIterator[str]:
    """Serve ``app`` on a free port as ``web.run_app`` does; yields its URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        await runner.cleanup()


def _script_calls(redis: RedisServer) -> int:
    with redis.client() as client:
        stats = client.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


def _ratelimit(resp: aiohttp.ClientResponse) -> dict[str, str]:
    return {k.lower(): v for k, v in resp.headers.items() if k.lower().startswith("x-ratelimit-")}


async def _post(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[aiohttp.ClientResponse, Any]:
    async with session.post(url + "/v1/completions", json=body, headers=BEARER) as resp:
        return resp, await resp.json()


async def test_a_budget_refusal_comes_from_the_engine_unchanged(
    replica: str, redis_proc: RedisServer
) -> None:
    limits = {
        "backend": "redis",
        "redis": {"url": redis_proc.url, "timeout_s": 2.0},
        "on_storage_error": "fail_closed",
    }
    tenant_limits = {"tokens_per_minute": TOKENS_PER_MINUTE, "token_burst": TOKEN_BURST}
    config = gateway_config(replica, free_port(), limits=limits, tenant_limits=tenant_limits)
    app = build_app(SettingsStore(Settings.model_validate(config)), spawn_emulators=False)
    outcomes: list[RequestOutcome] = []
    app[OUTCOME_LISTENERS].append(outcomes.append)
    async with serve(app) as url, aiohttp.ClientSession() as session:
        model = await model_of(url)
        body = {"model": model, "prompt": [11] * PROMPT_TOKENS, "max_tokens": MAX_TOKENS}

        # The engine holds the budget port and prices a request as the middleware used to.
        engine = app[ADMISSION].engine
        sized = engine.request(
            "probe",
            model,
            prompt_tokens=PROMPT_TOKENS,
            max_tokens=MAX_TOKENS,
            request_class="interactive",
            arrival_s=0.0,
            tenant=TENANT,
        )
        assert engine.budget_cost(sized) == RESERVED

        # Routes that bypass admission touch no budget.
        before = _script_calls(redis_proc)
        for path in ("/v1/models", "/metrics", "/healthz"):
            async with session.get(url + path, headers=BEARER) as resp:
                assert resp.status == 200
                assert _ratelimit(resp) == {}
        assert _script_calls(redis_proc) == before

        # Never fits: 40 + 2 x 8 = 56 > 40. Not retryable; the full bucket in the headers.
        oversize, error = await _post(session, url, {**body, "prompt": [11] * 40})
        assert oversize.status == 429
        assert "Retry-After" not in oversize.headers
        assert oversize.headers["x-should-retry"] == "false"
        assert _ratelimit(oversize) == {
            "x-ratelimit-limit-tokens": "60",
            "x-ratelimit-remaining-tokens": "40",
            "x-ratelimit-reset-tokens": "0s",
        }
        assert error == {
            "error": {
                "message": f"Request too large for tenant {TENANT} on weighted tokens per min (TPM): "
                "Limit 60, Burst 40, Requested 56. Lower max_tokens or shorten the prompt (or raise the "
                "tenant's token_burst).",
                "type": "rate_limit_exceeded",
                "param": None,
                "code": "rate_limit_exceeded",
            }
        }

        # Fits: 32 of the 40 reserved, 8 left, full again in 32 s.
        allowed, answer = await _post(session, url, body)
        assert allowed.status == 200, answer
        assert _ratelimit(allowed) == {
            "x-ratelimit-limit-tokens": "60",
            "x-ratelimit-remaining-tokens": "8",
            "x-ratelimit-reset-tokens": "32s",
        }
        await app[TENANCY].budget.drain()
        assert app[TENANCY].budget.settles_started == 1  # the refusals held nothing

        # Spent: refused until the bucket refills to this request (about 24 s short of 32),
        # jittered up to half as much again.
        refused, error = await _post(session, url, body)
        assert refused.status == 429
        wait_ms = int(refused.headers["retry-after-ms"])
        assert 20_000 < wait_ms <= 36_000
        assert refused.headers["Retry-After"] == str(math.ceil(wait_ms / 1000))
        assert _ratelimit(refused)["x-ratelimit-limit-tokens"] == "60"
        assert int(_ratelimit(refused)["x-ratelimit-remaining-tokens"]) < RESERVED
        assert (error["error"]["type"], error["error"]["code"], error["error"]["param"]) == (
            "rate_limit_exceeded",
            "rate_limit_exceeded",
            None,
        )
        # OpenAI's words; the wait is the one Retry-After sends (retry-after-ms, in Go's syntax).
        remaining = int(_ratelimit(refused)["x-ratelimit-remaining-tokens"])
        assert error["error"]["message"] == (
            f"Rate limit reached for tenant {TENANT} on weighted tokens per min (TPM): Limit 60, Burst 40, "
            f"Used {40 - remaining}, Requested {RESERVED}. Please try again in {go_duration(wait_ms / 1000)}."
        )

    # The access-log fields of the refusals: no class judged, never sent, the wait sent.
    refusals = [o for o in outcomes if o.status == 429]
    assert len(refusals) == 2
    assert [o.reason for o in refusals] == ["oversize", "tokens"]
    for outcome in refusals:
        assert (outcome.tenant, outcome.decision) == (TENANT, "rejected")
        assert (outcome.request_class, outcome.replica, outcome.error) == (None, None, "rate_limit_exceeded")
    assert refusals[0].retry_after_s is None
    assert refusals[1].retry_after_s == pytest.approx(wait_ms / 1000, abs=0.002)
