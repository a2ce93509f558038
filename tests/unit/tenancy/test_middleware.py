"""The tenancy middleware end to end through a real gateway and a real (fake) replica over HTTP.

Authentication, the 429's exact headers, settling exactly once whatever ends the request, the
admin guard, reloads, and keys kept out of logs and metrics. The limiter is a real
``MemoryLimiter`` on a hand-driven clock (see ``conftest``); nothing here sleeps.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.admission.config import RetryAfterSettings
from gateway.admission.retry_after import RefusalReason, retry_after
from gateway.config.settings import Settings
from gateway.http.errors import Refused, error_response
from gateway.http.rate_limit_headers import go_duration
from gateway.keys import STORE
from gateway.limits.config import TenantLimitSettings
from gateway.limits.failover import FailoverLimiter
from gateway.limits.memory import MemoryLimiter
from gateway.limits.redis import RedisLimiter, connect
from gateway.observability.log_format import JsonFormatter, TextFormatter
from gateway.observability.outcome import RequestOutcome
from gateway.tenants import AuthSettings, TenantSettings, TenantsSettings, hash_api_key
from gateway.tenants.live import TENANCY
from tests.support.procs import free_port
from tests.unit.gateway.fakes import FakeReplica, make_app, url_of, wait_for
from tests.unit.limits.fakes import FakeClock
from tests.unit.tenancy.conftest import (
    ADMIN_TOKEN,
    COMPLETION,
    GENEROUS,
    KEY_A,
    KEY_B,
    PROMPT_TOKENS,
    Scripted,
    StartTenantGateway,
    bearer,
    tenancy_settings,
)

# -- authentication ----------------------------------------------------------------------------------

MISSING = "You didn't provide an API key."
UNKNOWN = "Incorrect API key provided."
MALFORMED = "Malformed Authorization header"


@pytest.mark.parametrize(
    ("headers", "status", "message", "challenge"),
    [
        pytest.param({}, 401, MISSING, 'Bearer realm="sluice"', id="no-header"),
        pytest.param({"Authorization": ""}, 401, MISSING, 'Bearer realm="sluice"', id="empty-header"),
        pytest.param(
            {"Authorization": "Basic dXNlcjpwYXNz"},
            401,
            MALFORMED,
            'Bearer realm="sluice", error="invalid_token"',
            id="not-bearer",
        ),
        pytest.param(
            bearer("sk-not-a-key-of-anyone"),
            401,
            UNKNOWN,
            'Bearer realm="sluice", error="invalid_token"',
            id="unknown-key",
        ),
        pytest.param(bearer(KEY_A), 200, None, None, id="valid-key"),
        pytest.param({"Authorization": f"bearer   {KEY_A}  "}, 200, None, None, id="scheme-any-case"),
    ],
)
async def test_authentication(
    start_tenant_gateway: StartTenantGateway,
    headers: dict[str, str],
    status: int,
    message: str | None,
    challenge: str | None,
) -> None:
    gw = await start_tenant_gateway(Scripted().answer)

    resp = await gw.client.post("/v1/completions", json=COMPLETION, headers=headers)

    assert resp.status == status
    if message is None:
        return
    body = await resp.json()
    assert body["error"]["message"].startswith(message)
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] == "invalid_api_key"
    assert resp.headers["WWW-Authenticate"] == challenge
    assert gw.replica.seen == []  # refused before the replica saw anything
    assert gw.outcomes[-1].status == 401  # the outcome listeners hear of it


@pytest.mark.parametrize(
    "spoof",
    [
        {"x-sluice-tenant": "team-b"},
        {"x-tenant": "team-b", "OpenAI-Organization": "team-b"},
    ],
    ids=["sluice-header", "openai-organization"],
)
async def test_the_key_alone_names_the_tenant(
    start_tenant_gateway: StartTenantGateway, spoof: dict[str, str]
) -> None:
    gw = await start_tenant_gateway(Scripted().answer)

    resp = await gw.post(KEY_A, body={**COMPLETION, "user": "team-b"}, headers=spoof)
    await gw.tenancy.budget.drain()

    assert resp.status == 200
    assert gw.outcomes[-1].tenant == "team-a"
    assert gw.stats.settles_total == 1  # charged to team-a's limited budget, not team-b's


async def test_anonymous_tenant_takes_keyless_requests(start_tenant_gateway: StartTenantGateway) -> None:
    def settings(url: str) -> Any:
        return tenancy_settings(url, auth=AuthSettings(anonymous_tenant="team-b"))

    gw = await start_tenant_gateway(Scripted().answer, settings=settings)

    keyless = await gw.post(None)
    wrong = await gw.post("sk-wrong-key")

    assert keyless.status == 200
    assert gw.outcomes[0].tenant == "team-b"
    assert wrong.status == 401  # a wrong key is refused even when keys are optional


async def test_without_tenants_any_key_passes_through(start_tenant_gateway: StartTenantGateway) -> None:
    """No tenant configured: tenancy is off; an SDK's placeholder key reaches the replica."""
    gw = await start_tenant_gateway(
        Scripted().answer, settings=lambda url: tenancy_settings(url, with_tenants=False)
    )

    resp = await gw.post("EMPTY")

    assert resp.status == 200
    assert gw.replica.seen[0].headers["authorization"] == "Bearer EMPTY"
    assert gw.tenancy.budget.settles_started == 0  # nothing reserved, nothing to settle


