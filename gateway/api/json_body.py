"""A request body as JSON, as strictly as the engines read it: an object, finite numbers, sent as
``application/json``.

Python's ``json`` accepts ``NaN``, ``Infinity`` and ``-Infinity`` (and turns ``1e999`` into
infinity); JSON (RFC 8259) has no such numbers and the gateway must not forward what it cannot
price or what an engine may read differently, so each is a 400 naming the field. vLLM's and
SGLang's OpenAI servers refuse a body whose ``Content-Type`` is not ``application/json``
(``validate_json_request``: missing, ``text/plain``, a form, anything else; vLLM answers 400) and
TGI's router answers 415; Sluice answers 415 ``unsupported_media_type`` for the same bodies,
whatever they hold, before reading them as JSON. Every message here is fixed text (a position at
most), never a decoder's exception text or the body's bytes.

Before any of that, ``check_shape`` bounds what decoding may build: a body nesting deeper than
``JsonLimits.max_depth`` or holding more than ``JsonLimits.max_items`` values is a 400 naming the
setting, found from the raw bytes with a few C-speed passes (``bytes.replace``, one regular
expression, ``bytes.count``, ``bytes.translate``) and no Python object per value. Python's
decoder has no such limits (only the recursion limit), and an 8 MiB body of ``{}`` items becomes
some 2.8 million dicts; ``orjson`` and ``msgspec`` have none either.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Final

from pydantic_core import ErrorDetails

from gateway.api.sliced_json import decode_in_slices
from gateway.http.echo import clip
from gateway.http.errors import InvalidRequest

__all__ = [
    "DEFAULT_LIMITS",
    "JSON_TOO_COMPLEX",
    "NOT_AN_OBJECT",
    "UNSUPPORTED_MEDIA_TYPE",
    "JsonLimits",
    "check_content_type",
    "check_shape",
    "field_problem",
    "load_object",
]

#: The 400's message for JSON that Python's decoder refuses beyond syntax: an integer longer than
#: ``sys.get_int_max_str_digits()`` (4300) digits, or nesting deeper than the recursion limit.
JSON_TOO_COMPLEX: Final = "request body is not valid JSON: nested too deeply or a number too long"
#: The 400's message for valid JSON that is not an object.
NOT_AN_OBJECT: Final = "request body must be a JSON object"
#: The ``code`` of the 415 for a body not sent as ``application/json``.
UNSUPPORTED_MEDIA_TYPE: Final = "unsupported_media_type"
#: The one media type a body may be sent as (parameters such as ``charset`` aside).
JSON_MEDIA_TYPE: Final = "application/json"


@dataclass(frozen=True, slots=True)
class JsonLimits:
    """What one request body may hold (``server.max_json_depth``, ``server.max_json_items``).

    ``max_depth``: arrays and objects nested inside each other, the body's own object being 1.
    ``max_items``: values in all its arrays and objects together, counted from the raw bytes as
    commas plus opening brackets outside strings (an empty ``[]`` or ``{}`` counts 1). Strings are
    bounded only by ``server.max_body_bytes``: one string costs no more than the body's bytes.
    """

    max_depth: int = 64
    max_items: int = 100_000


#: The limits at ``ServerSettings``' defaults.
DEFAULT_LIMITS: Final = JsonLimits()

#: A string once its escaped backslashes and quotes are gone (``_bare_segments``).
_STRING: Final = re.compile(rb'"[^"]*"')
#: ``bytes.translate``'s delete argument that keeps only brackets.
_NOT_BRACKETS: Final = bytes(b for b in range(256) if b not in b"[]{}")
#: Depth change per byte of the bracket string.
_DEPTH_STEP: Final = [1 if b in b"[{" else -1 if b in b"]}" else 0 for b in range(256)]
#: Bytes handed to one C call of the scan: each call holds the GIL, so this keeps the event loop's
#: wait for it (when the scan runs on the body-parsing thread) well under a millisecond.
_SEGMENT: Final = 64 * 1024
_BACKSLASH: Final = ord("\\")
#: Texts at least this long (characters) are decoded in slices (``gateway.api.sliced_json``): one C
#: call of the decoder over a text this long holds the GIL for a few milliseconds, slices for
#: about one member or element each, at about 1.5 times the CPU for a body of thousands of them.
SLICED_CHARS: Final = 1 << 20


def check_shape(raw: bytes, limits: JsonLimits) -> None:
    """Return when ``raw`` (a request body in UTF-8, -16 or -32) nests at most
    ``limits.max_depth`` deep and holds at most ``limits.max_items`` values; else raise
    ``InvalidRequest`` (400, ``param`` ``None``: the place is not known) naming the setting.

    Linear in ``raw``'s size, in C calls of at most ``_SEGMENT`` bytes each, with no Python object
    per value. First the commas and opening brackets are counted with strings included (an upper
    bound on the values, and on the depth: most bodies stop there); a body over a limit by that
    count is scanned again with its strings emptied. Exact for valid JSON; for invalid JSON the
    counts are those of the valid prefix the decoder would read before it fails, give or take a
    string's brackets.
    """
    encoding = json.detect_encoding(raw)  # from the first four bytes
    if encoding not in ("utf-8", "utf-8-sig"):  # UTF-16 and -32: rare, transcoded to scan
        raw = raw.decode(encoding, errors="replace").encode()
    items = opening = 0
    for start in range(0, len(raw), _SEGMENT):
        end = start + _SEGMENT
        opening += raw.count(b"[", start, end) + raw.count(b"{", start, end)
        items += raw.count(b",", start, end)
    if items + opening <= limits.max_items and opening <= limits.max_depth:
        return
    problem = _over(_bare_segments(raw), limits)
    if problem is not None:
        raise InvalidRequest(problem, code="request_too_complex")


def _segments(raw: bytes) -> Iterator[bytes]:
    """``raw`` in pieces of about ``_SEGMENT`` bytes, none ending inside a run of backslashes
    (so that no escape is split)."""
    start = 0
    while start < len(raw):
        end = min(start + _SEGMENT, len(raw))
        while end < len(raw) and raw[end - 1] == _BACKSLASH:
            end += 1
        yield raw[start:end]
        start = end


def _bare_segments(raw: bytes) -> Iterator[bytes]:
    """``raw``'s pieces with every string's content removed (``""`` left), a string that spans
    pieces included: escaped backslashes and quotes are dropped first, so that the quotes left
    alternate between opening and closing."""
    in_string = False
    for piece in _segments(raw):
        if b"\\" in piece:  # most pieces have no escape: no copy of them
            piece = piece.replace(b"\\\\", b"").replace(b'\\"', b"")
        if in_string:
            close = piece.find(b'"')
            if close < 0:
                continue
            piece, in_string = piece[close + 1 :], False
        bare = _STRING.sub(b'""', piece)
        if bare.count(b'"') % 2:  # a string opened here goes on in the next piece
            bare, in_string = bare[: bare.rindex(b'"')], True
        yield bare


def _over(pieces: Iterable[bytes], limits: JsonLimits) -> str | None:
    """The refusal's message for the first limit that ``pieces`` (a body with its strings
    emptied, in order) goes over; ``None`` when it goes over none."""
    items = depth = 0
    for piece in pieces:
        items += piece.count(b",") + piece.count(b"[") + piece.count(b"{")
        if items > limits.max_items:
            return f"request body holds more than {limits.max_items} values (server.max_json_items)"
        brackets = piece.translate(None, _NOT_BRACKETS)
        if brackets:
            running = list(accumulate(map(_DEPTH_STEP.__getitem__, brackets), initial=depth))
            if max(running) > limits.max_depth:
                return f"request body nests deeper than {limits.max_depth} levels (server.max_json_depth)"
            depth = running[-1]
    return None


def check_content_type(content_type: str | None) -> None:
    """Return when the raw ``Content-Type`` header value (``None``: absent) names
    ``application/json`` (any case, parameters allowed); else raise ``InvalidRequest`` 415
    ``unsupported_media_type`` with ``param`` ``content-type``."""
    if content_type is not None and content_type.partition(";")[0].strip().lower() == JSON_MEDIA_TYPE:
        return
    raise InvalidRequest(
        "the request body must be sent with Content-Type: application/json",
        param="content-type",
        code=UNSUPPORTED_MEDIA_TYPE,
        status=415,
    )


class _NonFinite(ValueError):
    """Raised by the strict decoder's hooks at the first non-finite number."""


