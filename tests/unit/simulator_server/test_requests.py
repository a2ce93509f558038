"""Request parsing and validation, as vLLM's OpenAI server validates (pure functions)."""

from __future__ import annotations

from typing import Any

import pytest

from simulator import tokens
from simulator.server import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ApiError,
    error_body,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
)

MODEL = "test-model"
MAX_LEN = 100


def completion(body: dict[str, Any]):
    return parse_completion_request({"model": MODEL, **body}, served_model=MODEL, max_model_len=MAX_LEN)


def chat(body: dict[str, Any]):
    return parse_chat_request({"model": MODEL, **body}, served_model=MODEL, max_model_len=MAX_LEN)


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


CHAT_OVERHEAD = tokens.BOS_TOKENS + tokens.CHAT_TOKENS_PER_MESSAGE + tokens.CHAT_GENERATION_PROMPT_TOKENS


@pytest.mark.parametrize(
    ("body", "prompt_tokens", "max_tokens"),
    [
        pytest.param({"prompt": "one two three"}, 4, COMPLETIONS_DEFAULT_MAX_TOKENS, id="default-16"),
        pytest.param({"prompt": "one two three", "max_tokens": None}, 4, 16, id="null-max-tokens-is-16"),
        pytest.param({"prompt": "x", "max_tokens": 7}, 2, 7, id="explicit"),
        pytest.param({"prompt": [1, 2, 3, 4, 5]}, 5, 16, id="token-ids"),
        pytest.param({"prompt": ["a b c"]}, 4, 16, id="list-of-one-string"),
        pytest.param({"prompt": [[9, 9]]}, 2, 16, id="list-of-one-id-list"),
        pytest.param({"prompt": [1] * 90, "max_tokens": 10}, 90, 10, id="exactly-fills-context"),
    ],
)
def test_completion_tokens_and_max_tokens(body: dict[str, Any], prompt_tokens: int, max_tokens: int) -> None:
    req = completion(body)
    assert (req.kind, req.prompt_tokens, req.max_tokens) == ("completion", prompt_tokens, max_tokens)


@pytest.mark.parametrize(
    ("body", "max_tokens"),
    [
        pytest.param({"messages": user("hi")}, MAX_LEN - (CHAT_OVERHEAD + 1), id="default-fills-context"),
        pytest.param({"messages": user("hi"), "max_tokens": 5}, 5, id="max-tokens"),
        pytest.param({"messages": user("hi"), "max_completion_tokens": 6}, 6, id="max-completion-tokens"),
        pytest.param(
            {"messages": user("hi"), "max_tokens": 5, "max_completion_tokens": 3},
            3,
            id="completion-tokens-win",
        ),
    ],
)
def test_chat_max_tokens(body: dict[str, Any], max_tokens: int) -> None:
    req = chat(body)
    assert req.kind == "chat"
    assert req.prompt_tokens == CHAT_OVERHEAD + 1
    assert req.max_tokens == max_tokens


def test_missing_model_uses_the_served_one() -> None:
    # vLLM's _is_model_supported: an absent or empty model name means the served model.
    req = parse_completion_request({"prompt": "x"}, served_model=MODEL, max_model_len=MAX_LEN)
    assert req.model == MODEL


@pytest.mark.parametrize(
    ("body", "stream", "include_usage", "continuous"),
    [
        pytest.param({}, False, False, False, id="not-streaming"),
        pytest.param({"stream": True}, True, False, False, id="stream-no-options"),
        pytest.param(
            {"stream": True, "stream_options": {"include_usage": True}}, True, True, False, id="usage"
        ),
        pytest.param(
            {"stream": True, "stream_options": {}}, True, True, False, id="include-usage-defaults-true"
        ),
        pytest.param(
            {"stream": True, "stream_options": {"include_usage": False, "continuous_usage_stats": True}},
            True,
            False,
            True,
            id="continuous",
        ),
    ],
)
def test_stream_flags(body: dict[str, Any], stream: bool, include_usage: bool, continuous: bool) -> None:
    req = completion({"prompt": "x", **body})
    assert (req.stream, req.include_usage, req.continuous_usage_stats) == (stream, include_usage, continuous)


def test_ignore_eos_and_min_tokens_pass_through() -> None:
    req = completion({"prompt": "x", "max_tokens": 8, "ignore_eos": True, "min_tokens": 20})
    assert req.ignore_eos
    assert req.min_tokens == 8  # capped at max_tokens


def test_same_prompt_same_seed() -> None:
    assert completion({"prompt": "abc"}).text_seed == completion({"prompt": "abc"}).text_seed
    assert completion({"prompt": "abc"}).text_seed != completion({"prompt": "abd"}).text_seed


