"""TGI's native API: ``POST /generate`` and ``POST /generate_stream``, read and relayed by Sluice.

Text Generation Inference serves its own routes next to the OpenAI ones, and many of its users
call them (the ``text_generation`` and ``huggingface_hub`` clients do). Sluice admits, limits and
accounts them like the OpenAI routes; this module knows their shapes:

* request: ``{"inputs": str, "parameters": {"max_new_tokens": int, "details": bool, ...},
  "stream": bool}`` (``stream`` only on ``/generate``, TGI's compat route). ``max_new_tokens``
  defaults to 100 in TGI, so an absent one caps the output at 100 tokens. The body carries no
  model: a TGI server serves exactly one, so Sluice routes the request to the replicas whose
  engine is TGI and that serve the one model its TGI replicas have (``resolve_model``);
* ``/generate`` answers ``{"generated_text": str, "details": {...}}``, with ``details`` only when
  asked. Sluice always asks (it needs ``generated_tokens``) and removes them again when the client
  did not;
* ``/generate_stream`` sends one SSE event per generated token, ``{"index", "token": {...},
  "generated_text": null, "details": null}``, and the last one has ``generated_text`` set (and
  ``details`` when asked). There is no ``[DONE]`` sentinel: the event with ``generated_text`` ends
  the stream. An error mid-stream is an event ``{"error": str, "error_type": str}``.

TGI references: ``router/src/lib.rs`` (``GenerateRequest``, ``GenerateParameters``,
``StreamResponse``, ``StreamDetails``, ``ErrorResponse``) and ``router/src/server.rs``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Final

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from gateway.api.json_body import DEFAULT_LIMITS, JsonLimits, field_problem, load_object
from gateway.http.errors import InvalidRequest

#: TGI's default output cap when ``parameters.max_new_tokens`` is absent (``default_max_new_tokens``).
TGI_DEFAULT_MAX_NEW_TOKENS: Final = 100
#: The engine whose replicas serve the native routes.
TGI_ENGINE: Final = "tgi"


def json_bytes(payload: object) -> bytes:
    """``payload`` as UTF-8 JSON text, non-ASCII characters kept as they are. A lone surrogate
    (valid JSON when escaped, ``"\\ud800"``, but not encodable in UTF-8) is sent escaped again.

    Nesting the decoder accepted (``parse_request``, near the top of the handler's stack) can
    exceed the recursion limit when it is encoded deeper in the handler's stack: then it is
    encoded again on a fresh thread's empty stack (rare: only bodies nested hundreds deep)."""
    try:
        return _encode(payload)
    except RecursionError:
        return _on_fresh_stack(payload)


#: JSON's whitespace, what may follow a body's closing brace.
_JSON_SPACE: Final = b" \t\r\n"


def appendable(body: Mapping[str, Any], raw: bytes, members: Mapping[str, object]) -> bool:
    """True when ``with_members`` can add ``members`` to ``raw`` (the bytes ``body``, a JSON object,
    was decoded from) without encoding ``body`` again: none of them is in ``body``, and ``raw`` is
    UTF-8 without a byte-order mark that ends with the object's closing brace (JSON's whitespace
    after it aside)."""
    if any(key in body for key in members) or json.detect_encoding(raw) != "utf-8":
        return False
    end = raw.rfind(b"}")
    return end >= 0 and not raw[end + 1 :].strip(_JSON_SPACE)


def with_members(
    body: Mapping[str, Any],
    raw: bytes,
    members: Mapping[str, object],
    encode: Callable[[object], bytes] = json_bytes,
) -> bytes:
    """The JSON object ``body`` (decoded from ``raw``) with ``members`` set, as UTF-8 bytes.

    When ``appendable``: ``raw`` itself with the members written before its closing brace, the
    client's bytes otherwise untouched and no value of ``body`` encoded again (a copy of ``raw``,
    which costs far less than encoding a big body). Else ``body`` updated and encoded
    with ``encode`` (``json_bytes``, or ``json_bytes_in_pieces`` for a big body), members already
    in it replaced in place and new ones last, the order ``appendable``'s path writes them in too."""
    if not appendable(body, raw, members):
        return encode({**body, **members})
    end = raw.rfind(b"}")
    added = b", ".join(json_bytes(key) + b": " + json_bytes(value) for key, value in members.items())
    view = memoryview(raw)
    return b"".join([view[:end], b", " if body else b"", added, view[end:]])


#: What ``json_bytes_in_pieces`` hands the C encoder in one call at most: values (those inside a
#: list or an object counted), and characters (of strings, keys and integers' digits).
_PIECE_VALUES: Final = 1024
_PIECE_CHARS: Final = 64 * 1024


def json_bytes_in_pieces(payload: object) -> bytes:
    """``json_bytes(payload)`` for a decoded JSON value (dicts with string keys, lists, strings,
    numbers, booleans, ``None``), the same JSON (escapes aside), encoded in pieces of at most
    ``_PIECE_VALUES`` values and ``_PIECE_CHARS`` characters: consecutive values of a list or an
    object (lists and objects of scalars among them) encoded together up to those bounds, a
    longer string cut, a deeper list or object split likewise. Every call into the C encoder is
    short, so a thread encoding a body of megabytes lets the event loop take the GIL between
    them (one ``json.dumps`` holds it from start to end). Nesting deeper than the thread's stack
    allows is encoded whole (``json_bytes``)."""
    out: list[bytes] = []
    try:
        _append_pieces(payload, out)
    except RecursionError:
        return json_bytes(payload)
    return b"".join(out)


def _weight(value: object) -> tuple[int, int] | None:
    """(values, characters) of ``value`` as ``json_bytes_in_pieces`` counts them; ``None`` for a
    list or an object that holds a list or an object."""
    if isinstance(value, str):
        return 1, len(value)
    if isinstance(value, int):
        return 1, value.bit_length() // 3  # about its digits: a long integer costs its digits
    if not isinstance(value, (dict, list)):
        return 1, 0
    chars = sum(map(len, value)) if isinstance(value, dict) else 0
    for item in value.values() if isinstance(value, dict) else value:
        if isinstance(item, str):
            chars += len(item)
        elif isinstance(item, (dict, list)):
            return None
    return 1 + len(value), chars


def _one_piece(weight: tuple[int, int] | None) -> bool:
    return weight is not None and weight[0] <= _PIECE_VALUES and weight[1] <= _PIECE_CHARS


def _append_pieces(value: object, out: list[bytes]) -> None:
    if _one_piece(_weight(value)):
        out.append(json_bytes(value))
    elif isinstance(value, str):
        out.append(b'"')
        for start in range(0, len(value), _PIECE_CHARS):
            out.append(json_bytes(value[start : start + _PIECE_CHARS])[1:-1])
        out.append(b'"')
    elif isinstance(value, dict):
        out.append(b"{")
        _append_runs(list(value.items()), out, as_dict=True)
        out.append(b"}")
    else:
        assert isinstance(value, list)
        out.append(b"[")
        _append_runs(value, out, as_dict=False)
        out.append(b"]")


def _append_runs(items: list[Any], out: list[bytes], *, as_dict: bool) -> None:
    """A list's values (or an object's ``(key, value)`` pairs, ``as_dict``), comma-separated:
    runs of them within the bounds encoded together, any other one in pieces of its own."""
    start = 0
    while start < len(items):
        if start:
            out.append(b", ")
        end = _run_end(items, start, as_dict=as_dict)
        if end > start:
            run = items[start:end]
            out.append(json_bytes(dict(run) if as_dict else run)[1:-1])
            start = end
            continue
        if as_dict:
            key, item = items[start]
            _append_pieces(key, out)
            out.append(b": ")
            _append_pieces(item, out)
        else:
            _append_pieces(items[start], out)
        start += 1


def _run_end(items: list[Any], start: int, *, as_dict: bool) -> int:
    """Where the run of ``items`` from ``start`` that one piece holds ends (``start``: none)."""
    end = start
    values = chars = 0
    while end < len(items):
        key, item = items[end] if as_dict else ("", items[end])
        weight = _weight(item)
        if weight is None:
            break
        values, chars = values + weight[0], chars + weight[1] + len(key)
        if values > _PIECE_VALUES or chars > _PIECE_CHARS:
            break
        end += 1
    return end


def _encode(payload: object) -> bytes:
    text = json.dumps(payload, ensure_ascii=False)
    try:
        return text.encode()
    except UnicodeEncodeError:
        return json.dumps(payload).encode()


def _on_fresh_stack(payload: object) -> bytes:
    """``_encode(payload)`` run on a new thread (its own, empty Python stack); waits for it.
    ``RecursionError`` when even that is too deep."""
    out: list[bytes] = []
    worker = threading.Thread(target=lambda: out.append(_encode(payload)), name="sluice-deep-json")
    worker.start()
    worker.join()
    if not out:
        raise RecursionError("JSON nested too deeply to encode")
    return out[0]


class _Parameters(BaseModel):
    model_config = ConfigDict(extra="allow")

    # TGI reads it as a u32 and refuses 0 (422): Sluice answers both with a 400.
    max_new_tokens: Annotated[StrictInt, Field(ge=1, le=2**32 - 1)] | None = TGI_DEFAULT_MAX_NEW_TOKENS
    details: StrictBool = False


class _GenerateBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    inputs: StrictStr
    parameters: _Parameters = Field(default_factory=_Parameters)
    stream: StrictBool = False


def parse_generate(
    raw: bytes, *, streaming_route: bool, limits: JsonLimits = DEFAULT_LIMITS
) -> tuple[dict[str, Any], int | None, bool, bool]:
    """Validate a ``/generate`` or ``/generate_stream`` body.

    Returns ``(body, max_new_tokens, stream, details)``: the decoded JSON object, the output cap in
    tokens (TGI's default 100 when absent, ``None`` when the client sent ``null``), whether the
    answer is a stream (always on ``/generate_stream``; ``"stream": true`` on ``/generate``) and
    whether the client itself asked for ``details``. Raises ``InvalidRequest`` (400) naming the
    field (``gateway.api.json_body.load_object``: within ``limits``, finite numbers only).
    """
    body = load_object(raw, limits)
    try:
        parsed = _GenerateBody.model_validate(body)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        loc = ".".join(str(part) for part in first["loc"])
        message = field_problem(first)
        raise InvalidRequest(f"{loc}: {message}", param=loc or None) from None
    stream = streaming_route or parsed.stream
    return body, parsed.parameters.max_new_tokens, stream, parsed.parameters.details


def upstream_generate_body(body: Mapping[str, Any], raw: bytes, *, stream: bool, details: bool) -> bytes:
    """The body sent to the replica: a non-streamed ``/generate`` always asks for ``details`` (the
    generated token count); a stream is counted event by event and goes out unchanged."""
    members = generate_members(body, stream=stream, details=details)
    return raw if members is None else with_members(body, raw, members)


def generate_members(body: Mapping[str, Any], *, stream: bool, details: bool) -> dict[str, object] | None:
    """The top-level members ``upstream_generate_body`` sets on ``body`` (``with_members``);
    ``None`` when the client's bytes go out unchanged."""
    if stream or details:
        return None
    parameters = body.get("parameters")
    return {"parameters": {**(parameters if isinstance(parameters, dict) else {}), "details": True}}


def generated_tokens(payload: object) -> int | None:
    """``details.generated_tokens`` of a ``/generate`` answer or a final stream event, if present."""
    if not isinstance(payload, dict):
        return None
    details = payload.get("details")
    if not isinstance(details, dict):
        return None
    count = details.get("generated_tokens")
    return count if isinstance(count, int) and not isinstance(count, bool) else None


def input_tokens(payload: object) -> int | None:
    """The prompt's token count where TGI tells it: ``details.input_length`` (newer TGI, streams)
    or the length of ``details.prefill`` (when ``decoder_input_details`` was asked)."""
    if not isinstance(payload, dict):
        return None
    details = payload.get("details")
    if not isinstance(details, dict):
        return None
    length = details.get("input_length")
    if isinstance(length, int) and not isinstance(length, bool):
        return length
    prefill = details.get("prefill")
    return len(prefill) if isinstance(prefill, list) and prefill else None


def without_details(body: bytes) -> bytes:
    """A ``/generate`` answer with the ``details`` Sluice asked for removed (unchanged when it is
    not a JSON object)."""
    try:
        payload = json.loads(body)
    except ValueError:
        return body
    if not isinstance(payload, dict) or "details" not in payload:
        return body
    del payload["details"]
    return json_bytes(payload)


def is_token_event(payload: object) -> bool:
    """A stream event that delivers one generated token (every TGI stream event but errors)."""
    return isinstance(payload, dict) and isinstance(payload.get("token"), dict)


def is_final_event(payload: object) -> bool:
    """The last event of a TGI stream: ``generated_text`` is set."""
    return isinstance(payload, dict) and isinstance(payload.get("generated_text"), str)


def error_event(message: str, error_type: str) -> bytes:
    """A TGI stream error event, as TGI itself sends one mid-stream."""
    return f"data: {json.dumps({'error': message, 'error_type': error_type})}\n\n".encode()
