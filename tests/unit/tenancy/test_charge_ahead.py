"""A stream that outruns its reservation through a real gateway: charged ahead, or stopped, and
settled exactly once whatever ends it (its end, its budget, a client gone, a shutdown).

The fake replica streams more tokens than the gateway predicts (its ``max_tokens`` is
over both: the prediction is reserved); the limiter is a real ``MemoryLimiter`` on a hand-driven clock, so the
bucket's level after the settle is exactly the prompt plus twice the tokens the replica produced
(weights 1 : 2), whatever was reserved and charged ahead meanwhile.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.api.sse import Event
from gateway.limits.base import Reservation
from gateway.limits.config import TenantLimitSettings
from gateway.limits.memory import MemoryLimiter
from gateway.proxy.relay import finishing
from gateway.tenants.live import TENANCY
from tests.unit.gateway.fakes import MODEL, FakeReplica, make_app, url_of, wait_for
from tests.unit.limits.fakes import FakeClock
from tests.unit.tenancy.conftest import (
    KEY_A,
    PROMPT_TOKENS,
    StartTenantGateway,
    TenantGateway,
    bearer,
    completion_chunk,
    tenancy_settings,
)

TALK = 2000
#: Over ``TALK``, within the fake replica's context: the reservation is the prediction (far
#: under ``TALK``).
MAX_TOKENS = 4000
STREAM: dict[str, Any] = {
    "model": MODEL,
    "prompt": [7] * PROMPT_TOKENS,
    "stream": True,
    "max_tokens": MAX_TOKENS,
}
#: Room for the whole stream, and a bucket that holds its reservation and not much more.
ROOMY = TenantLimitSettings(tokens_per_minute=60.0, token_burst=100_000.0)
TIGHT = TenantLimitSettings(tokens_per_minute=60.0, token_burst=1500.0)


@dataclass
class Talker:
    """A replica that streams ``tokens`` tokens whatever it was asked, then its usage and
    ``[DONE]``; with ``hang``, nothing more after them until ``release``."""

    tokens: int = TALK
    hang: bool = False
    release: asyncio.Event = field(default_factory=asyncio.Event)
    streamed: asyncio.Event = field(default_factory=asyncio.Event)

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(self.tokens):
            await response.write(completion_chunk("x"))
        self.streamed.set()
        if self.hang:
            await self.release.wait()
            return response
        usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": self.tokens}
        await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def settings_with(limits: TenantLimitSettings) -> Any:
    return lambda url: tenancy_settings(url, limits=limits)


async def read_events(resp: aiohttp.ClientResponse) -> tuple[int, list[dict[str, Any]], bool]:
    """(token chunks, error payloads, whether ``[DONE]`` came) of an SSE answer."""
    tokens, errors, done = 0, [], False
    async for raw in resp.content:
        line = raw.decode().strip()
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            payload = json.loads(line[len("data: ") :])
            if "error" in payload:
                errors.append(payload["error"])
            elif payload.get("choices"):
                tokens += 1
    return tokens, errors, done


async def level(gw: TenantGateway, limits: TenantLimitSettings) -> float:
    return await gw.level(limits=limits.to_limits())


async def test_a_stream_outrunning_its_reservation_is_charged_ahead_to_its_end(
    start_tenant_gateway: StartTenantGateway,
) -> None:
    gw = await start_tenant_gateway(Talker(), settings=settings_with(ROOMY))

    resp = await gw.post(body=STREAM)
    tokens, errors, done = await read_events(resp)

    assert (resp.status, tokens, errors, done) == (200, TALK, [], True)
    await gw.tenancy.budget.drain()
    steps = gw.tenancy.budget.settles_started - 1
    assert steps >= 1  # the reservation was the prediction, far under 2,000 tokens
    assert (gw.stats.settles_total, gw.stats.settles_noop_total) == (1 + steps, 0)
    assert await gw.limiter.in_flight("team-a") == 0
    assert await level(gw, ROOMY) == pytest.approx(100_000.0 - (PROMPT_TOKENS + 2 * TALK))


async def test_a_stream_its_budget_cannot_cover_is_stopped_and_charged_what_it_produced(
    start_tenant_gateway: StartTenantGateway,
) -> None:
    gw = await start_tenant_gateway(Talker(), settings=settings_with(TIGHT))

    resp = await gw.post(body=STREAM)
    tokens, errors, done = await read_events(resp)

    assert resp.status == 200
    assert not done
    assert [e["code"] for e in errors] == ["rate_limit_exceeded"]
    assert f"stopped after {tokens} output tokens" in errors[0]["message"]
    assert 0 < tokens < TALK
    await wait_for(lambda: len(gw.outcomes) == 1)
    assert gw.outcomes[0].error == "rate_limit_exceeded"
    await gw.tenancy.budget.drain()
    # Charged the tokens relayed and the one that crossed the cover (produced, not relayed).
    assert await level(gw, TIGHT) == pytest.approx(1500.0 - (PROMPT_TOKENS + 2 * (tokens + 1)))
    assert await level(gw, TIGHT) >= -2.0  # never more than that one token in debt
    assert gw.stats.settles_noop_total == 0
    assert await gw.limiter.in_flight("team-a") == 0


async def test_a_client_gone_from_a_charged_ahead_stream_settles_once(
    start_tenant_gateway: StartTenantGateway,
) -> None:
    talker = Talker(tokens=700, hang=True)
    gw = await start_tenant_gateway(talker, settings=settings_with(ROOMY))

    resp = await gw.post(body=STREAM)
    await asyncio.wait_for(talker.streamed.wait(), 10)
    await wait_for(lambda: gw.tenancy.budget.settles_started >= 1, timeout_s=10)  # a step was taken
    resp.close()

    await wait_for(lambda: len(gw.outcomes) == 1, timeout_s=20)
    await gw.tenancy.budget.drain()
    streamed = gw.outcomes[0].tokens_streamed
    assert gw.outcomes[0].error == "client_disconnected"
    assert gw.stats.settles_noop_total == 0
    assert await gw.limiter.in_flight("team-a") == 0
    assert await level(gw, ROOMY) == pytest.approx(100_000.0 - (PROMPT_TOKENS + 2 * streamed))
    talker.release.set()


class Recording(MemoryLimiter):
    """A ``MemoryLimiter`` that keeps what every settle charged (its state goes at ``close``)."""

    def __init__(self) -> None:
        super().__init__(clock=FakeClock())
        self.charged: list[float] = []

    async def settle(self, reservation: Reservation, *, actual_cost_tokens: float) -> None:
        if self.settle_now(reservation, actual_cost_tokens=actual_cost_tokens):
            self.charged.append(actual_cost_tokens)


async def test_shutdown_during_a_charged_ahead_stream_settles_once(aiohttp_server: Any) -> None:
    """The gateway stops with the stream running (its handler cancelled after the grace)."""
    talker = Talker(tokens=700, hang=True)
    replica_server = await aiohttp_server(FakeReplica(handler=talker).app())
    app, _, outcomes = make_app(tenancy_settings(await url_of(replica_server), limits=ROOMY))
    limiter = Recording()
    tenancy = app[TENANCY]
    tenancy.use_limiter(limiter)
    server = TestServer(app)
    await server.start_server(shutdown_timeout=0.2)
    async with aiohttp.ClientSession() as client:
        pending = asyncio.create_task(
            client.post(str(server.make_url("/v1/completions")), json=STREAM, headers=bearer(KEY_A))
        )
        await asyncio.wait_for(talker.streamed.wait(), 10)
        await wait_for(lambda: tenancy.budget.settles_started >= 1, timeout_s=10)

        await server.close()

        assert len(outcomes) == 1
        streamed = outcomes[0].tokens_streamed
        assert len(limiter.charged) == tenancy.budget.settles_started >= 2  # a step, the request
        assert sum(limiter.charged) == pytest.approx(PROMPT_TOKENS + 2 * streamed)
        talker.release.set()
        pending.cancel()
        await asyncio.gather(pending, return_exceptions=True)


@pytest.mark.parametrize(
    ("data", "ends"),
    [
        pytest.param('{"choices":[{"index":0,"text":"x","finish_reason":null}]}', False, id="a-token"),
        pytest.param('{"choices":[{"index":0,"text":"x","finish_reason":"length"}]}', True, id="last-token"),
        pytest.param('{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}', True, id="closing-chunk"),
        pytest.param('{"choices":[{"index":0,"delta":{"content":"x"}}]}', False, id="no-field"),
        pytest.param("[DONE]", False, id="done"),
        pytest.param('{"finish_reason": "stop"', False, id="not-json"),
        pytest.param(None, False, id="comment"),
    ],
)
def test_a_choice_that_ends_is_relayed_uncharged(data: str | None, ends: bool) -> None:
    """Past its cover, a stream's chunk that ends a choice is relayed without a step."""
    assert finishing(Event(b"", data)) is ends


async def test_the_openai_sdk_sees_a_stopped_stream_as_a_rate_limit_error(
    start_tenant_gateway: StartTenantGateway,
) -> None:
    gw = await start_tenant_gateway(Talker(), settings=settings_with(TIGHT))
    client = openai.AsyncOpenAI(api_key=KEY_A, base_url=str(gw.client.make_url("/v1")), max_retries=0)
    received = 0

    async def read_all() -> None:
        nonlocal received
        stream = await client.completions.create(
            model=MODEL, prompt=[7] * PROMPT_TOKENS, stream=True, max_tokens=MAX_TOKENS
        )
        async for _ in stream:
            received += 1

    with pytest.raises(openai.APIError) as caught:
        await read_all()

    assert 0 < received < TALK
    assert caught.value.code == "rate_limit_exceeded"
    assert caught.value.message == (
        "Rate limit reached for tenant team-a on weighted tokens per min (TPM): this stream outran its "
        f"token reservation and the budget holds no more; it was stopped after {received} output tokens."
    )
