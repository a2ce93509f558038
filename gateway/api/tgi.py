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
from collections.abc import Mapping
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
    if stream or details:
        return raw
    parameters = body.get("parameters")
    sent = dict(body)
    sent["parameters"] = {**(parameters if isinstance(parameters, dict) else {}), "details": True}
    return json_bytes(sent)


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
