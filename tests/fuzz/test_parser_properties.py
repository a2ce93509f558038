"""Property-based tests of the request parsers: any input is a valid ``ParsedRequest`` or a 400.

``parse_request`` (OpenAI bodies) and ``parse_native`` (TGI bodies) are fed arbitrary bytes,
arbitrary JSON, near-valid bodies with every field given every type (huge and negative integers,
``n`` > 1, prompts of every shape, unknown fields, lone surrogates), bodies with one byte broken
(invalid UTF-8 inside a string), UTF-16/32 encodings, nesting thousands of levels deep and
integers longer than Python's 4300-digit conversion limit. The property: the parser returns a
``ParsedRequest`` whose forwarded body (``upstream_body``) is valid UTF-8 JSON saying the same as
the client's, or raises ``InvalidRequest`` (400) with a serialisable OpenAI-style body; never
another exception (which the error middleware would turn into a 500).

Deterministic: ``derandomize=True`` and no example database, so CI runs the same examples each
time; ``deadline=None`` because the machine is shared.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.api.openai import (
    MAX_CHOICES,
    MAX_TOKENS_LIMIT,
    Endpoint,
    ParsedRequest,
    parse_native,
    parse_request,
    upstream_body,
)
from gateway.http.errors import InvalidRequest, error_response

BOUNDED = settings(
    max_examples=150,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
MODEL = "fuzz-model"

#: Every code point, surrogates included (``"\ud800"`` is valid JSON, not encodable UTF-8).
ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=20)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(10**40), max_value=10**40)
    | st.floats()  # NaN and infinities included: Python's json reads and writes them
    | ANY_TEXT
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(ANY_TEXT, inner, max_size=4),
    max_leaves=20,
)
TOKEN_IDS = st.lists(st.integers(min_value=-(10**20), max_value=10**20), max_size=5)
PROMPTS = (
    ANY_TEXT
    | st.lists(ANY_TEXT, max_size=4)
    | TOKEN_IDS
    | st.lists(TOKEN_IDS, max_size=3)
    | st.lists(ANY_TEXT | st.integers() | TOKEN_IDS, max_size=4)  # mixed shapes: refused
    | JSON_VALUES
)
MESSAGE = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["system", "user", "assistant", "tool"]) | JSON_VALUES,
        "content": ANY_TEXT
        | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": ANY_TEXT}) | JSON_VALUES)
        | JSON_VALUES,
        "name": ANY_TEXT,
    },
)
COUNTS = st.integers() | st.integers(min_value=-(10**30), max_value=10**30) | JSON_VALUES
OPENAI_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.just(MODEL) | ANY_TEXT | JSON_VALUES,
    "messages": st.lists(MESSAGE | JSON_VALUES, max_size=3) | JSON_VALUES,
    "prompt": PROMPTS,
    "stream": st.booleans() | JSON_VALUES,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | JSON_VALUES})
    | JSON_VALUES,
    "max_tokens": COUNTS,
    "max_completion_tokens": COUNTS,
    "n": st.integers(min_value=-5, max_value=10**6) | JSON_VALUES,
    "temperature": st.floats() | JSON_VALUES,
    "unknown_field": JSON_VALUES,
}
OPENAI_BODIES = st.fixed_dictionaries({}, optional=OPENAI_FIELDS) | JSON_VALUES
NATIVE_BODIES = (
    st.fixed_dictionaries(
        {},
        optional={
            "inputs": ANY_TEXT | JSON_VALUES,
            "parameters": st.fixed_dictionaries(
                {},
                optional={
                    "max_new_tokens": COUNTS,
                    "details": st.booleans() | JSON_VALUES,
                    "best_of": COUNTS,
                    "stop": JSON_VALUES,
                },
            )
            | JSON_VALUES,
            "stream": st.booleans() | JSON_VALUES,
            "unknown_field": JSON_VALUES,
        },
    )
    | JSON_VALUES
)
ENCODINGS = st.sampled_from(["utf-8", "utf-16", "utf-32"])


def encode(body: object, encoding: str) -> bytes:
    """``body`` as JSON text in ``encoding`` (escaped ASCII for UTF-8, so surrogates survive)."""
    if encoding == "utf-8":
        return json.dumps(body).encode()
    return json.dumps(body, ensure_ascii=False).encode(encoding, "surrogatepass")


def canonical(value: object) -> str:
    """A comparable form of decoded JSON (NaN equals NaN here, unlike with ``==``)."""
    return json.dumps(value, sort_keys=True)


def assert_valid_or_400(parse: Any, raw: bytes) -> ParsedRequest | None:
    """Run ``parse(raw)``: a ``ParsedRequest`` whose forwarded body is UTF-8 JSON with the same
    content, or an ``InvalidRequest`` (400) with an OpenAI-style body. Anything else fails."""
    refused: InvalidRequest | None = None
    try:
        parsed: ParsedRequest = parse(raw)
    except InvalidRequest as err:
        refused = err
    if refused is not None:
        assert refused.status == 400
        response = error_response(refused)
        assert response.status == 400
        payload = json.loads(response.body)  # type: ignore[arg-type]
        assert set(payload["error"]) == {"message", "type", "param", "code"}
        assert payload["error"]["message"]
        return None
    assert parsed.model
    assert parsed.max_tokens is None or 1 <= parsed.max_tokens <= MAX_TOKENS_LIMIT
    assert parsed.prompt_chars >= 0
    assert parsed.prompt_token_ids is None or parsed.prompt_token_ids >= 0
    forwarded = upstream_body(parsed)
    # The client's own bytes go out verbatim (even UTF-16/32, which Python's json reads, as vLLM's
    # server does); a body Sluice re-encodes must be strict UTF-8.
    sent = json.loads(forwarded if forwarded is parsed.raw else forwarded.decode("utf-8"))
    assert isinstance(sent, dict)
    if parsed.native:
        assert sent["inputs"] == parsed.body["inputs"]
        if not parsed.stream:  # Sluice always asks a non-streamed /generate for its details
            assert sent["parameters"]["details"] is True
        sent.pop("parameters", None)
        expected = {k: v for k, v in parsed.body.items() if k != "parameters"}
    else:
        assert sent["model"] == parsed.model
        if parsed.stream:  # Sluice always asks a stream for its usage
            assert sent["stream_options"]["include_usage"] is True
        sent.pop("stream_options", None)
        expected = {k: v for k, v in parsed.body.items() if k != "stream_options"}
    assert canonical(sent) == canonical(expected)
    return parsed


def parse_chat(raw: bytes) -> ParsedRequest:
    return parse_request("chat", raw)


def parse_completions(raw: bytes) -> ParsedRequest:
    return parse_request("completions", raw)


def parse_generate(raw: bytes) -> ParsedRequest:
    return parse_native("generate", raw, MODEL)


def parse_generate_stream(raw: bytes) -> ParsedRequest:
    return parse_native("generate_stream", raw, MODEL)


OPENAI_PARSERS = [pytest.param(parse_chat, id="chat"), pytest.param(parse_completions, id="completions")]
NATIVE_PARSERS = [
    pytest.param(parse_generate, id="generate"),
    pytest.param(parse_generate_stream, id="generate_stream"),
]
ALL_PARSERS = OPENAI_PARSERS + NATIVE_PARSERS


@pytest.mark.parametrize("parse", ALL_PARSERS)
@BOUNDED
@given(raw=st.binary(max_size=512))
def test_any_bytes(parse: Any, raw: bytes) -> None:
    assert_valid_or_400(parse, raw)


@pytest.mark.parametrize("parse", ALL_PARSERS)
@BOUNDED
@given(body=JSON_VALUES, encoding=ENCODINGS)
def test_any_json(parse: Any, body: object, encoding: str) -> None:
    assert_valid_or_400(parse, encode(body, encoding))


@pytest.mark.parametrize("parse", OPENAI_PARSERS)
@BOUNDED
@given(body=OPENAI_BODIES, encoding=ENCODINGS)
def test_openai_fields_of_every_type(parse: Any, body: object, encoding: str) -> None:
    assert_valid_or_400(parse, encode(body, encoding))


@pytest.mark.parametrize("parse", NATIVE_PARSERS)
@BOUNDED
@given(body=NATIVE_BODIES, encoding=ENCODINGS)
def test_native_fields_of_every_type(parse: Any, body: object, encoding: str) -> None:
    assert_valid_or_400(parse, encode(body, encoding))


@pytest.mark.parametrize("parse", ALL_PARSERS)
@BOUNDED
@given(data=st.data())
def test_one_broken_byte(parse: Any, data: st.DataObject) -> None:
    """A valid-looking body with one byte replaced or inserted: invalid UTF-8, broken syntax."""
    native = parse in (parse_generate, parse_generate_stream)
    body = data.draw(NATIVE_BODIES if native else OPENAI_BODIES)
    raw = bytearray(json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    at = data.draw(st.integers(min_value=0, max_value=len(raw)))
    byte = data.draw(st.integers(min_value=0x80, max_value=0xFF) | st.integers(min_value=0, max_value=0x7F))
    if data.draw(st.booleans()) and at < len(raw):
        raw[at] = byte
    else:
        raw.insert(at, byte)
    assert_valid_or_400(parse, bytes(raw))


def nested(depth: int, kind: str) -> bytes:
    """``depth`` levels of arrays or objects around ``1``."""
    if kind == "array":
        return b"[" * depth + b"1" + b"]" * depth
    return b'{"a":' * depth + b"1" + b"}" * depth


VALID_CHAT = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "x": %s}'
VALID_COMPLETION = b'{"model": "m", "prompt": "hi", "x": %s}'
VALID_GENERATE = b'{"inputs": "hi", "parameters": {"x": %s}}'


@pytest.mark.parametrize(
    ("parse", "template"),
    [
        pytest.param(parse_chat, VALID_CHAT, id="chat-extra-field"),
        pytest.param(parse_chat, b'{"model": "m", "messages": [{"role": "user", "content": %s}]}', id="chat"),
        pytest.param(parse_completions, VALID_COMPLETION, id="completions-extra-field"),
        pytest.param(parse_completions, b'{"model": "m", "prompt": %s}', id="prompt"),
        pytest.param(parse_generate, VALID_GENERATE, id="generate-parameters"),
        pytest.param(parse_generate_stream, b'{"inputs": %s}', id="inputs"),
        pytest.param(parse_chat, b"%s", id="whole-body"),
    ],
)
@settings(BOUNDED, max_examples=60)
@given(depth=st.integers(min_value=1, max_value=5000), kind=st.sampled_from(["array", "object"]))
def test_deep_nesting(parse: Any, template: bytes, depth: int, kind: str) -> None:
    """Nesting deep enough to exhaust the JSON decoder's recursion limit is a 400, not a crash."""
    assert_valid_or_400(parse, template % nested(depth, kind))