async def test_tenant_key_never_reaches_the_replica(start_tenant_gateway: StartTenantGateway) -> None:
    """The key authenticates the tenant to Sluice only; the replica must not learn it."""
    gw = await start_tenant_gateway(Scripted().answer)

    resp = await gw.post(KEY_A)

    assert resp.status == 200
    assert "authorization" not in {k.lower() for k in gw.replica.seen[0].headers}


async def test_reload_swaps_the_keys(start_tenant_gateway: StartTenantGateway) -> None:
    gw = await start_tenant_gateway(Scripted().answer)
    store = gw.app[STORE]
    new_key = "sk-rotated-key-5e2f"
    tenants = TenantsSettings(
        tenants={"team-a": TenantSettings(api_keys=[hash_api_key(new_key)], limits=GENEROUS)}
    )

    store.swap(store.current.model_copy(update={"tenants": tenants}))

    assert (await gw.post(KEY_A)).status == 401
    assert (await gw.post(new_key)).status == 200


# -- 429: exact numbers ------------------------------------------------------------------------------

#: 10 weighted tokens and 1 request per second; buckets of 100 tokens and 10 requests.
TIGHT = TenantLimitSettings(
    tokens_per_minute=600.0, token_burst=100.0, requests_per_minute=60.0, request_burst=10.0
)


def tight(url: str) -> Settings:
    return tenancy_settings(url, limits=TIGHT)


async def test_429_headers_are_exact(start_tenant_gateway: StartTenantGateway) -> None:
    """Each request reserves 40 and uses 40 (the replica reports 20 + 10 tokens)."""
    gw = await start_tenant_gateway(Scripted().answer, settings=tight)

    first = await gw.post()
    await gw.tenancy.budget.drain()
    second = await gw.post()
    await gw.tenancy.budget.drain()
    third = await gw.post()

    assert (first.status, second.status, third.status) == (200, 200, 429)
    assert _ratelimit(first) == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "9",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "600",
        "x-ratelimit-remaining-tokens": "60",
        "x-ratelimit-reset-tokens": "4s",
    }
    assert _ratelimit(third) == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "8",
        "x-ratelimit-reset-requests": "2s",
        "x-ratelimit-limit-tokens": "600",
        "x-ratelimit-remaining-tokens": "20",
        "x-ratelimit-reset-tokens": "8s",
    }
    # 40 needed, 20 left, 10 per second: 2 s, jittered up to half as much again.
    wait_ms = int(third.headers["retry-after-ms"])
    assert 2000 <= wait_ms <= 3000
    assert third.headers["Retry-After"] == str(math.ceil(wait_ms / 1000))
    error = (await third.json())["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "rate_limit_exceeded",
        "rate_limit_exceeded",
        None,
    )
    # OpenAI's words: the budget, its limit and burst, what is used and what this one asked for.
    assert error["message"] == (
        "Rate limit reached for tenant team-a on weighted tokens per min (TPM): Limit 600, Burst 100, "
        f"Used 80, Requested 40. Please try again in {go_duration(wait_ms / 1000)}."
    )
    assert len(gw.replica.seen) == 2
    outcome = gw.outcomes[-1]
    assert (outcome.decision, outcome.reason) == ("rejected", "tokens")
    assert outcome.retry_after_s == pytest.approx(wait_ms / 1000, abs=0.001)

    gw.clock.advance(wait_ms / 1000)
    assert (await gw.post()).status == 200