def _refuse_constant(_name: str) -> Any:
    raise _NonFinite


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999
        raise _NonFinite
    return value


#: Marks where a non-finite number was, in the second decode that finds its field.
_MARK: Final = object()


def _mark_float(text: str) -> object:
    value = float(text)
    return value if math.isfinite(value) else _MARK


_STRICT: Final = json.JSONDecoder(parse_float=_finite_float, parse_constant=_refuse_constant)
_MARKING: Final = json.JSONDecoder(parse_float=_mark_float, parse_constant=lambda _name: _MARK)


def _decode(decoder: json.JSONDecoder, text: str) -> Any:
    """``decoder.decode(text)``; a text of ``SLICED_CHARS`` or more in slices (``decode_in_slices``)."""
    return decode_in_slices(decoder, text) if len(text) >= SLICED_CHARS else decoder.decode(text)


def load_object(raw: bytes, limits: JsonLimits = DEFAULT_LIMITS) -> dict[str, Any]:
    """``raw`` decoded as one JSON object, as ``json.loads`` reads bytes (UTF-8, -16 or -32), with
    only finite numbers, once ``check_shape(raw, limits)`` passed. Raises ``InvalidRequest`` (400):
    ``check_shape``'s refusals, bytes that are not text in that encoding
    (``json.loads`` lets an encoded lone surrogate through; UTF-8 has no surrogates), not JSON
    (the message gives the line and column), ``JSON_TOO_COMPLEX``, a non-finite number
    (``param``: the top-level field holding it; the message: its path), or ``NOT_AN_OBJECT``. An
    escaped surrogate (``"\\ud800"``) is JSON text and passes."""
    check_shape(raw, limits)
    try:
        text = raw.decode(json.detect_encoding(raw))
        body = _decode(_STRICT, text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(
            f"request body is not valid JSON (line {exc.lineno}, column {exc.colno})"
        ) from None
    except UnicodeDecodeError:
        raise InvalidRequest("request body is not valid JSON: it is not UTF-8 text") from None
    except _NonFinite:
        raise _non_finite(text) from None
    except (ValueError, RecursionError):  # an integer over 4300 digits, nesting too deep
        raise InvalidRequest(JSON_TOO_COMPLEX) from None
    if not isinstance(body, dict):
        raise InvalidRequest(NOT_AN_OBJECT)
    return body


def _non_finite(text: str) -> InvalidRequest:
    """The 400 for ``text`` (which holds a non-finite number): decoded again with each such
    number marked, and the first one's path named. Text that breaks the JSON grammar after the
    number (the first decode stopped at it) gets the not-JSON 400 instead."""
    try:
        marked = _decode(_MARKING, text)
    except json.JSONDecodeError as exc:
        return InvalidRequest(f"request body is not valid JSON (line {exc.lineno}, column {exc.colno})")
    except (ValueError, RecursionError):
        return InvalidRequest(JSON_TOO_COMPLEX)
    path = _path_to_mark(marked)
    if not path:
        return InvalidRequest(NOT_AN_OBJECT)
    where = clip(".".join(path))
    message = f"{where}: must be a finite number (NaN and Infinity are not JSON)"
    return InvalidRequest(message, param=clip(path[0]))


def _path_to_mark(root: object) -> list[str]:
    """The keys and indices from ``root`` down to the first ``_MARK`` in document order (``[]``:
    ``root`` itself). Iterative, with parent links, so that depth and size cost linear time."""
    nodes: list[tuple[object, int, str]] = [(root, -1, "")]  # value, parent's index, key
    stack = [0]
    while stack:
        index = stack.pop()
        value = nodes[index][0]
        if value is _MARK:
            path: list[str] = []
            while index > 0:
                _, parent, key = nodes[index]
                path.append(key)
                index = parent
            return path[::-1]
        if isinstance(value, dict):
            children = [(child, str(key)) for key, child in value.items()]
        elif isinstance(value, list):
            children = [(child, str(i)) for i, child in enumerate(value)]
        else:
            continue
        for child, key in reversed(children):
            nodes.append((child, index, key))
            stack.append(len(nodes) - 1)
    return []


#: What a field's value must be, by pydantic's error type: the gateway's own words, so that a 400
#: never carries a library's wording (which changes between releases).
_MUST_BE: Final[dict[str, str]] = {
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
}
#: Bounds, by pydantic's error type: the wording and the ``ctx`` key holding the schema's bound.
_BOUNDS: Final[dict[str, tuple[str, str]]] = {
    "greater_than_equal": ("must be at least", "ge"),
    "greater_than": ("must be more than", "gt"),
    "less_than_equal": ("must be at most", "le"),
    "less_than": ("must be less than", "lt"),
    "string_too_short": ("must have at least this many characters:", "min_length"),
    "too_short": ("must have at least this many items:", "min_length"),
}


def field_problem(error: ErrorDetails) -> str:
    """What is wrong with one field, in fixed words, from one of pydantic's ``errors()``: ``field
    required``, ``must be an integer``, ``must be at least 1``, ``must not be empty``...; ``has an
    invalid value`` for any other kind. The bounds quoted are the schema's, never the value sent."""
    kind = error["type"]
    if kind == "missing":
        return "field required"
    if kind in _MUST_BE:
        return _MUST_BE[kind]
    bound = _BOUNDS.get(kind)
    ctx = error.get("ctx") or {}
    if bound is not None and bound[1] in ctx:
        words, key = bound
        if key == "min_length" and ctx[key] == 1:
            return "must not be empty"
        return f"{words} {ctx[key]}"
    return "has an invalid value"
