"""Request parsing, the forwarded body, usage and model lists (pure functions)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.api.openai import COMPLETIONS_DEFAULT_MAX_TOKENS, parse_request, upstream_body, with_max_tokens
from gateway.api.responses import (
    ModelCard,
    Usage,
    carries_tokens,
    is_usage_only_chunk,
    models_list,
    parse_models,
    usage_of,
)
from gateway.http.errors import InvalidRequest

MSGS = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("body", "stream", "include_usage", "max_tokens"),
    [
        pytest.param({"model": "m", "messages": MSGS}, False, False, None, id="minimal"),
        pytest.param({"model": "m", "messages": MSGS, "stream": None}, False, False, None, id="stream-null"),
        pytest.param({"model": "m", "messages": MSGS, "stream": True}, True, False, None, id="stream"),
        pytest.param(
            {"model": "m", "messages": MSGS, "stream": True, "stream_options": {"include_usage": True}},
            True,
            True,
            None,
            id="stream-with-usage",
        ),
        pytest.param({"model": "m", "messages": MSGS, "max_tokens": 9}, False, False, 9, id="max-tokens"),
        pytest.param(
            {"model": "m", "messages": MSGS, "max_tokens": 9, "max_completion_tokens": 4},
            False,
            False,
            4,
            id="max-completion-tokens-wins",
        ),
    ],
)
def test_parse_chat(body: dict[str, Any], stream: bool, include_usage: bool, max_tokens: int | None) -> None:
    parsed = parse_request("chat", json.dumps(body).encode())
    assert (parsed.model, parsed.stream, parsed.include_usage, parsed.max_tokens) == (
        "m",
        stream,
        include_usage,
        max_tokens,
    )


@pytest.mark.parametrize(
    ("fields", "max_tokens"),
    [
        pytest.param({}, COMPLETIONS_DEFAULT_MAX_TOKENS, id="absent-vllms-default"),
        pytest.param({"max_tokens": None}, COMPLETIONS_DEFAULT_MAX_TOKENS, id="null-vllms-default"),
        pytest.param({"max_tokens": 300}, 300, id="given"),
    ],
)
def test_a_completions_max_tokens_defaults_as_vllms(fields: dict[str, Any], max_tokens: int) -> None:
    assert COMPLETIONS_DEFAULT_MAX_TOKENS == 16
    body = {"model": "m", "prompt": "hi", **fields}
    assert parse_request("completions", json.dumps(body).encode()).max_tokens == max_tokens
    # A chat has no default: the context left.
    assert parse_request("chat", json.dumps({"model": "m", "messages": MSGS}).encode()).max_tokens is None


@pytest.mark.parametrize("stream", [False, True])
def test_a_max_tokens_the_gateway_set_is_forwarded(stream: bool) -> None:
    raw = json.dumps({"model": "m", "messages": MSGS, "stream": stream, "extra": "é"}).encode()
    parsed = with_max_tokens(parse_request("chat", raw), 450)
    assert (parsed.max_tokens, parsed.max_tokens_set) == (450, 450)
    forwarded = json.loads(upstream_body(parsed))
    assert forwarded["max_tokens"] == 450
    assert forwarded["extra"] == "é"
    assert forwarded.get("stream_options") == ({"include_usage": True} if stream else None)


@pytest.mark.parametrize(
    "prompt",
    [
        pytest.param("hi", id="string"),
        pytest.param(["a", "b"], id="strings"),
        pytest.param([1, 2, 3], id="token-ids"),
        pytest.param([[1, 2], [3]], id="token-id-lists"),
    ],
)
def test_parse_completion_prompt_shapes(prompt: Any) -> None:
    assert parse_request("completions", json.dumps({"model": "m", "prompt": prompt}).encode()).model == "m"


@pytest.mark.parametrize(
    ("endpoint", "fields", "choices", "longest"),
    [
        pytest.param("chat", {"messages": MSGS}, 1, None, id="chat"),
        pytest.param("chat", {"messages": MSGS, "n": 3}, 3, None, id="chat-n"),
        pytest.param("completions", {"prompt": "hi"}, 1, None, id="string"),
        pytest.param("completions", {"prompt": "hi", "n": 2}, 2, None, id="string-n"),
        pytest.param("completions", {"prompt": ["a", "bcd", "ef"]}, 3, 3, id="strings"),
        pytest.param("completions", {"prompt": ["a", "b", "c"], "n": 2}, 6, 1, id="strings-n"),
        pytest.param("completions", {"prompt": ["é", "b"]}, 2, 1, id="strings-non-ascii"),
        pytest.param("completions", {"prompt": [1, 2, 3]}, 1, None, id="token-ids"),
        pytest.param("completions", {"prompt": [[1, 2], [3]], "n": 4}, 8, 2, id="token-id-lists-n"),
        pytest.param("completions", {"prompt": ["only"]}, 1, None, id="one-item-list"),
        pytest.param("completions", {"prompt": []}, 1, None, id="empty-list"),
    ],
)
def test_each_prompt_is_a_sequence_of_its_own(
    endpoint: Any, fields: dict[str, Any], choices: int, longest: int | None
) -> None:
    """vLLM decodes one sequence per prompt of a list (``n`` of them each): that is what the
    request is sized, reserved and admitted as, and each prompt alone must fit the context."""
    parsed = parse_request(endpoint, json.dumps({"model": "m", **fields}).encode())
    assert (parsed.choices, parsed.longest_prompt) == (choices, longest)


@pytest.mark.parametrize(
    ("endpoint", "raw", "message_start"),
    [
        pytest.param("chat", b"{", "request body is not valid JSON", id="bad-json"),
        pytest.param("chat", b'"text"', "request body must be a JSON object", id="string-body"),
        pytest.param("chat", b'{"model": "m"}', "messages: field required", id="missing-messages"),
        pytest.param(
            "chat", b'{"model": "", "messages": [{}]}', "model: must not be empty", id="empty-model"
        ),
        pytest.param(
            "chat",
            b'{"model": "m", "messages": [{}], "stream_options": {"include_usage": "y"}}',
            "stream_options.include_usage: must be true or false",
            id="nested-path",
        ),
        pytest.param("completions", b'{"model": "m", "prompt": 5}', "prompt: must be", id="prompt-int"),
        pytest.param("chat", b'{"model": 5, "messages": [{}]}', "model: must be a string", id="model-int"),
        pytest.param(
            "chat", b'{"model": "m", "messages": []}', "messages: must not be empty", id="no-messages"
        ),
        pytest.param(
            "chat", b'{"model": "m", "messages": {}}', "messages: must be a list", id="messages-object"
        ),
        pytest.param(
            "chat",
            b'{"model": "m", "messages": [{}], "max_tokens": 0}',
            "max_tokens: must be at least 1",
            id="zero",
        ),
        pytest.param(
            "chat", b'{"model": "m", "messages": [{}], "n": 129}', "n: must be at most 128", id="n-over-128"
        ),
        pytest.param(
            "chat",
            b'{"model": "m", "messages": [{}], "max_tokens": "9"}',
            "max_tokens: must be an integer",
            id="str",
        ),
        pytest.param(
            "chat",
            b'{"model": "m", "messages": [{}], "stream_options": 1}',
            "stream_options: must be an object",
            id="options-int",
        ),
    ],
)
def test_invalid_requests_name_the_field(endpoint: Any, raw: bytes, message_start: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_request(endpoint, raw)
    assert caught.value.message.startswith(message_start)
    assert caught.value.status == 400


@pytest.mark.parametrize(
    ("body", "expected_options"),
    [
        pytest.param({"stream": True}, {"include_usage": True}, id="added"),
        pytest.param(
            {"stream": True, "stream_options": {"continuous_usage_stats": False}},
            {"continuous_usage_stats": False, "include_usage": True},
            id="merged-with-other-options",
        ),
        pytest.param(
            {"stream": True, "stream_options": {"include_usage": False}},
            {"include_usage": True},
            id="false-overridden",
        ),
        pytest.param({"stream": False}, None, id="not-streaming-untouched"),
    ],
)
def test_upstream_body_always_asks_for_usage_when_streaming(
    body: dict[str, Any], expected_options: dict[str, Any] | None
) -> None:
    raw = json.dumps({"model": "m", "messages": MSGS, "extra": "é", **body}).encode()
    forwarded = json.loads(upstream_body(parse_request("chat", raw)))
    assert forwarded.get("stream_options") == expected_options
    assert forwarded["extra"] == "é"


def test_upstream_body_is_the_clients_bytes_when_nothing_changes() -> None:
    raw = (
        b'{"model":"m","messages":[{"role":"user","content":"hi"}],'
        b'"stream":true,"stream_options":{"include_usage":true}}'
    )
    assert upstream_body(parse_request("chat", raw)) == raw


@pytest.mark.parametrize(
    ("payload", "usage", "usage_only"),
    [
        pytest.param(
            {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}},
            Usage(3, 4),
            True,
            id="final",
        ),
        pytest.param({"choices": [{"delta": {}}], "usage": None}, None, False, id="null-usage"),
        pytest.param(
            {"choices": [{}], "usage": {"prompt_tokens": 3}}, Usage(3, None), False, id="continuous"
        ),
        pytest.param({"usage": {"prompt_tokens": True}}, Usage(None, None), False, id="bool-not-int"),
        pytest.param([1], None, False, id="not-an-object"),
    ],
)
def test_usage(payload: Any, usage: Usage | None, usage_only: bool) -> None:
    assert usage_of(payload) == usage
    assert is_usage_only_chunk(payload) is usage_only


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        pytest.param({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, False, id="role-only"),
        pytest.param({"choices": [{"delta": {"content": "x"}}]}, True, id="content"),
        pytest.param({"choices": [{"delta": {"reasoning_content": "x"}}]}, True, id="reasoning"),
        pytest.param({"choices": [{"delta": {"tool_calls": [{}]}}]}, True, id="tool-call"),
        pytest.param({"choices": [{"text": "x"}]}, True, id="completion-text"),
        pytest.param({"choices": [{"text": "", "finish_reason": "length"}]}, True, id="finish-only"),
        pytest.param({"choices": []}, False, id="no-choices"),
    ],
)
def test_carries_tokens(payload: Any, expected: bool) -> None:
    assert carries_tokens(payload) is expected


def test_models_list_merges_by_id_with_the_smallest_context() -> None:
    a = parse_models({"data": [{"id": "m1", "max_model_len": 8192, "owned_by": "a"}, {"id": "m2"}]})
    b = parse_models({"data": [{"id": "m1", "max_model_len": 4096, "owned_by": "b"}]})
    merged = models_list([a, b])
    assert merged["object"] == "list"
    assert merged["data"] == [{"id": "m1", "max_model_len": 4096, "owned_by": "a"}, {"id": "m2"}]
    assert a["m1"] == ModelCard("m1", 8192, {"id": "m1", "max_model_len": 8192, "owned_by": "a"})


@pytest.mark.parametrize(
    "payload",
    [pytest.param({"data": "x"}, id="data-not-list"), pytest.param({"data": [{"name": "m"}]}, id="no-id")],
)
def test_parse_models_rejects_malformed_lists(payload: Any) -> None:
    with pytest.raises(ValueError, match="/v1/models"):
        parse_models(payload)
