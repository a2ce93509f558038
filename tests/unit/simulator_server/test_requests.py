"""Request parsing and validation, as vLLM's OpenAI server validates (pure functions)."""

from __future__ import annotations

from typing import Any

import pytest

from simulator import tokens
from simulator.openai_errors import BodyParseError, error_body
from simulator.openai_requests import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    check_content_type,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
)
from simulator.replica import ApiError

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
        # vLLM 0.32 does not refuse a prompt plus max_tokens over the context: it caps the output.
        pytest.param({"prompt": [1] * 90, "max_tokens": 11}, 90, 10, id="capped-to-context"),
        pytest.param({"prompt": [1] * 95}, 95, 5, id="default-16-capped-too"),
        pytest.param({"prompt": [1] * 99, "max_tokens": 100}, 99, 1, id="max-tokens-equal-to-limit-capped"),
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
        pytest.param({"messages": user("hi"), "max_tokens": 95}, MAX_LEN - (CHAT_OVERHEAD + 1), id="capped"),
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
    req = completion({"prompt": "x", "max_tokens": 8, "ignore_eos": True, "min_tokens": 5})
    assert req.ignore_eos
    assert req.min_tokens == 5


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
        pytest.param(chat, {}, 400, "Bad Request", "body.messages", "Field required", id="missing-messages"),
        pytest.param(
            chat,
            {"messages": "hi"},
            400,
            "Bad Request",
            "body.messages",
            "Input should be a valid list",
            id="messages-not-list",
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
            "Bad Request",
            "body.max_tokens",
            "'type': 'int_parsing'",
            id="max-tokens-not-int",
        ),
        pytest.param(
            completion,
            {"prompt": "x", "max_tokens": 101},
            400,
            "BadRequestError",
            "max_tokens",
            "max_tokens=101 cannot be greater than max_model_len=100.",
            id="max-tokens-over-max-model-len",
        ),
        pytest.param(
            chat,
            {"messages": user("x"), "max_tokens": 5, "max_completion_tokens": 101},
            400,
            "BadRequestError",
            "max_completion_tokens",
            "max_completion_tokens=101 cannot be greater than max_model_len=100.",
            id="max-completion-tokens-over-max-model-len",
        ),
        pytest.param(
            completion,
            {"prompt": "x", "max_tokens": 4, "min_tokens": 5},
            400,
            "BadRequestError",
            None,
            "min_tokens must be less than or equal to max_tokens=4, got 5.",
            id="min-tokens-over-max-tokens",
        ),
        pytest.param(completion, {"prompt": "x", "n": 2}, 400, "BadRequestError", "n", "n=2", id="n-above-1"),
        pytest.param(
            completion, {"prompt": "x", "n": 0}, 400, "BadRequestError", None, "at least 1", id="n-zero"
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
            {"prompt": [1] * 101},
            400,
            "BadRequestError",
            "input_tokens",
            "maximum context length is 100 tokens",
            id="prompt-over-context",
        ),
        pytest.param(
            completion,
            {"prompt": [1] * 100},
            400,
            "BadRequestError",
            "max_tokens",
            "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
            id="prompt-fills-context",
        ),
        pytest.param(
            chat,
            {"messages": user("w " * 200)},
            400,
            "BadRequestError",
            "input_tokens",
            "your prompt contains at least 101 input tokens",
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


@pytest.mark.parametrize(
    ("prompt", "count"),
    [
        # A text is tokenized with truncation to max_model_len + 1: vLLM knows only "at least" that.
        pytest.param("w " * 200, "at least 101", id="text-truncated"),
        pytest.param([1] * 101, "at least 101", id="ids-one-over"),
        pytest.param([1] * 150, "150", id="ids-counted-exactly"),
    ],
)
def test_prompt_too_long_message_has_vllm_wording(prompt: str | list[int], count: str) -> None:
    with pytest.raises(ApiError) as caught:
        completion({"prompt": prompt, "max_tokens": 4})
    value = count.removeprefix("at least ")
    assert caught.value.message == (
        f"This model's maximum context length is 100 tokens. However, your prompt contains {count} "
        "input tokens, which exceeds this limit even without any output tokens. Please reduce the "
        f"length of the input prompt. (parameter=input_tokens, value={value})"
    )


@pytest.mark.parametrize(
    ("raw", "param", "message"),
    [
        # Each message is what the real vLLM 0.32 answered to the same body.
        pytest.param(
            b"{not json",
            "body.1",
            "1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.1', 'msg': 'JSON decode error', "
            "'input': '<dict of 0 items>', "
            "'ctx': {'error': 'Expecting property name enclosed in double quotes'}}",
            id="malformed",
        ),
        pytest.param(
            b"",
            "body",
            "1 validation error:\n  "
            "{'type': 'missing', 'loc': 'body', 'msg': 'Field required', 'input': 'None'}",
            id="empty",
        ),
        pytest.param(
            b"[1, 2]",
            "body",
            "1 validation error:\n  {'type': 'model_attributes_type', 'loc': 'body', 'msg': 'Input should be "
            "a valid dictionary or object to extract fields from', 'input': '<list of 2 items>'}",
            id="array-not-object",
        ),
        pytest.param(b'"text"', "body", None, id="string-not-object"),
        pytest.param(b"\xff\xfe", "body.0", None, id="utf16-bom-not-json"),
    ],
)
def test_bad_json_is_fastapis_400(raw: bytes, param: str, message: str | None) -> None:
    with pytest.raises(ApiError) as caught:
        parse_json_body(raw)
    err = caught.value
    assert (err.status, err.err_type, err.param) == (400, "Bad Request", param)
    if message is not None:
        assert err.message == message


def test_body_that_is_not_utf8_is_fastapis_parse_error() -> None:
    with pytest.raises(BodyParseError, match="There was an error parsing the body"):
        parse_json_body(b'{"model": "\xff\xfe"}')


def test_several_validation_errors_are_listed_with_the_first_as_param() -> None:
    with pytest.raises(ApiError) as caught:
        chat({"max_tokens": "x", "n": "y"})
    err = caught.value
    # vLLM's request model lists messages first, so the missing messages is the first error.
    assert err.param == "body.messages"
    assert err.message.startswith("3 validation errors:\n  {'type': 'missing', 'loc': 'body.messages'")


@pytest.mark.parametrize(
    "content_type",
    [
        pytest.param("application/json", id="json"),
        pytest.param("application/json; charset=utf-8", id="json-charset"),
        pytest.param("Application/JSON", id="case-insensitive"),
    ],
)
def test_json_content_types_are_accepted(content_type: str) -> None:
    assert check_content_type(content_type) == "application/json"


@pytest.mark.parametrize(
    "content_type",
    [
        pytest.param("text/plain", id="text"),
        pytest.param("application/octet-stream", id="octet-stream"),
        pytest.param(None, id="absent"),
    ],
)
def test_other_content_types_are_vllms_400(content_type: str | None) -> None:
    with pytest.raises(ApiError) as caught:
        check_content_type(content_type)
    err = caught.value
    assert (err.status, err.err_type, err.param) == (400, "Bad Request", None)
    assert err.message == "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed"


def test_json_object_parses() -> None:
    assert parse_json_body(b'{"a": 1}') == {"a": 1}


def test_error_body_shape() -> None:
    assert error_body("boom", status=404, err_type="NotFoundError", param="model") == {
        "error": {"message": "boom", "type": "NotFoundError", "param": "model", "code": 404}
    }
