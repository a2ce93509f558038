"""The request parser's fast path agrees with its pydantic schema.

``parse_request`` reads the fields it acts on with a few type checks (``_plain_fields``) when they
all have the plain shape, and hands anything else to the pydantic schema, which words the 400.
The property: whenever the fast path accepts a body, the schema accepts it too, with the same
model, stream flag, usage flag and token cap; whenever the schema refuses a body, the fast path
declines it. Bodies are drawn near-valid (each field plain, or odd: wrong types, bounds, lone
surrogates, mixed prompt shapes, absent), so both sides of every check are exercised.

Deterministic: ``derandomize=True`` and no example database; ``deadline=None`` (shared machine).
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from bench.admission_load import chat_body
from gateway.api.openai import _SCHEMAS, MAX_CHOICES, MAX_TOKENS_LIMIT, Endpoint, _plain_fields, parse_request

BOUNDED = settings(
    max_examples=600,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

#: Every code point, surrogates included (``"\ud800"`` is what ``json.loads`` makes of ``"\\ud800"``).
ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=8)
ODD = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**20), max_value=10**20)
    | st.sampled_from([0, 1, -1, MAX_TOKENS_LIMIT, MAX_TOKENS_LIMIT + 1, 2**63])
    | st.floats(allow_nan=False)
    | ANY_TEXT
    | st.lists(st.integers() | ANY_TEXT, max_size=2)
    | st.dictionaries(ANY_TEXT, st.integers() | ANY_TEXT | st.none(), max_size=2)
)
TOKENS = st.integers(min_value=-(10**30), max_value=10**30)
PROMPTS = (
    st.text(max_size=8)
    | ANY_TEXT
    | st.lists(st.text(max_size=4) | ANY_TEXT, max_size=3)
    | st.lists(TOKENS, max_size=3)
    | st.lists(st.lists(TOKENS, max_size=3), max_size=2)
    | st.lists(st.text(max_size=3) | TOKENS | st.lists(TOKENS, max_size=2) | st.booleans(), max_size=3)
)
MESSAGES = st.lists(
    st.fixed_dictionaries({"role": st.just("user"), "content": ANY_TEXT}), min_size=1, max_size=3
)
#: Each field's plain values (what the fast path is for) and odd ones (what it must decline or
#: read exactly as the schema does).
PLAIN: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from(["m", "meta-llama/Meta-Llama-3-8B-Instruct"]),
    "messages": MESSAGES,
    "prompt": PROMPTS,
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "max_tokens": st.integers(min_value=1, max_value=4096),
    "max_completion_tokens": st.integers(min_value=1, max_value=4096),
    "n": st.integers(min_value=1, max_value=8),
}
ODD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from(["", "modèle", "\ud800"]) | ANY_TEXT | ODD,
    "messages": st.lists(MESSAGES | ODD, max_size=2) | ODD,
    "prompt": ODD,
    "stream": ODD,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": ODD}) | ODD,
    "max_tokens": st.sampled_from([0, -1, MAX_TOKENS_LIMIT, MAX_TOKENS_LIMIT + 1]) | ODD,
    "max_completion_tokens": st.sampled_from([0, -1, MAX_TOKENS_LIMIT, MAX_TOKENS_LIMIT + 1]) | ODD,
    "n": st.sampled_from([0, -1, MAX_CHOICES, MAX_CHOICES + 1]) | ODD,
}


@st.composite
def bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A body whose fields are each plain (mostly), odd, or absent (``None`` among odd values is
    an explicit JSON ``null``)."""
    body: dict[str, Any] = {"temperature": 0.5}
    for name, plain in PLAIN.items():
        kind = draw(st.sampled_from(["plain", "plain", "plain", "plain", "odd", "absent"]))
        if kind == "plain":
            body[name] = draw(plain)
        elif kind == "odd":
            body[name] = draw(ODD_VALUES[name])
    return body


def schema_fields(endpoint: Endpoint, body: dict[str, Any]) -> tuple[str, bool, bool, int | None, int] | None:
    """What the pydantic schema makes of ``body`` (``None``: a 400)."""
    try:
        parsed = _SCHEMAS[endpoint].model_validate(body)
    except ValidationError:
        return None
    options = parsed.stream_options
    cap = parsed.max_completion_tokens
    return (
        parsed.model,
        bool(parsed.stream),
        bool(options is not None and options.include_usage),
        parsed.max_tokens if cap is None else cap,
        1 if parsed.n is None else parsed.n,
    )


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@BOUNDED
@given(body=bodies())
def test_the_fast_path_is_sound(endpoint: Endpoint, body: dict[str, Any]) -> None:
    # What the parser sees: the body as JSON decodes it.
    decoded = json.loads(json.dumps(body))
    fast = _plain_fields(endpoint, decoded)
    schema = schema_fields(endpoint, decoded)
    if fast is not None:
        assert schema == fast
    if schema is None:
        assert fast is None


def test_ordinary_bodies_take_the_fast_path() -> None:
    """The bench's flood body and typical SDK bodies never reach pydantic."""
    flood = chat_body("meta-llama/Meta-Llama-3-8B-Instruct", 40, 16, random.Random(0))
    assert _plain_fields("chat", flood) == ("meta-llama/Meta-Llama-3-8B-Instruct", True, False, 16, 1)
    sdk = {
        "model": "m",
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hé"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_completion_tokens": 7,
        "max_tokens": 99,
        "temperature": 0.2,
    }
    assert _plain_fields("chat", sdk) == ("m", True, True, 7, 1)
    assert _plain_fields("chat", {**sdk, "n": 3}) == ("m", True, True, 7, 3)
    assert _plain_fields("completions", {"model": "m", "prompt": [[1, 2], [3]]}) == (
        "m",
        False,
        False,
        None,
        1,
    )
    assert _plain_fields("completions", {"model": "m", "prompt": "hello", "stream": False}) == (
        "m",
        False,
        False,
        None,
        1,
    )


def test_a_declined_body_still_gets_the_schemas_answer() -> None:
    """Non-ASCII names and prompts go through the schema, which accepts them; broken fields get
    the schema's 400 (in the gateway's words)."""
    parsed = parse_request("completions", json.dumps({"model": "modèle", "prompt": "héllo"}).encode())
    assert (parsed.model, parsed.prompt_chars) == ("modèle", 5)
    with pytest.raises(Exception, match="max_tokens: must be at least 1"):
        parse_request("chat", json.dumps({"model": "m", "messages": [{}], "max_tokens": 0}).encode())
