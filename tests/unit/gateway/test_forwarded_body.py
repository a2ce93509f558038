"""The body forwarded to a replica when Sluice changes it (a stream's usage, a ``max_tokens`` it set,
a ``/generate``'s details): a member the body lacks is written into the client's own bytes (one
copy, whatever the body's size); one it has is set in the decoded body, encoded again, and for a
body of ``OFF_LOOP_BYTES`` or more that happens on the body-parsing thread, a piece at a time,
so that the event loop waits for no long encoding (docs/operations.md, "Floods and slow
clients")."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

import gateway.api.openai as openai_api
import gateway.api.tgi as tgi
from gateway.api.openai import (
    OFF_LOOP_BYTES,
    encode_upstream_body,
    parse_native,
    parse_request,
    upstream_body,
    with_max_tokens,
)
from gateway.api.tgi import json_bytes, json_bytes_in_pieces, with_members

MESSAGES = b'[{"role":"user","content":"caf\\u00e9 \\ud83d\\ude00"}]'


def test_a_member_the_body_lacks_is_written_into_the_clients_bytes() -> None:
    """The client's formatting and escapes stay as sent: nothing was decoded and encoded again."""
    raw = b'{"model":"m", "messages":' + MESSAGES + b',"stream":true}\n'
    forwarded = upstream_body(with_max_tokens(parse_request("chat", raw), 450))

    assert forwarded == (
        b'{"model":"m", "messages":' + MESSAGES + b',"stream":true'
        b', "stream_options": {"include_usage": true}, "max_tokens": 450}\n'
    )


@pytest.mark.parametrize(
    ("raw", "expected_options"),
    [
        pytest.param(
            b'{"model":"m","messages":[{"content":"x"}],"stream":true,"stream_options":{"x":1}}',
            {"x": 1, "include_usage": True},
            id="member-present",
        ),
        pytest.param(
            '{"model":"m","messages":[{"content":"é"}],"stream":true}'.encode("utf-16"),
            {"include_usage": True},
            id="utf-16",
        ),
        pytest.param(
            b'\xef\xbb\xbf{"model":"m","messages":[{"content":"x"}],"stream":true}',
            {"include_usage": True},
            id="utf-8-bom",
        ),
    ],
)
def test_other_bodies_are_encoded_again_in_their_members_order(
    raw: bytes, expected_options: dict[str, Any]
) -> None:
    parsed = parse_request("chat", raw)
    forwarded = upstream_body(parsed)

    sent = json.loads(forwarded.decode("utf-8"))  # strict UTF-8, no byte-order mark
    assert sent == {**parsed.body, "stream_options": expected_options}
    assert list(sent) == [*parsed.body, *(["stream_options"] if "stream_options" not in parsed.body else [])]


def test_a_generate_without_parameters_gets_them_written_in() -> None:
    raw = b'{"inputs": "Hi"}'
    parsed = parse_native("generate", raw, "tgi-model")
    assert upstream_body(parsed) == b'{"inputs": "Hi", "parameters": {"details": true}}'


LONG = tgi._PIECE_CHARS * 3 + 17
VALUES = [
    pytest.param({"a": "x" * LONG, "b": [1, 2.5, -0.0, None, True, False, 10**30]}, id="long-ascii"),
    pytest.param({"é": "é\U0001f600" * (LONG // 2), "n": {"m": []}}, id="long-non-ascii"),
    pytest.param({"s": "a" * LONG + "\ud800" + "b" * 10}, id="lone-surrogate-in-a-long-string"),
    pytest.param([{"role": "user", "content": "hi"}] * (tgi._PIECE_VALUES * 2 + 1), id="many-values"),
    pytest.param([list(range(tgi._PIECE_VALUES + 1)), {}, [], ""], id="wide-list"),
    pytest.param({"d": [[[{"k": ["v" * 10] * 3}]]]}, id="nested"),
    pytest.param({f"k{i}": i for i in range(tgi._PIECE_VALUES * 2)}, id="many-keys"),
    pytest.param([10**4000] * 20 + [{"x" * LONG: [1]}], id="long-integers-and-key"),
    pytest.param("plain", id="string"),
]


@pytest.mark.parametrize("value", VALUES)
def test_json_bytes_in_pieces_says_what_json_bytes_says(value: Any) -> None:
    pieces = json_bytes_in_pieces(value)
    assert json.loads(pieces.decode("utf-8")) == json.loads(json_bytes(value))
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return  # a lone surrogate: escaped in its own piece only, the rest as it is
    assert pieces == json_bytes(value)


def _values_and_chars(value: object) -> tuple[int, int, int]:
    """(values, characters of strings and keys, depth) of a JSON value, all of it."""
    if isinstance(value, str):
        return 1, len(value), 0
    if not isinstance(value, (dict, list)):
        return 1, 0, 0
    values, chars, depth = 1, sum(map(len, value)) if isinstance(value, dict) else 0, 0
    for item in value.values() if isinstance(value, dict) else value:
        v, c, d = _values_and_chars(item)
        values, chars, depth = values + v, chars + c, max(depth, d)
    return values, chars, depth + 1


@pytest.mark.parametrize("value", VALUES)
def test_json_bytes_in_pieces_hands_the_encoder_bounded_pieces(
    value: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No call into the encoder gets more than ``_PIECE_VALUES`` values (besides the run that
    holds them) or ``_PIECE_CHARS`` characters: a big body's encoding is many short holds of the
    GIL, not one long one."""
    handed: list[object] = []

    def recording(payload: object) -> bytes:
        handed.append(payload)
        return json_bytes(payload)

    monkeypatch.setattr(tgi, "json_bytes", recording)
    json_bytes_in_pieces(value)

    assert handed
    for payload in handed:
        values, chars, depth = _values_and_chars(payload)
        assert values <= tgi._PIECE_VALUES + 1
        assert chars <= tgi._PIECE_CHARS
        assert depth <= 2  # a run of values, some of them lists or objects of scalars


def _big_chat(**fields: object) -> bytes:
    content = "word " * (OFF_LOOP_BYTES // 5)
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}], **fields}).encode()


@pytest.mark.parametrize(
    ("fields", "thread"),
    [
        pytest.param({"stream": True}, "loop", id="member-lacking-written-in-on-the-loop"),
        pytest.param({"stream": True, "stream_options": {}}, "body", id="encoded-again-on-the-body-thread"),
    ],
)
async def test_a_big_body_is_encoded_again_off_the_event_loop(
    fields: dict[str, object], thread: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran_on: list[str] = []

    def recording(*args: Any) -> bytes:
        ran_on.append("loop" if threading.current_thread() is threading.main_thread() else "body")
        return with_members(*args)

    monkeypatch.setattr(openai_api, "with_members", recording)
    parsed = parse_request("chat", _big_chat(**fields))
    assert len(parsed.raw) >= OFF_LOOP_BYTES

    forwarded = await encode_upstream_body(parsed)

    assert ran_on == [thread]
    assert forwarded == upstream_body(parsed)
    assert json.loads(forwarded)["stream_options"] == {"include_usage": True}


async def test_a_body_sent_as_it_is_is_not_copied() -> None:
    parsed = parse_request("chat", _big_chat(stream=True, stream_options={"include_usage": True}))
    assert await encode_upstream_body(parsed) is parsed.raw