@pytest.mark.parametrize(
    ("parse", "template"),
    [
        pytest.param(
            parse_chat, b'{"model": "m", "messages": [{"content": "x"}], "max_tokens": %s}', id="max"
        ),
        pytest.param(parse_chat, b'{"model": "m", "messages": [{"content": "x"}], "n": %s}', id="n"),
        pytest.param(parse_completions, b'{"model": "m", "prompt": [%s]}', id="token-id"),
        pytest.param(
            parse_completions, b'{"model": "m", "prompt": "x", "max_completion_tokens": %s}', id="mct"
        ),
        pytest.param(parse_generate, b'{"inputs": "x", "parameters": {"max_new_tokens": %s}}', id="mnt"),
        pytest.param(parse_generate_stream, b'{"inputs": "x", "seed": %s}', id="seed"),
    ],
)
@settings(BOUNDED, max_examples=60)
@given(digits=st.integers(min_value=1, max_value=10_000), sign=st.sampled_from([b"", b"-"]))
def test_huge_integers(parse: Any, template: bytes, digits: int, sign: bytes) -> None:
    """Integers of any length, beyond Python's 4300-digit str->int limit too: parsed or a 400."""
    parsed = assert_valid_or_400(parse, template % (sign + b"9" * digits))
    if parsed is not None and sign and b"max" in template:
        pytest.fail("a negative output cap was accepted")


