"""A tenant's budgets in its responses' headers, as the real ``openai`` SDK reads them.

OpenAI's ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` on every response of a tenant
with limits (an answer, a stream, a 429), in the unit the budget is stated in, with OpenAI's reset
format; the IETF ``RateLimit-Policy`` / ``RateLimit`` fields only when ``limits.ietf_headers`` is
on. The limiter runs on a hand-driven clock, so every number is exact: a request reserves and is
settled at 20 + 2 x 10 = 40 weighted tokens (conftest), the bucket refills 10 a second.
"""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

from gateway.config.settings import Settings
from gateway.http.rate_limit_headers import go_duration
from gateway.limits.config import LimitsSettings, TenantLimitSettings, TokenWeightSettings
from tests.unit.gateway.fakes import MODEL
from tests.unit.tenancy.conftest import (
    KEY_A,
    MAX_TOKENS,
    PROMPT_TOKENS,
    Scripted,
    StartTenantGateway,
    TenantGateway,
    tenancy_settings,
)

#: 10 weighted tokens and 1 request per second; buckets of 100 tokens and 10 requests; 4 at once.
LIMITS = TenantLimitSettings(
    tokens_per_minute=600.0,
    token_burst=100.0,
    requests_per_minute=60.0,
    request_burst=10.0,
    max_concurrent=4,
)

#: The IETF policy field of ``LIMITS``.
POLICY = '"requests";q=60;w=60, "tokens";q=600;w=60;qu="tokens", "concurrency";q=4;qu="concurrent-requests"'


def settings(*, ietf: bool) -> Any:
    def build(url: str) -> Settings:
        base = tenancy_settings(url, limits=LIMITS)
        limits = LimitsSettings(token_weights=TokenWeightSettings(prompt=1.0, output=2.0), ietf_headers=ietf)
        return base.model_copy(update={"limits": limits})

    return build


def sdk(gw: TenantGateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(api_key=KEY_A, base_url=str(gw.client.make_url("/v1")), max_retries=0)


def ratelimit(headers: Any) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items() if k.lower().startswith(("x-ratelimit-", "ratelimit"))}


async def create(client: openai.AsyncOpenAI, *, stream: bool = False) -> Any:
    return await client.completions.with_raw_response.create(
        model=MODEL, prompt=[7] * PROMPT_TOKENS, max_tokens=MAX_TOKENS, stream=stream
    )


async def test_answers_streams_and_429s_carry_openais_headers(
    start_tenant_gateway: StartTenantGateway,
) -> None:
    scripted = Scripted()
    gw = await start_tenant_gateway(scripted.answer, settings=settings(ietf=False))
    client = sdk(gw)

    answer = await create(client)
    await gw.tenancy.budget.drain()
    assert ratelimit(answer.headers) == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "9",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "600",
        "x-ratelimit-remaining-tokens": "60",
        "x-ratelimit-reset-tokens": "4s",
    }

    gw.replica.handler = scripted.stream
    streamed = await create(client, stream=True)
    chunks = [chunk async for chunk in streamed.parse()]
    await gw.tenancy.budget.drain()
    assert chunks
    assert ratelimit(streamed.headers) == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "8",
        "x-ratelimit-reset-requests": "2s",
        "x-ratelimit-limit-tokens": "600",
        "x-ratelimit-remaining-tokens": "20",
        "x-ratelimit-reset-tokens": "8s",
    }

    with pytest.raises(openai.RateLimitError) as refused:
        await create(client)
    headers = refused.value.response.headers
    assert ratelimit(headers) == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "8",
        "x-ratelimit-reset-requests": "2s",
        "x-ratelimit-limit-tokens": "600",
        "x-ratelimit-remaining-tokens": "20",
        "x-ratelimit-reset-tokens": "8s",
    }
    assert refused.value.code == "rate_limit_exceeded"
    # The wait the message gives is the one retry-after-ms sends, in OpenAI's syntax.
    wait = go_duration(int(headers["retry-after-ms"]) / 1000)
    assert isinstance(refused.value.body, dict)
    assert refused.value.body["message"] == (
        "Rate limit reached for tenant team-a on weighted tokens per min (TPM): Limit 600, Burst 100, "
        f"Used 80, Requested 40. Please try again in {wait}."
    )
    await client.close()


