"""A non-streamed request of a tenant with a token bucket, through a real gateway: it reserves its
whole output cap, and without ``max_tokens`` the gateway sets one (the largest output the bucket
holds), sends it to the replica and names it in ``x-sluice-max-tokens-set``; the settle charges
the real usage. Streams and tenants without a token bucket are left as they are.

The bucket holds 1,000 weighted tokens (weights 1 : 2); the limiter is a real ``MemoryLimiter``
on a hand-driven clock, so every level is exact.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.api.openai import MAX_TOKENS_SET_HEADER
from tests.unit.gateway.fakes import MODEL
from tests.unit.tenancy.conftest import (
    COMPLETION,
    KEY_A,
    KEY_B,
    PROMPT_TOKENS,
    Scripted,
    StartTenantGateway,
    TenantGateway,
)

CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}]}


async def post_chat(gw: TenantGateway, body: dict[str, Any], key: str = KEY_A) -> Any:
    return await gw.client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})


async def test_a_chat_without_max_tokens_gets_the_largest_the_bucket_holds(
    start_tenant_gateway: StartTenantGateway,
) -> None:
    gw = await start_tenant_gateway()

    resp = await post_chat(gw, CHAT)

    assert resp.status == 200
    cap = int(resp.headers[MAX_TOKENS_SET_HEADER])
    assert gw.replica.seen[-1].body["max_tokens"] == cap
    assert {k: v for k, v in gw.replica.seen[-1].body.items() if k != "max_tokens"} == CHAT
    # A few prompt tokens (estimated) and 2 per output token fill the bucket of 1,000.
    assert 480 <= cap <= 499
    await gw.tenancy.budget.drain()
    # Settled to the replica's usage (7 prompt, 3 output): the unused reservation came back.
    assert await gw.level() == pytest.approx(1000.0 - (7 + 2 * 3))


async def test_the_whole_cap_is_held_while_the_answer_runs(start_tenant_gateway: StartTenantGateway) -> None:
    scripted = Scripted(usage=(PROMPT_TOKENS, 50))
    gw = await start_tenant_gateway(scripted.hang)

    pending = asyncio.create_task(gw.post(body={**COMPLETION, "max_tokens": 300}))
    await asyncio.wait_for(scripted.arrived.wait(), 10)
    # 20 + 2 x 300: the answer may run to its cap, whatever the prediction.
    assert await gw.level() == pytest.approx(1000.0 - (PROMPT_TOKENS + 2 * 300))
    # A second one does not fit beside it: refused, not overdrawn.
    refused = await gw.post(body={**COMPLETION, "max_tokens": 300})
    assert refused.status == 429
    scripted.release.set()
    resp = await pending
    assert resp.status == 200
    assert MAX_TOKENS_SET_HEADER not in resp.headers
    await gw.tenancy.budget.drain()
    assert await gw.level() == pytest.approx(1000.0 - (PROMPT_TOKENS + 2 * 50))


async def test_a_cap_the_bucket_can_never_hold_is_refused_for_good(
    start_tenant_gateway: StartTenantGateway,
) -> None:
    gw = await start_tenant_gateway()

    resp = await gw.post(body={**COMPLETION, "max_tokens": 600})

    assert resp.status == 429
    assert resp.headers["x-should-retry"] == "false"
    assert "Lower max_tokens" in (await resp.json())["error"]["message"]
    assert gw.replica.seen == []


async def test_a_completion_without_max_tokens_reserves_vllms_default(
    start_tenant_gateway: StartTenantGateway,
) -> None:
    scripted = Scripted()
    gw = await start_tenant_gateway(scripted.hang)
    body = {k: v for k, v in COMPLETION.items() if k != "max_tokens"}

    pending = asyncio.create_task(gw.post(body=body))
    await asyncio.wait_for(scripted.arrived.wait(), 10)
    assert await gw.level() == pytest.approx(1000.0 - (PROMPT_TOKENS + 2 * 16))
    assert "max_tokens" not in gw.replica.seen[-1].body  # vLLM applies its own 16
    scripted.release.set()
    assert MAX_TOKENS_SET_HEADER not in (await pending).headers


@pytest.mark.parametrize(
    ("body", "key"),
    [
        pytest.param({**CHAT, "stream": True}, KEY_A, id="a-stream-is-charged-ahead-instead"),
        pytest.param(CHAT, KEY_B, id="a-tenant-without-a-token-bucket"),
    ],
)
async def test_otherwise_the_body_goes_as_sent(
    start_tenant_gateway: StartTenantGateway, body: dict[str, Any], key: str
) -> None:
    gw = await start_tenant_gateway()

    resp = await post_chat(gw, body, key)
    await resp.read()

    assert resp.status == 200
    assert MAX_TOKENS_SET_HEADER not in resp.headers
    assert "max_tokens" not in gw.replica.seen[-1].body