@pytest.mark.parametrize(
    ("parse", "raw", "field"),
    [
        pytest.param(
            parse_chat,
            b'{"model": "m", "stream": true, "messages": [{"content": "a\\ud800b\\udfff"}]}',
            "messages",
            id="chat-stream",
        ),
        pytest.param(
            parse_completions, b'{"model": "m", "stream": true, "prompt": "\\udbff"}', "prompt", id="prompt"
        ),
        pytest.param(parse_generate, b'{"inputs": "\\ud800"}', "inputs", id="generate"),
    ],
)
def test_lone_surrogates_are_forwarded_escaped(parse: Any, raw: bytes, field: str) -> None:
    """``"\\ud800"`` is valid JSON but no UTF-8 can hold it: the re-encoded body keeps it escaped
    (it used to raise ``UnicodeEncodeError``, a 500)."""
    parsed = assert_valid_or_400(parse, raw)

    assert parsed is not None
    forwarded = upstream_body(parsed)
    assert forwarded is not parsed.raw  # Sluice re-encoded it (usage or details asked for)
    assert json.loads(forwarded)[field] == json.loads(raw)[field]


@pytest.mark.parametrize("count", [1, 2, 128])
def test_n_passes_through_untouched(count: int) -> None:
    """``n`` in OpenAI's range (1-128) is forwarded as sent, and the request is known to decode
    ``n`` sequences (its budget reserves each one's output)."""
    raw = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": count}).encode()
    parsed = assert_valid_or_400(parse_chat, raw)

    assert parsed is not None
    assert parsed.choices == count
    assert json.loads(upstream_body(parsed))["n"] == count


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("value", [0, -1, MAX_CHOICES + 1, 10**6, 1.5, "2", True])
def test_bad_n_is_400_naming_the_field(endpoint: Endpoint, value: object) -> None:
    """Out of OpenAI's range, or not an integer: Sluice's 400 (as OpenAI answers), before any
    budget is reserved for a request that could never run."""
    body = {"model": MODEL, "messages": [{"content": "x"}], "prompt": "x", "n": value}
    with pytest.raises(InvalidRequest) as caught:
        parse_request(endpoint, json.dumps(body).encode())

    assert caught.value.param == "n"