@pytest.mark.parametrize(
    ("choices", "remaining"),
    [
        pytest.param(None, "60", id="no-n"),
        pytest.param(1, "60", id="n-1"),
        # Three sequences of the predicted 10 tokens: 20 + 2 x 30 = 80 of the 100 the bucket holds.
        pytest.param(3, "20", id="n-3"),
    ],
)
async def test_each_choice_reserves_its_own_output(
    start_tenant_gateway: StartTenantGateway, choices: int | None, remaining: str
) -> None:
    """``n`` choices are ``n`` sequences: the reservation holds the predicted output of each (the
    settle then charges the usage the replica reports, as for one choice)."""
    gw = await start_tenant_gateway(Scripted().answer, settings=tight)
    body = COMPLETION if choices is None else {**COMPLETION, "n": choices}

    resp = await gw.post(body=body)

    assert resp.status == 200
    assert _ratelimit(resp)["x-ratelimit-remaining-tokens"] == remaining
    await gw.tenancy.budget.drain()
    assert await gw.level(limits=TIGHT.to_limits()) == pytest.approx(100.0 - 40.0)  # usage 20 + 10


@pytest.mark.parametrize(
    ("prompt", "remaining"),
    [
        pytest.param([7] * PROMPT_TOKENS, "60", id="one-prompt"),
        # Two prompts of 10 tokens, two sequences of the predicted 10 tokens: 20 + 2 x 2 x 10 = 60.
        pytest.param([[7] * 10, [7] * 10], "40", id="two-prompts"),
        # Four prompts of 5 tokens: 20 + 4 x 2 x 10 = 100, all the bucket holds.
        pytest.param([[7] * 5] * 4, "0", id="four-prompts"),
    ],
)
async def test_each_prompt_of_a_list_reserves_its_own_output(
    start_tenant_gateway: StartTenantGateway, prompt: list[Any], remaining: str
) -> None:
    """A list of prompts is as many sequences on the engine (vLLM decodes one per prompt): the
    reservation holds the predicted output of each, the prompts' tokens once."""
    gw = await start_tenant_gateway(Scripted().answer, settings=tight)

    resp = await gw.post(body={**COMPLETION, "prompt": prompt})

    assert resp.status == 200
    assert _ratelimit(resp)["x-ratelimit-remaining-tokens"] == remaining


async def test_a_list_of_prompts_over_the_budget_is_refused(start_tenant_gateway: StartTenantGateway) -> None:
    """Five prompts of 4 tokens reserve 20 + 5 x 2 x 10 = 120 > the bucket's 100: never admitted."""
    gw = await start_tenant_gateway(Scripted().answer, settings=tight)

    resp = await gw.post(body={**COMPLETION, "prompt": [[7] * 4] * 5})

    assert resp.status == 429
    assert resp.headers["x-should-retry"] == "false"
    assert len(gw.replica.seen) == 0


async def test_oversize_request_is_never_retryable(start_tenant_gateway: StartTenantGateway) -> None:
    gw = await start_tenant_gateway(Scripted().answer, settings=tight)

    resp = await gw.post(body={**COMPLETION, "prompt": [7] * 90})  # 90 + 2 x 10 > 100

    assert resp.status == 429
    assert "Retry-After" not in resp.headers
    assert resp.headers["x-should-retry"] == "false"
    assert (await resp.json())["error"]["message"] == (
        "Request too large for tenant team-a on weighted tokens per min (TPM): Limit 600, Burst 100, "
        "Requested 110. Lower max_tokens or shorten the prompt (or raise the tenant's token_burst)."
    )


