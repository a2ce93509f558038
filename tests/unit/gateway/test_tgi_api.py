"""TGI's native request and answer shapes (``/generate``, ``/generate_stream``), table-driven.

The shapes follow TGI's router (``router/src/lib.rs``: ``GenerateRequest``, ``GenerateParameters``
with ``max_new_tokens`` defaulting to 100, ``StreamResponse``, ``StreamDetails``, ``ErrorResponse``).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.api.openai import parse_native, parse_request, resolve_native_model, upstream_body
from gateway.api.tgi import (
    error_event,
    generated_tokens,
    input_tokens,
    is_final_event,
    is_token_event,
    without_details,
)
from gateway.http.errors import InvalidRequest, ModelNotFound

MODEL = "tgi-model"


def native(endpoint: str, body: dict[str, Any]) -> Any:
    return parse_native(endpoint, json.dumps(body).encode(), MODEL)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("endpoint", "body", "stream", "max_tokens", "details"),
    [
        pytest.param("generate", {"inputs": "Hi"}, False, 100, False, id="tgi-default-cap-100"),
        pytest.param(
            "generate",
            {"inputs": "Hi", "parameters": {"max_new_tokens": 7, "details": True}},
            False,
            7,
            True,
            id="cap-and-details",
        ),
        pytest.param("generate", {"inputs": "Hi", "stream": True}, True, 100, False, id="compat-stream"),
        pytest.param(
            "generate_stream",
            {"inputs": "Hi", "parameters": {"max_new_tokens": None}},
            True,
            None,
            False,
            id="stream-route-null-cap",
        ),
    ],
)
def test_parse_native(
    endpoint: str, body: dict[str, Any], stream: bool, max_tokens: int | None, details: bool
) -> None:
    parsed = native(endpoint, body)

    assert (parsed.model, parsed.stream, parsed.max_tokens, parsed.details) == (
        MODEL,
        stream,
        max_tokens,
        details,
    )
    assert (parsed.engine, parsed.native, parsed.prompt_chars) == ("tgi", True, 2)


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        pytest.param(b"{", None, id="not-json"),
        pytest.param(b"[1]", None, id="not-an-object"),
        pytest.param(b"{}", "inputs", id="no-inputs"),
        pytest.param(b'{"inputs": 3}', "inputs", id="inputs-not-text"),
        pytest.param(
            b'{"inputs": "x", "parameters": {"max_new_tokens": -1}}',
            "parameters.max_new_tokens",
            id="negative-cap",
        ),
        pytest.param(
            b'{"inputs": "x", "parameters": {"details": "yes"}}', "parameters.details", id="details-not-bool"
        ),
        pytest.param(b'{"inputs": "x", "stream": 1}', "stream", id="stream-not-bool"),
    ],
)
def test_bad_native_bodies_are_400_naming_the_field(raw: bytes, param: str | None) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_native("generate", raw, MODEL)

    assert caught.value.status == 400
    assert caught.value.param == param


def test_openai_parser_refuses_native_endpoints() -> None:
    with pytest.raises(ValueError, match="native"):
        parse_request("generate", b'{"inputs": "x"}')


@pytest.mark.parametrize(
    ("served", "asked", "expected"),
    [
        pytest.param(["m1"], None, "m1", id="the-one-model"),
        pytest.param(["m1", "m2"], "m2", "m2", id="header-picks"),
        pytest.param(["m1"], "m2", ModelNotFound, id="header-names-unknown"),
        pytest.param([], None, ModelNotFound, id="no-tgi-replica"),
        pytest.param(["m1", "m2"], None, InvalidRequest, id="ambiguous"),
    ],
)
def test_resolve_native_model(served: list[str], asked: str | None, expected: str | type[Exception]) -> None:
    if isinstance(expected, str):
        assert resolve_native_model(served, asked) == expected
        return
    with pytest.raises(expected):
        resolve_native_model(served, asked)


def test_non_streamed_generate_always_asks_for_details() -> None:
    plain = native("generate", {"inputs": "Hi", "parameters": {"max_new_tokens": 5, "top_k": 3}})
    asked = native("generate", {"inputs": "Hi", "parameters": {"details": True}})
    streamed = native("generate_stream", {"inputs": "Hi"})

    sent = json.loads(upstream_body(plain))
    assert sent == {"inputs": "Hi", "parameters": {"max_new_tokens": 5, "top_k": 3, "details": True}}
    assert upstream_body(asked) == asked.raw
    assert upstream_body(streamed) == streamed.raw


GENERATE_ANSWER = {
    "generated_text": " world",
    "details": {
        "finish_reason": "length",
        "generated_tokens": 2,
        "seed": None,
        "prefill": [{"id": 1, "text": "<s>", "logprob": None}, {"id": 2, "text": "Hi", "logprob": -1.0}],
        "tokens": [
            {"id": 3, "text": " wor", "logprob": -0.5, "special": False},
            {"id": 4, "text": "ld", "logprob": -0.1, "special": False},
        ],
    },
}
TOKEN_EVENT = {
    "index": 1,
    "token": {"id": 3, "text": " wor", "logprob": -0.5, "special": False},
    "generated_text": None,
    "details": None,
}
FINAL_EVENT = {
    "index": 2,
    "token": {"id": 4, "text": "ld", "logprob": -0.1, "special": False},
    "generated_text": " world",
    "details": {"finish_reason": "length", "generated_tokens": 2, "seed": None, "input_length": 2},
}


@pytest.mark.parametrize(
    ("payload", "produced", "prompt", "token", "final"),
    [
        pytest.param(GENERATE_ANSWER, 2, 2, False, True, id="generate-answer-prefill"),
        pytest.param(TOKEN_EVENT, None, None, True, False, id="token-event"),
        pytest.param(FINAL_EVENT, 2, 2, True, True, id="final-event-input-length"),
        pytest.param({**FINAL_EVENT, "details": None}, None, None, True, True, id="final-no-details"),
        pytest.param(
            {"error": "boom", "error_type": "generation"}, None, None, False, False, id="error-event"
        ),
        pytest.param([1], None, None, False, False, id="not-an-object"),
    ],
)
def test_reading_answers(
    payload: Any, produced: int | None, prompt: int | None, token: bool, final: bool
) -> None:
    assert (generated_tokens(payload), input_tokens(payload)) == (produced, prompt)
    assert (is_token_event(payload), is_final_event(payload)) == (token, final)


def test_details_removed_for_a_client_that_did_not_ask() -> None:
    assert json.loads(without_details(json.dumps(GENERATE_ANSWER).encode())) == {"generated_text": " world"}
    assert without_details(b"not json") == b"not json"


def test_error_event_is_tgis_shape() -> None:
    event = error_event("replica r1 failed", "upstream_error")

    assert event.startswith(b"data: ")
    assert event.endswith(b"\n\n")
    assert json.loads(event[6:]) == {"error": "replica r1 failed", "error_type": "upstream_error"}