@pytest.mark.parametrize(
    ("prompt", "chars", "token_ids"),
    [
        pytest.param("abc", 3, None, id="string"),
        pytest.param(["ab", "c"], 3, None, id="strings"),
        pytest.param([1, 2, 3], 0, 3, id="token-ids"),
        pytest.param([[1, 2], [3]], 0, 3, id="lists-of-token-ids"),
        pytest.param([], 0, None, id="empty-list"),
    ],
)
def test_prompt_shapes_are_sized(prompt: object, chars: int, token_ids: int | None) -> None:
    raw = json.dumps({"model": MODEL, "prompt": prompt}).encode()
    parsed = assert_valid_or_400(parse_completions, raw)

    assert parsed is not None
    assert (parsed.prompt_chars, parsed.prompt_token_ids) == (chars, token_ids)


@pytest.mark.parametrize(
    "prompt",
    [
        pytest.param(3, id="int"),
        pytest.param([1, "a"], id="mixed"),
        pytest.param([[1], "a"], id="list-and-string"),
        pytest.param([[1.5]], id="float-ids"),
        pytest.param([True], id="bool-ids"),
        pytest.param(None, id="null"),
        pytest.param({"text": "x"}, id="object"),
    ],
)
def test_bad_prompt_shapes_are_400_naming_prompt(prompt: object) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_completions(json.dumps({"model": MODEL, "prompt": prompt}).encode())

    assert caught.value.param == "prompt"


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("value", [0, -1, -(10**30), 2**53, 10**400, 1.5, "10", True, math.inf])
def test_bad_max_tokens_are_400_naming_the_field(endpoint: Endpoint, value: object) -> None:
    body = {"model": MODEL, "messages": [{"content": "x"}], "prompt": "x", "max_tokens": value}
    with pytest.raises(InvalidRequest) as caught:
        parse_request(endpoint, json.dumps(body).encode())

    assert caught.value.param == "max_tokens"
