"""The proxy stamps a live request's first relayed token (``LiveRequest.first_token_at``), over
real HTTP: what admission's stall budget reads as the start of the stream's decode.

Outcomes, not timings: the stamps exist (or not) and are ordered; their values are the wall
clock's.
"""

from __future__ import annotations

import asyncio

import pytest

from gateway.admission.shares import decode_elapsed_s
from gateway.replicas.registry import LiveRequest
from tests.unit.gateway.conftest import StartGateway, StartReplica
from tests.unit.gateway.fakes import FakeReplica
from tests.unit.gateway.test_in_flight import CHAT, Held, only_replica, read_events


@pytest.mark.parametrize("tokens", [0, 1, 6], ids=["no-token-yet", "one", "six"])
async def test_first_and_latest_token_are_stamped(
    start_replica: StartReplica, start_gateway: StartGateway, tokens: int
) -> None:
    """The fake replica sends a role chunk (no token) and ``tokens`` content chunks, then holds."""
    held = Held(tokens=tokens)
    _, url = await start_replica(FakeReplica(handler=held))
    gw = await start_gateway({"r1": url})
    replica = only_replica(gw.app)

    resp = await gw.client.post("/v1/chat/completions", json=CHAT)
    await asyncio.wait_for(held.holding.wait(), timeout=5)
    await read_events(resp, 1 + tokens)  # the gateway stamped them before relaying them

    (live,) = replica._live  # the mutable entry admission's TrackedStream reads
    assert isinstance(live, LiveRequest)
    assert live.tokens_streamed == tokens
    if tokens == 0:
        assert live.first_token_at is None
        assert decode_elapsed_s(live.first_token_at, live.last_token_at) == 0.0
    else:
        assert live.first_token_at is not None
        assert live.last_token_at is not None
        assert live.started_at <= live.first_token_at <= live.last_token_at
        elapsed = decode_elapsed_s(live.first_token_at, live.last_token_at)
        assert elapsed == live.last_token_at - live.first_token_at
    held.release.set()
    await resp.read()