async def test_concurrency_limit_then_release(start_tenant_gateway: StartTenantGateway) -> None:
    script = Scripted()
    gw = await start_tenant_gateway(
        script.hang, settings=lambda url: tenancy_settings(url, limits=TenantLimitSettings(max_concurrent=1))
    )

    held = asyncio.create_task(gw.post())
    await asyncio.wait_for(script.arrived.wait(), 10)
    refused = await gw.post()
    script.release.set()
    first = await held
    await gw.tenancy.budget.drain()

    assert refused.status == 429
    # Until the held request is predicted to end (or a typical request's duration), jittered.
    wait_ms = int(refused.headers["retry-after-ms"])
    assert 100 <= wait_ms <= 60_000
    assert refused.headers["Retry-After"] == str(math.ceil(wait_ms / 1000))
    assert _ratelimit(refused) == {}  # no token or request budget configured
    assert [o.reason for o in gw.outcomes if o.status == 429] == ["concurrency"]
    assert first.status == 200
    assert await gw.limiter.in_flight("team-a") == 0
    assert (await gw.post()).status == 200


async def test_fail_closed_storage_down_is_503(start_tenant_gateway: StartTenantGateway) -> None:
    """A real Redis client aimed at a port nothing listens on: every call fails at once."""
    gw = await start_tenant_gateway(Scripted().answer)
    stats = gw.stats
    redis = RedisLimiter(connect(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.05), stats=stats)
    fallback = MemoryLimiter(name="fallback", stats=stats)
    gw.tenancy.use_limiter(FailoverLimiter(redis, fallback, mode="fail_closed", stats=stats), stats)

    resp = await gw.post()

    assert resp.status == 503
    assert resp.headers["Retry-After"] == "1"
    error = (await resp.json())["error"]
    assert error["code"] == "rate_limit_unavailable"
    # A fixed message: never the Redis client's exception text.
    assert error["message"] == "the tenants' rate-limit storage is unavailable; retry later"
    assert stats.fail_closed_total == 1
    assert gw.replica.seen == []


def _ratelimit(resp: aiohttp.ClientResponse) -> dict[str, str]:
    return {k.lower(): v for k, v in resp.headers.items() if k.lower().startswith("x-ratelimit-")}


# -- settle exactly once -----------------------------------------------------------------------------


def _streamed_charge(outcome: RequestOutcome, streamed: int) -> int:
    """What a stream cut after ``streamed`` tokens is charged: those tokens when the proxy
    records them on the outcome (``tokens_streamed``), else the reserved prediction."""
    output = streamed if hasattr(outcome, "tokens_streamed") else 10
    return PROMPT_TOKENS + 2 * output


async def _assert_settled_once(gw: Any, charged: float) -> None:
    await gw.tenancy.budget.drain()
    assert gw.tenancy.budget.settles_started == 1
    assert (gw.stats.settles_total, gw.stats.settles_noop_total) == (1, 0)
    assert await gw.limiter.in_flight("team-a") == 0
    assert await gw.level() == pytest.approx(1000.0 - charged)


@pytest.mark.parametrize(
    ("handler", "stream", "status", "charged"),
    [
        pytest.param("answer", False, 200, 7 + 2 * 3, id="json-refund-to-usage"),
        pytest.param("stream", True, 200, 7 + 2 * 3, id="stream-refund-to-usage"),
        pytest.param("fail", False, 502, PROMPT_TOKENS, id="replica-500-prompt-only"),
    ],
)
async def test_settles_once_with_real_usage(
    start_tenant_gateway: StartTenantGateway, handler: str, stream: bool, status: int, charged: int
) -> None:
    script = Scripted(usage=(7, 3))
    gw = await start_tenant_gateway(getattr(script, handler))

    resp = await gw.post(body={**COMPLETION, "stream": stream})
    await resp.read()

    assert resp.status == status
    await _assert_settled_once(gw, charged)


async def test_replica_unreachable_settles_prompt_only(start_tenant_gateway: StartTenantGateway) -> None:
    gw = await start_tenant_gateway(Scripted().answer)
    await gw.replica_server.close()  # still marked healthy: the proxy finds out when it connects

    resp = await gw.post()

    assert resp.status == 502
    await _assert_settled_once(gw, PROMPT_TOKENS)


async def test_rejected_before_dispatch_settles_nothing_charged(
    start_tenant_gateway: StartTenantGateway,
) -> None:
    gw = await start_tenant_gateway(Scripted().answer)

    resp = await gw.post(body={**COMPLETION, "model": "no-such-model"})

    assert resp.status == 404
    await _assert_settled_once(gw, 0.0)


