"""SSE framing and response bodies (pure builders)."""

from __future__ import annotations

import json

import pytest

from simulator import tokens
from simulator.engine import TokenEvent
from simulator.openai_bodies import (
    SSE_DONE,
    ResponseIds,
    chat_body,
    completion_body,
    sse_event,
    stream_usage,
    usage,
    usage_chunk,
)
from simulator.openai_handlers import _step_chunks
from simulator.replica import GenerationRequest

IDS = ResponseIds(id="cmpl-1", created=1700000000, model="m", fingerprint="vllm-0.32.0-0123abcd")


def request(
    kind: str = "completion", *, continuous: bool = False, include_usage: bool = True
) -> GenerationRequest:
    return GenerationRequest(
        kind=kind,  # type: ignore[arg-type]
        model="m",
        prompt_tokens=10,
        max_tokens=5,
        ignore_eos=False,
        min_tokens=0,
        stream=True,
        include_usage=include_usage,
        continuous_usage_stats=continuous,
        text_seed=42,
    )


def event(total: int, *, new: int = 1, finish: str | None = None) -> TokenEvent:
    return TokenEvent("r", new, total, finish is not None, finish)  # type: ignore[arg-type]


def test_sse_event_framing() -> None:
    raw = sse_event({"a": 1, "b": [1, 2], "c": "é"})
    assert raw == 'data: {"a":1,"b":[1,2],"c":"é"}\n\n'.encode()
    assert raw.startswith(b"data: ")
    assert raw.endswith(b"\n\n")
    assert b"\n" not in raw[:-2]


def test_done_marker() -> None:
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_usage_totals() -> None:
    assert usage(10, 3) == {
        "prompt_tokens": 10,
        "total_tokens": 13,
        "completion_tokens": 3,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def test_stream_usage_has_only_the_counts() -> None:
    # vLLM's final usage chunk is dumped with exclude_none: the null details are left out.
    assert stream_usage(10, 3) == {"prompt_tokens": 10, "total_tokens": 13, "completion_tokens": 3}


@pytest.mark.parametrize(
    ("sent", "ev", "text_tokens", "finish"),
    [
        pytest.param(0, event(1), 1, None, id="first-token"),
        pytest.param(1, event(2), 1, None, id="middle-token"),
        pytest.param(2, event(5, new=3), 3, None, id="merged-steps"),
        pytest.param(4, event(5, finish="length"), 1, "length", id="last-token-carries-finish"),
    ],
)
def test_completion_step_chunk(sent: int, ev: TokenEvent, text_tokens: int, finish: str | None) -> None:
    (chunk,) = _step_chunks(request(), IDS, sent, ev.num_output_tokens - sent, ev)
    assert chunk["object"] == "text_completion"
    assert (chunk["id"], chunk["created"], chunk["model"]) == ("cmpl-1", 1700000000, "m")
    (choice,) = chunk["choices"]
    assert choice["index"] == 0
    assert choice["finish_reason"] == finish
    assert choice["text"] == tokens.fake_text(42, sent, text_tokens)
    assert "usage" not in chunk


def test_chat_first_step_sends_role_then_content() -> None:
    role, content = _step_chunks(request("chat"), IDS, 0, 1, event(1))
    assert role["object"] == content["object"] == "chat.completion.chunk"
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert role["choices"][0]["finish_reason"] is None
    assert content["choices"][0]["delta"] == {"content": tokens.fake_text(42, 0, 1)}


def test_chat_later_step_has_no_role_and_finish_on_last() -> None:
    (chunk,) = _step_chunks(request("chat"), IDS, 3, 1, event(4, finish="stop"))
    assert "role" not in chunk["choices"][0]["delta"]
    assert chunk["choices"][0]["finish_reason"] == "stop"


def test_continuous_usage_in_every_chunk() -> None:
    (chunk,) = _step_chunks(request(continuous=True), IDS, 1, 1, event(2))
    assert chunk["usage"] == {"prompt_tokens": 10, "total_tokens": 12, "completion_tokens": 2}


def test_chat_continuous_usage_counts_nothing_on_the_role_chunk() -> None:
    role, content = _step_chunks(request("chat", continuous=True), IDS, 0, 1, event(1))
    # As vLLM: the role chunk comes before any output; chat chunks set completion_tokens_details.
    assert role["usage"] == {**stream_usage(10, 0), "completion_tokens_details": None}
    assert content["usage"] == {**stream_usage(10, 1), "completion_tokens_details": None}


def test_chat_chunk_keys_are_vllms() -> None:
    role, content = _step_chunks(request("chat"), IDS, 0, 1, event(1))
    (finish,) = _step_chunks(request("chat"), IDS, 1, 1, event(2, finish="length"))
    assert set(role) == {"id", "object", "created", "model", "choices", "prompt_token_ids", "prompt_text"}
    assert set(role["choices"][0]) == {"index", "delta", "logprobs", "finish_reason"}
    assert set(content["choices"][0]) == {"index", "delta", "logprobs", "finish_reason", "token_ids"}
    assert set(finish["choices"][0]) == {
        "index", "delta", "logprobs", "finish_reason", "stop_reason", "token_ids"
    }  # fmt: skip


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize(
    ("include_usage", "stamped"),
    [pytest.param(True, False, id="usage-chunk-follows"), pytest.param(False, True, id="no-usage-chunk")],
)
def test_fingerprint_rides_on_the_streams_last_message(kind: str, include_usage: bool, stamped: bool) -> None:
    req = request(kind, include_usage=include_usage)
    middle = _step_chunks(req, IDS, 1, 1, event(2))[-1]
    finish = _step_chunks(req, IDS, 2, 1, event(3, finish="length"))[-1]
    assert "system_fingerprint" not in middle
    assert finish.get("system_fingerprint") == (IDS.fingerprint if stamped else None)
    assert usage_chunk(kind, IDS, stream_usage(10, 3))["system_fingerprint"] == IDS.fingerprint  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kind", "obj"),
    [
        pytest.param("completion", "text_completion", id="completion"),
        pytest.param("chat", "chat.completion.chunk", id="chat"),
    ],
)
def test_usage_chunk_has_no_choices(kind: str, obj: str) -> None:
    chunk = usage_chunk(kind, IDS, usage(10, 5))  # type: ignore[arg-type]
    assert chunk["object"] == obj
    assert chunk["choices"] == []
    assert chunk["usage"]["total_tokens"] == 15


def test_bodies_are_openai_shaped_and_json_serializable() -> None:
    comp = completion_body(IDS, " a b", "length", usage(3, 2))
    assert comp["object"] == "text_completion"
    assert comp["choices"][0]["text"] == " a b"
    assert comp["usage"]["completion_tokens"] == 2
    chat = chat_body(IDS, " a", "stop", usage(3, 1))
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["choices"][0]["message"]["content"] == " a"
    assert chat["choices"][0]["finish_reason"] == "stop"
    json.dumps([comp, chat])