async def test_the_ietf_fields_are_sent_only_when_switched_on(
    start_tenant_gateway: StartTenantGateway,
) -> None:
    gw = await start_tenant_gateway(Scripted().answer, settings=settings(ietf=True))
    client = sdk(gw)

    answer = await create(client)
    await gw.tenancy.budget.drain()
    # Held while the answer was sent: one slot of four taken.
    assert answer.headers["RateLimit-Policy"] == POLICY
    assert answer.headers["RateLimit"] == '"requests";r=9;t=1, "tokens";r=60;t=4, "concurrency";r=3'
    assert answer.headers["x-ratelimit-remaining-tokens"] == "60"  # OpenAI's stay

    await create(client)
    await gw.tenancy.budget.drain()
    with pytest.raises(openai.RateLimitError) as refused:
        await create(client)
    headers = refused.value.response.headers
    assert headers["RateLimit"] == '"requests";r=8;t=2, "tokens";r=20;t=8, "concurrency";r=4'
    await client.close()

    off = await start_tenant_gateway(Scripted().answer, settings=settings(ietf=False))
    plain = sdk(off)
    response = await create(plain)
    assert "RateLimit" not in response.headers
    assert "RateLimit-Policy" not in response.headers
    await plain.close()


async def test_a_request_refused_before_any_replica_shows_its_reservation_refunded(
    start_tenant_gateway: StartTenantGateway,
) -> None:
    """Refused after its budget was reserved (no replica serves its model): the engine refunds it
    whole, and its headers show the buckets as they stand: full."""
    gw = await start_tenant_gateway(Scripted().answer, settings=settings(ietf=True))
    client = sdk(gw)

    with pytest.raises(openai.APIStatusError) as refused:
        await client.completions.with_raw_response.create(
            model="no-such-model", prompt=[7] * PROMPT_TOKENS, max_tokens=MAX_TOKENS
        )
    await gw.tenancy.budget.drain()

    assert refused.value.status_code == 404
    assert gw.stats.allowed_total == 1  # reserved before its model was looked up
    headers = refused.value.response.headers
    assert ratelimit(headers) == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "10",
        "x-ratelimit-reset-requests": "0s",
        "x-ratelimit-limit-tokens": "600",
        "x-ratelimit-remaining-tokens": "100",
        "x-ratelimit-reset-tokens": "0s",
        "ratelimit-policy": POLICY,
        "ratelimit": '"requests";r=10;t=0, "tokens";r=100;t=0, "concurrency";r=4',
    }
    assert await gw.level(limits=LIMITS.to_limits()) == 100.0  # the limiter agrees
    await client.close()


async def test_request_and_concurrency_refusals_say_limit_and_use(
    start_tenant_gateway: StartTenantGateway,
) -> None:
    """One request a minute, a burst of 2, one at a time: a request beside a running one is refused
    for its slot (taking nothing), the third allowed one in a row for its request budget, each in
    OpenAI's words."""
    scripted = Scripted()
    limits = TenantLimitSettings(requests_per_minute=1.0, request_burst=2.0, max_concurrent=1)

    def build(url: str) -> Settings:
        return tenancy_settings(url, limits=limits)

    gw = await start_tenant_gateway(scripted.hang, settings=build)
    client = sdk(gw)

    held = asyncio.create_task(create(client))
    await scripted.arrived.wait()
    with pytest.raises(openai.RateLimitError) as busy:
        await create(client)
    assert isinstance(busy.value.body, dict)
    assert busy.value.body["message"].startswith(
        "Rate limit reached for tenant team-a on concurrent requests: Limit 1, In flight 1, Requested 1. "
        "Please try again in "
    )
    scripted.release.set()
    await held
    await create(client)  # the burst's second request
    await gw.tenancy.budget.drain()

    with pytest.raises(openai.RateLimitError) as spent:
        await create(client)
    assert isinstance(spent.value.body, dict)
    wait = go_duration(int(spent.value.response.headers["retry-after-ms"]) / 1000)
    assert spent.value.body["message"] == (
        "Rate limit reached for tenant team-a on requests per min (RPM): Limit 1, Burst 2, Used 2, "
        f"Requested 1. Please try again in {wait}."
    )
    await client.close()