async def test_client_disconnect_mid_stream_settles_once(start_tenant_gateway: StartTenantGateway) -> None:
    """aiohttp's test server cancels the handler when its client goes away."""
    script = Scripted()
    gw = await start_tenant_gateway(script.stream_then_hang)

    resp = await gw.post(body={**COMPLETION, "stream": True})
    await resp.content.readuntil(b"\n\n")
    await asyncio.wait_for(script.arrived.wait(), 10)
    resp.close()

    await wait_for(lambda: len(gw.outcomes) == 1 and gw.tenancy.budget.settles_started == 1, timeout_s=20)
    await _assert_settled_once(gw, _streamed_charge(gw.outcomes[0], 2))
    script.release.set()


@asynccontextmanager
async def production_runner(app: web.Application) -> AsyncIterator[str]:
    """Serve ``app`` as ``web.run_app`` does (handlers not cancelled on disconnect)."""
    runner = web.AppRunner(app)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        await runner.cleanup()


async def test_disconnect_noticed_by_the_monitor_settles_once(aiohttp_server: Any) -> None:
    """Under ``run_app`` the handler is not cancelled; the proxy's disconnect monitor ends it."""
    script = Scripted()
    replica_server = await aiohttp_server(FakeReplica(handler=script.stream_then_hang).app())
    app, _, outcomes = make_app(tenancy_settings(await url_of(replica_server)))
    limiter = MemoryLimiter(clock=FakeClock())
    tenancy = app[TENANCY]
    tenancy.use_limiter(limiter)
    async with production_runner(app) as url, aiohttp.ClientSession() as client:
        resp = await client.post(
            url + "/v1/completions", json={**COMPLETION, "stream": True}, headers=bearer(KEY_A)
        )
        await resp.content.readuntil(b"\n\n")
        resp.close()
        await wait_for(lambda: len(outcomes) == 1 and tenancy.budget.settles_started == 1, timeout_s=20)
        await tenancy.budget.drain()
        assert outcomes[0].error == "client_disconnected"
        assert (limiter.stats.settles_total, limiter.stats.settles_noop_total) == (1, 0)
        assert await limiter.in_flight("team-a") == 0
        script.release.set()


async def test_shutdown_cancels_the_handler_and_still_settles_once(aiohttp_server: Any) -> None:
    """A request still running at shutdown: its handler is cancelled after the grace period; the
    settle runs and finishes before the limiter is closed."""
    script = Scripted()
    replica_server = await aiohttp_server(FakeReplica(handler=script.hang).app())
    app, _, _ = make_app(tenancy_settings(await url_of(replica_server)))
    limiter = MemoryLimiter(clock=FakeClock())
    tenancy = app[TENANCY]
    tenancy.use_limiter(limiter)
    server = TestServer(app)
    await server.start_server(shutdown_timeout=0.2)
    async with aiohttp.ClientSession() as client:
        pending = asyncio.create_task(
            client.post(str(server.make_url("/v1/completions")), json=COMPLETION, headers=bearer(KEY_A))
        )
        await asyncio.wait_for(script.arrived.wait(), 10)
        assert await limiter.in_flight("team-a") == 1

        await server.close()

        assert tenancy.budget.settles_started == 1
        assert (limiter.stats.settles_total, limiter.stats.settles_noop_total) == (1, 0)
        script.release.set()
        pending.cancel()
        await asyncio.gather(pending, return_exceptions=True)


# -- admin endpoints ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/metrics", "/sluice/v1/replicas"])
@pytest.mark.parametrize(
    ("token", "status"),
    [
        pytest.param(None, 401, id="no-token"),
        pytest.param("sk-wrong-admin", 401, id="wrong-token"),
        pytest.param(KEY_A, 401, id="tenant-key"),
        pytest.param(ADMIN_TOKEN, 200, id="admin-token"),
    ],
)
async def test_admin_token_guards_admin_endpoints(
    start_tenant_gateway: StartTenantGateway, path: str, token: str | None, status: int
) -> None:
    auth = AuthSettings(admin_token_hash=hash_api_key(ADMIN_TOKEN))
    gw = await start_tenant_gateway(Scripted().answer, settings=lambda url: tenancy_settings(url, auth=auth))

    resp = await gw.client.get(path, headers={} if token is None else bearer(token))

    assert resp.status == status
    if status == 401:
        assert (await resp.json())["error"]["code"] == "invalid_admin_token"
        assert resp.headers["WWW-Authenticate"] == 'Bearer realm="sluice-admin"'


