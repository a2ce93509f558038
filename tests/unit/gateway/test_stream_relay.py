"""The SSE relay through the whole gateway, against fake replicas over real HTTP.

The fake replicas (``fakes.FakeReplica``) exist because the emulator cannot be told to cut its
writes at arbitrary byte offsets or to break a stream on demand.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp import web

from gateway.api.sse import EventSplitter
from tests.unit.gateway.conftest import StartGateway, StartReplica
from tests.unit.gateway.fakes import MODEL, FakeReplica, chat_chunk, sse

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}


def data_events(body: bytes) -> list[str]:
    """The ``data`` of every event of a full SSE body, in order."""
    splitter = EventSplitter()
    return [e.data for e in splitter.feed(body) if e.data is not None]


def payloads(events: list[str]) -> list[dict[str, Any]]:
    return [json.loads(d) for d in events if d != "[DONE]"]


@pytest.mark.parametrize(
    ("write_size", "client_options"),
    [
        pytest.param(None, None, id="whole-body-one-write-no-usage-asked"),
        pytest.param(1, None, id="one-byte-writes-no-usage-asked"),
        pytest.param(7, None, id="seven-byte-writes-no-usage-asked"),
        pytest.param(7, {"include_usage": False}, id="seven-byte-writes-usage-false"),
    ],
)
async def test_usage_chunk_is_stripped_when_the_client_did_not_ask(
    start_replica: StartReplica,
    start_gateway: StartGateway,
    write_size: int | None,
    client_options: dict[str, Any] | None,
) -> None:
    """Fake replica writing its stream in ``write_size``-byte pieces, so events arrive cut anywhere."""
    replica = FakeReplica(write_size=write_size)
    _, url = await start_replica(replica)
    gw = await start_gateway({"r1": url})
    body = {**CHAT, **({"stream_options": client_options} if client_options is not None else {})}

    resp = await gw.client.post("/v1/chat/completions", json=body)

    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = data_events(await resp.read())
    assert events[-1] == "[DONE]"
    chunks = payloads(events)
    assert all(c["choices"] for c in chunks), "the usage-only chunk must not reach this client"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == "Hello there!"
    # The replica was asked for usage anyway, and the outcome carries its counts.
    assert replica.seen[0].body["stream_options"]["include_usage"] is True
    (outcome,) = gw.outcomes
    assert (outcome.prompt_tokens, outcome.completion_tokens) == (7, 3)
    assert outcome.replica == "r1"
    assert outcome.status == 200
    assert outcome.stream is True
    assert outcome.error is None
    assert outcome.ttft_s is not None
    assert outcome.ttft_s >= 0


async def test_usage_chunk_passes_through_when_the_client_asked(
    start_replica: StartReplica, start_gateway: StartGateway
) -> None:
    """Fake replica: the default vLLM-like stream."""
    replica = FakeReplica()
    _, url = await start_replica(replica)
    gw = await start_gateway({"r1": url})

    resp = await gw.client.post(
        "/v1/chat/completions", json={**CHAT, "stream_options": {"include_usage": True}}
    )

    events = data_events(await resp.read())
    usage = [c for c in payloads(events) if c["choices"] == []]
    assert [u["usage"]["completion_tokens"] for u in usage] == [3]
    assert events[-1] == "[DONE]"
    # Forwarded unchanged: the client's own bytes (no rewrite needed).
    assert replica.seen[0].body["stream_options"] == {"include_usage": True}
    assert (gw.outcomes[0].prompt_tokens, gw.outcomes[0].completion_tokens) == (7, 3)


async def test_non_streaming_usage_is_read_from_the_body(
    start_replica: StartReplica, start_gateway: StartGateway
) -> None:
    """Fake replica: a plain JSON completion with usage."""
    replica = FakeReplica()
    _, url = await start_replica(replica)
    gw = await start_gateway({"r1": url})

    resp = await gw.client.post("/v1/chat/completions", json={**CHAT, "stream": False})

    assert resp.status == 200
    assert (await resp.json())["choices"][0]["message"]["content"] == "Hello there!"
    assert "stream_options" not in replica.seen[0].body
    (outcome,) = gw.outcomes
    assert (outcome.prompt_tokens, outcome.completion_tokens, outcome.stream) == (7, 3, False)


async def test_completions_endpoint_is_forwarded_to_the_same_path(
    start_replica: StartReplica, start_gateway: StartGateway
) -> None:
    """Fake replica records which path it was called on."""
    replica = FakeReplica()
    _, url = await start_replica(replica)
    gw = await start_gateway({"r1": url})

    resp = await gw.client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "stream": True})

    assert resp.status == 200
    assert data_events(await resp.read())[-1] == "[DONE]"
    assert replica.seen[0].path == "/v1/completions"


def _cut_after_two_events(*, clean_eof: bool):
    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(sse(chat_chunk("Hel")) + sse(chat_chunk("lo")))
        if clean_eof:
            await response.write_eof()  # a well-formed end of body, but no [DONE]
        else:
            assert request.transport is not None
            request.transport.close()  # the replica process dies mid-stream
        return response

    return handler


@pytest.mark.parametrize(
    "clean_eof",
    [pytest.param(False, id="connection-dropped"), pytest.param(True, id="body-ended-without-done")],
)
async def test_a_stream_cut_midway_ends_with_an_error_event(
    start_replica: StartReplica, start_gateway: StartGateway, clean_eof: bool
) -> None:
    """Fake replica that sends two events and then breaks the stream: the emulator never does."""
    replica = FakeReplica(handler=_cut_after_two_events(clean_eof=clean_eof))
    _, url = await start_replica(replica)
    gw = await start_gateway({"r1": url})

    resp = await gw.client.post("/v1/chat/completions", json=CHAT)

    assert resp.status == 200  # the headers were already sent when the stream broke
    events = data_events(await resp.read())  # returns: the gateway closes, never hangs
    assert "[DONE]" not in events
    assert [c["choices"][0]["delta"]["content"] for c in payloads(events[:2])] == ["Hel", "lo"]
    error = json.loads(events[-1])["error"]
    assert error["type"] == "upstream_error"
    assert "r1" in error["message"]
    assert gw.outcomes[0].error == "upstream_error"
    assert "x-request-id" in resp.headers