@pytest.mark.parametrize(
    ("parse", "body", "status", "err_type", "param", "fragment"),
    [
        pytest.param(
            completion, {}, 400, "BadRequestError", "prompt", "must be provided", id="missing-prompt"
        ),
        pytest.param(
            completion, {"prompt": ""}, 400, "BadRequestError", "prompt", "non-empty", id="empty-prompt"
        ),
        pytest.param(
            completion, {"prompt": ["a", "b"]}, 400, "BadRequestError", "prompt", "batch", id="batch"
        ),
        pytest.param(chat, {}, 400, "BadRequestError", None, "messages", id="missing-messages"),
        pytest.param(
            chat, {"messages": "hi"}, 400, "BadRequestError", None, "messages", id="messages-not-list"
        ),
        pytest.param(
            completion,
            {"prompt": "x", "model": "nope"},
            404,
            "NotFoundError",
            "model",
            "`nope` does not exist",
            id="unknown-model",
        ),
        pytest.param(
            chat,
            {"messages": user("x"), "model": "nope"},
            404,
            "NotFoundError",
            "model",
            "does not exist",
            id="unknown-model-chat",
        ),
        pytest.param(
            completion,
            {"prompt": "x", "max_tokens": 0},
            400,
            "BadRequestError",
            "max_tokens",
            "at least 1",
            id="zero-max-tokens",
        ),
        pytest.param(
            completion,
            {"prompt": "x", "max_tokens": "many"},
            400,
            "BadRequestError",
            None,
            "max_tokens",
            id="max-tokens-not-int",
        ),
        pytest.param(completion, {"prompt": "x", "n": 2}, 400, "BadRequestError", "n", "n=2", id="n-above-1"),
        pytest.param(
            completion, {"prompt": "x", "n": 0}, 400, "BadRequestError", "n", "at least 1", id="n-zero"
        ),
        pytest.param(
            completion,
            {"prompt": "x", "stream_options": {"include_usage": True}},
            400,
            "BadRequestError",
            "stream_options",
            "stream=True",
            id="stream-options-without-stream",
        ),
        pytest.param(
            completion,
            {"prompt": [1] * 90, "max_tokens": 11},
            400,
            "BadRequestError",
            "input_tokens",
            "maximum context length is 100 tokens",
            id="prompt-plus-output-too-long",
        ),
        pytest.param(
            completion,
            {"prompt": [1] * 95},
            400,
            "BadRequestError",
            "input_tokens",
            "requested 16 output tokens",
            id="default-16-is-checked-too",
        ),
        pytest.param(
            completion,
            {"prompt": [1] * 100},
            400,
            "BadRequestError",
            "input_tokens",
            "prompt contains at least 100 input tokens",
            id="prompt-fills-context",
        ),
        pytest.param(
            chat,
            {"messages": user("w " * 200)},
            400,
            "BadRequestError",
            "input_tokens",
            "requested 0 output tokens",
            id="chat-prompt-too-long-no-max",
        ),
    ],
)
def test_rejections(
    parse: Any, body: dict[str, Any], status: int, err_type: str, param: str | None, fragment: str
) -> None:
    with pytest.raises(ApiError) as caught:
        parse(body)
    err = caught.value
    assert (err.status, err.err_type, err.param) == (status, err_type, param)
    assert fragment in err.message


def test_context_length_message_has_vllm_wording() -> None:
    with pytest.raises(ApiError) as caught:
        completion({"prompt": [1] * 90, "max_tokens": 20})
    assert caught.value.message == (
        "This model's maximum context length is 100 tokens. However, you requested 20 output tokens "
        "and your prompt contains at least 90 input tokens, for a total of at least 110 tokens. "
        "Please reduce the length of the input prompt or the number of requested output tokens. "
        "(parameter=input_tokens, value=90)"
    )


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b"{not json", id="malformed"),
        pytest.param(b"", id="empty"),
        pytest.param(b"\xff\xfe", id="not-utf8"),
        pytest.param(b"[1, 2]", id="array-not-object"),
        pytest.param(b'"text"', id="string-not-object"),
    ],
)
def test_bad_json_is_400(raw: bytes) -> None:
    with pytest.raises(ApiError) as caught:
        parse_json_body(raw)
    assert caught.value.status == 400


def test_json_object_parses() -> None:
    assert parse_json_body(b'{"a": 1}') == {"a": 1}


def test_error_body_shape() -> None:
    assert error_body("boom", status=404, err_type="NotFoundError", param="model") == {
        "error": {"message": "boom", "type": "NotFoundError", "param": "model", "code": 404}
    }