async def test_admin_endpoints_open_without_an_admin_token(start_tenant_gateway: StartTenantGateway) -> None:
    gw = await start_tenant_gateway(Scripted().answer)

    assert (await gw.client.get("/metrics")).status == 200
    assert (await gw.client.get("/healthz")).status == 200


# -- secrets -----------------------------------------------------------------------------------------


async def test_keys_never_reach_logs_or_metrics(
    start_tenant_gateway: StartTenantGateway, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    auth = AuthSettings(admin_token_hash=hash_api_key(ADMIN_TOKEN))
    gw = await start_tenant_gateway(
        Scripted().answer, settings=lambda url: tenancy_settings(url, limits=TIGHT, auth=auth)
    )

    statuses = [(await gw.post(key)).status for key in (KEY_A, KEY_A, KEY_A, KEY_B, "sk-typo-of-a-key")]
    await gw.client.post("/v1/completions", json=COMPLETION, headers={"Authorization": f"Token {KEY_A}"})
    await gw.client.get("/sluice/v1/replicas", headers=bearer(KEY_A))
    metrics = await (await gw.client.get("/metrics", headers=bearer(ADMIN_TOKEN))).text()
    await gw.tenancy.budget.drain()

    assert statuses == [200, 200, 429, 200, 401]
    secrets = [KEY_A, KEY_B, ADMIN_TOKEN, "sk-typo-of-a-key"]
    secrets += [hash_api_key(k).removeprefix("sha256:") for k in (KEY_A, KEY_B, ADMIN_TOKEN)]
    text, json_lines = TextFormatter(), JsonFormatter()
    logged = "\n".join(text.format(r) + json_lines.format(r) for r in caplog.records)
    assert "access" in logged  # the access lines were captured, with their fields
    leaked = [s for s in secrets if s in logged or s in metrics or s in repr(gw.tenancy.authenticator)]
    assert leaked == []


async def test_access_line_says_who_what_and_why_without_the_prompt(
    start_tenant_gateway: StartTenantGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """One JSON access line per request with tenant, class, decision and reason."""
    gw = await start_tenant_gateway(
        Scripted().answer, settings=lambda url: tenancy_settings(url, limits=TIGHT)
    )
    secret_prompt = "the-launch-code-is-0000"
    body = {**COMPLETION, "prompt": secret_prompt}

    with caplog.at_level(logging.INFO, logger="sluice.access"):
        statuses = [(await gw.post(KEY_A, body=body)).status for _ in range(3)]
        await gw.tenancy.budget.drain()

    assert statuses == [200, 200, 429]
    lines = [json.loads(JsonFormatter().format(r)) for r in caplog.records if r.name == "sluice.access"]
    assert [line["status"] for line in lines] == statuses
    admitted, _, limited = lines
    assert (admitted["tenant"], admitted["decision"], admitted["replica"]) == ("team-a", "admitted", "r1")
    assert admitted["class"] is not None
    assert (admitted["prompt_tokens"], admitted["completion_tokens"]) == (PROMPT_TOKENS, 10)
    assert (limited["tenant"], limited["decision"], limited["replica"]) == ("team-a", "rejected", None)
    # The tenant's bucket refused it before any class was chosen; Retry-After is the refill
    # (0.6 s), jittered up to half as much again.
    assert (limited["class"], limited["reason"]) == (None, "tokens")
    assert 600.0 <= limited["retry_after_ms"] <= 900.0
    assert limited["error"] == "rate_limit_exceeded"
    logged = "\n".join(json.dumps(line) for line in lines)
    assert secret_prompt not in logged
    assert KEY_A not in logged


# -- the error classes -------------------------------------------------------------------------------


def test_rate_limited_error_response_shape() -> None:
    reason = RefusalReason.RATE_LIMITED
    exact = RetryAfterSettings(jitter_fraction=0.0)
    retry = retry_after(reason, 0.25, exact, random.Random(0))
    resp = error_response(Refused(reason, "slow down", retry_after=retry))

    assert resp.status == 429
    assert (resp.headers["Retry-After"], resp.headers["retry-after-ms"]) == ("1", "250")
