"""A large body decoded in slices: exactly what ``json`` decodes (values and errors, positions
included), and never the whole of a top-level array in one call of the C scanner."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.api import json_body
from gateway.api.sliced_json import decode_in_slices
from gateway.http.errors import InvalidRequest

_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
_values = st.recursive(
    _scalars,
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=5), children, max_size=5)
    ),
    max_leaves=40,
)
_spaces = st.sampled_from(["", " ", "\n", "\t ", "  \r\n"])


def _outcome(decoder: json.JSONDecoder, text: str, sliced: bool) -> tuple[str, Any]:
    try:
        value = decode_in_slices(decoder, text) if sliced else decoder.decode(text)
    except json.JSONDecodeError as err:
        return "error", (err.msg, err.pos, err.lineno, err.colno)
    except (ValueError, RecursionError) as err:
        return "error", type(err).__name__
    return "value", value


@given(_values, _spaces, _spaces, st.booleans())
def test_the_same_value_as_one_decode(value: Any, before: str, after: str, indent: bool) -> None:
    text = before + json.dumps(value, indent=1 if indent else None) + after
    decoder = json.JSONDecoder()
    assert decode_in_slices(decoder, text) == decoder.decode(text)


@settings(max_examples=300)
@given(_values, st.data())
def test_the_same_error_at_the_same_place_for_a_broken_text(value: Any, data: st.DataObject) -> None:
    text = json.dumps({"messages": [value, value], "model": "m"})
    cut = data.draw(st.integers(0, len(text)))
    insert = data.draw(st.sampled_from(["", ",", "]", "}", "[", "{", ":", '"', "x", "1", " "]))
    drop = data.draw(st.integers(0, 2))
    broken = text[:cut] + insert + text[cut + drop :]
    decoder = json.JSONDecoder()
    assert _outcome(decoder, broken, sliced=True) == _outcome(decoder, broken, sliced=False)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "{",
        "[",
        "{}",
        "[]",
        '{"a": [1, 2,]}',
        '{"a": [1, 2] "b": 1}',
        '{"a" 1}',
        "{'a': 1}",
        '{"a": [1]}  x',
        '"just a string"',
        "12",
        '{"a": [NaN, Infinity], "b": -Infinity}',
        '{"a": [' + "1" * 5000 + "]}",
    ],
)
def test_edge_texts_decode_or_fail_as_json_does(text: str) -> None:
    decoder = json.JSONDecoder()
    assert _outcome(decoder, text, sliced=True) == _outcome(decoder, text, sliced=False)


def test_the_decoders_hooks_apply_in_every_slice() -> None:
    decoder = json.JSONDecoder(parse_float=lambda s: ("float", s), parse_constant=lambda s: ("constant", s))
    text = '{"t": 0.5, "xs": [1.5, NaN, {"y": 2.5}], "z": Infinity}'
    assert decode_in_slices(decoder, text) == decoder.decode(text)
    assert decode_in_slices(decoder, text)["xs"][1] == ("constant", "NaN")


def test_each_element_of_a_top_level_array_is_its_own_call() -> None:
    messages = [{"role": "user", "content": f"message {i}"} for i in range(1000)]
    text = json.dumps({"model": "m", "messages": messages, "stream": True})
    decoder = json.JSONDecoder()
    c_scan = decoder.scan_once  # type: ignore[attr-defined]
    spans: list[int] = []

    def counted(s: str, idx: int) -> tuple[Any, int]:
        value, end = c_scan(s, idx)
        spans.append(end - idx)
        return value, end

    decoder.scan_once = counted  # type: ignore[attr-defined]
    assert decode_in_slices(decoder, text) == json.loads(text)
    # "m", each message, true: no call spans more than one message.
    assert len(spans) == 1 + len(messages) + 1
    assert max(spans) < 50


def test_a_large_body_is_decoded_in_slices_with_the_same_strictness() -> None:
    messages = [{"role": "user", "content": "x" * 100}] * (json_body.SLICED_CHARS // 100)
    body = {"model": "m", "messages": messages, "temperature": 0.5}
    raw = json.dumps(body).encode()
    assert len(raw) >= json_body.SLICED_CHARS
    assert json_body.load_object(raw, json_body.JsonLimits(max_items=10**6)) == body

    bad = json.dumps({**body, "messages": [*messages, {"role": "user", "content": "x", "weight": math.inf}]})
    with pytest.raises(InvalidRequest) as info:
        json_body.load_object(bad.encode(), json_body.JsonLimits(max_items=10**6))
    assert info.value.param == "messages"
    assert "must be a finite number" in info.value.message
