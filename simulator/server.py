"""The HTTP face of an emulated replica: vLLM's OpenAI-compatible API over the emulated engine.

A client should not be able to tell this server from ``vllm serve`` (0.32) by its API: same
endpoints, JSON and SSE shapes, error bodies and ``/metrics`` names; only the model is fake.
``--engine tgi|sglang`` swaps ``/metrics``, the info endpoints and the native routes
(:mod:`simulator.native`); the OpenAI routes stay vLLM's. A client that goes away aborts its
request within about ``simulator.replica.DISCONNECT_POLL_S``. Entry points: :func:`build_app`
(in-process) and :func:`main` (``python -m simulator``, ``sluice sim``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, ValidationError

from simulator import native, sglang, tgi, tokens
from simulator.engine import TokenEvent
from simulator.metrics import CONTENT_TYPE
from simulator.profile import Profile, load_profile
from simulator.replica import (
    ENGINES,
    REPLICA,
    VLLM_VERSION,
    ApiError,
    EngineKind,
    GenerationRequest,
    Inflight,
    Replica,
    abort_error,
    next_events,
    random_id,
)

log = logging.getLogger("simulator.server")

#: vLLM's default ``max_tokens`` for ``/v1/completions`` (OpenAI's legacy default).
COMPLETIONS_DEFAULT_MAX_TOKENS: Final = 16

SSE_DONE: Final = b"data: [DONE]\n\n"


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


class BodyParseError(Exception):
    """A body FastAPI cannot even decode (not UTF-8): 400 with FastAPI's ``{"detail": ...}``."""

    DETAIL: Final = "There was an error parsing the body"


def error_body(message: str, *, status: int, err_type: str, param: str | None = None) -> dict[str, Any]:
    """vLLM's current error body.

    vLLM's ``ErrorResponse``/``ErrorInfo`` in ``vllm/entrypoints/openai/engine/protocol.py``
    (vllm-project/vllm main): ``{"error": {"message", "type", "param", "code"}}``, ``code`` the
    HTTP status as an int, ``type`` e.g. ``"BadRequestError"`` / ``"NotFoundError"``; real 0.3x
    error bodies have this shape. Older versions (before about 0.11) sent a flat
    ``{"object": "error", "message", ...}``; the nested form is the current one.
    """
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def _error_response(err: ApiError) -> web.Response:
    body = error_body(err.message, status=err.status, err_type=err.err_type, param=err.param)
    return _json(body, status=err.status)


def validation_error(message: str, *, parameter: str | None = None, value: object = None) -> ApiError:
    """vLLM's 400 ``BadRequestError`` for a ``VLLMValidationError``.

    Its ``str()`` appends ``(parameter=..., value=...)`` for whichever of the two is set, and the
    body's ``param`` is the parameter (``vllm/exceptions.py``, 0.32).
    """
    extras = [f"{k}={v}" for k, v in (("parameter", parameter), ("value", value)) if v is not None]
    return ApiError(f"{message} ({', '.join(extras)})" if extras else message, param=parameter)


def prompt_too_long_error(*, max_model_len: int, prompt_tokens: int, text_prompt: bool) -> ApiError:
    """vLLM 0.32's 400 for a prompt longer than ``max_model_len`` tokens (``param="input_tokens"``).

    A text prompt (a completion string or a rendered chat) is tokenized with truncation to
    ``max_model_len + 1`` tokens, so vLLM only knows it has "at least" that many; a prompt of token
    ids is counted exactly, and says "at least" only when it has exactly ``max_model_len + 1``.
    """
    count = min(prompt_tokens, max_model_len + 1) if text_prompt else prompt_tokens
    qualifier = "at least " if count == max_model_len + 1 else ""
    return validation_error(
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
        f"contains {qualifier}{count} input tokens, which exceeds this limit even without any output "
        f"tokens. Please reduce the length of the input prompt.",
        parameter="input_tokens",
        value=count,
    )


#: pydantic-core's internal ``loc`` segments, which vLLM drops from ``param`` (vLLM 0.32, Apache-2.0:
#: ``vllm/entrypoints/serve/exception_handling/handlers/validation.py``).
_INTERNAL_LOC_MARKERS: Final = frozenset(
    {
        "function-wrap", "function-after", "function-before", "function-plain", "json-or-python",
        "lax-or-strict", "chain", "default", "nullable", "tagged-union", "union", "call", "arguments",
        "is-instance", "is-subclass", "callable", "str", "int", "float", "bool", "bytes", "bytearray",
        "list", "tuple", "dict", "set", "frozenset", "complex", "none", "nonetype",
    }
)  # fmt: skip
_BRACKETED_RE: Final = re.compile(r"[\[\]{}()]")
#: vLLM bounds the errors it reports and the size of each (same file).
_MAX_REPORTED_ERRORS: Final = 10
_MAX_ERROR_INPUT_CHARS: Final = 200
_MAX_ERROR_CHARS: Final = 1000


def _clean_loc(loc: Sequence[object]) -> str:
    """A pydantic ``loc`` as vLLM's dotted ``param``: ``("body", "max_tokens")`` -> ``body.max_tokens``."""
    parts = [
        str(p) for p in loc if not (_BRACKETED_RE.search(str(p)) or str(p).lower() in _INTERNAL_LOC_MARKERS)
    ]
    return ".".join(parts or [str(p) for p in loc])


def _summarize_input(value: object) -> object:
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = value if isinstance(value, str) else str(value)
    if len(text) > _MAX_ERROR_INPUT_CHARS:
        return text[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]"
    return text


def _format_error(err: Mapping[str, Any] | str) -> str:
    if isinstance(err, str):
        return err
    shown = dict(err)
    if "input" in shown:
        shown["input"] = _summarize_input(shown["input"])
    shown["loc"] = _clean_loc(shown.get("loc", ()))
    text = str(shown)
    return text[:_MAX_ERROR_CHARS] + "...[truncated]" if len(text) > _MAX_ERROR_CHARS else text


def request_validation_error(errors: Sequence[Mapping[str, Any] | str]) -> ApiError:
    """vLLM's 400 for a body FastAPI cannot parse or validate (a ``RequestValidationError``).

    ``errors`` are pydantic's (``loc`` starting with ``"body"``) or plain strings. As vLLM 0.32's
    handler: ``type`` is ``"Bad Request"``, ``param`` the first error's dotted ``loc`` (e.g.
    ``body.37`` for invalid JSON at character 37), the message ``"N validation error(s):"`` with
    one indented line per error.
    """
    first = errors[0] if errors else None
    param = _clean_loc(first["loc"]) if isinstance(first, Mapping) and first.get("loc") else None
    label = "error" if len(errors) == 1 else "errors"
    shown = errors[:_MAX_REPORTED_ERRORS]
    message = f"{len(errors)} validation {label}:\n" + "".join(f"  {_format_error(e)}\n" for e in shown)
    if len(errors) > len(shown):
        message += f"  ...and {len(errors) - len(shown)} more {label}\n"
    return ApiError(message.rstrip(), err_type="Bad Request", param=param)


# ---------------------------------------------------------------------------------------------
# Request parsing and validation (pure)
# ---------------------------------------------------------------------------------------------


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class _SamplingFields(BaseModel):
    """The request fields the emulator acts on; every other OpenAI/vLLM field is accepted and ignored."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    n: int = 1
    stream: bool | None = False
    stream_options: _StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0


class _CompletionBody(_SamplingFields):
    prompt: list[int] | list[list[int]] | str | list[str] | None = None


class _ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class _ChatMessages(BaseModel):
    model_config = ConfigDict(extra="allow")

    messages: list[_ChatMessage]


# Bases in this order put ``messages`` first, as in vLLM's ChatCompletionRequest: the first
# validation error names the body's ``param``.
class _ChatBody(_SamplingFields, _ChatMessages):
    max_completion_tokens: int | None = None


def check_content_type(content_type: str | None) -> str:
    """vLLM's ``validate_json_request``: a generation body must be typed ``application/json``.

    Returns the media type (``application/json``); raises vLLM's 400 for any other or none.
    """
    media_type = (content_type or "").lower().split(";", maxsplit=1)[0].strip()
    if media_type != "application/json":
        raise request_validation_error(["Unsupported Media Type: Only 'application/json' is allowed"])
    return media_type


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or the 400 FastAPI gives (through vLLM's handler).

    Empty: ``missing`` at ``body``; not JSON: ``json_invalid`` at ``body.<position>``; not an
    object: ``model_attributes_type`` at ``body``; not UTF-8: :class:`BodyParseError`.
    """
    if not raw:
        raise request_validation_error(
            [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]
        )
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise request_validation_error(
            [
                {
                    "type": "json_invalid",
                    "loc": ("body", exc.pos),
                    "msg": "JSON decode error",
                    "input": {},
                    "ctx": {"error": exc.msg},
                }
            ]
        ) from None
    except UnicodeDecodeError:
        raise BodyParseError(BodyParseError.DETAIL) from None
    if not isinstance(body, dict):
        raise request_validation_error(
            [
                {
                    "type": "model_attributes_type",
                    "loc": ("body",),
                    "msg": "Input should be a valid dictionary or object to extract fields from",
                    "input": body,
                }
            ]
        )
    return body


def _body_errors(exc: ValidationError) -> ApiError:
    """pydantic's errors for a body, located under ``body`` as FastAPI reports them."""
    errors: list[Mapping[str, Any]] = [
        {**err, "loc": ("body", *err["loc"])} for err in exc.errors(include_url=False, include_context=True)
    ]
    return request_validation_error(errors)


def _validate_model(requested: str | None, served: str) -> None:
    """vLLM serves a request that names no model with its (only) served model."""
    if requested and requested != served:
        raise ApiError(
            f"The model `{requested}` does not exist. Valid aliases: {served}.",
            status=404,
            err_type="NotFoundError",
            param="model",
        )


def _validate_stream_options(fields: _SamplingFields) -> None:
    # A "before" validator of vLLM's request models: it runs ahead of the model check.
    if fields.stream_options is not None and not fields.stream:
        raise validation_error(
            "Stream options can only be defined when `stream=True`.", parameter="stream_options"
        )


def _check_output_limit(requested: int | None, *, param: str, max_model_len: int) -> None:
    """vLLM's ``TokenizeParams`` check: asking for more output than the whole context is a 400."""
    if requested is not None and requested > max_model_len:
        raise validation_error(
            f"{param}={requested} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            parameter=param,
            value=requested,
        )


def _resolve_max_tokens(
    *, requested: int | None, prompt_tokens: int, max_model_len: int, text_prompt: bool
) -> int:
    """The output cap vLLM 0.32 uses (``get_max_tokens``), or the 400 it gives.

    A prompt longer than the context is refused; otherwise the cap is the request's (``None``:
    no cap) clamped to what the context has left, ``max_model_len - prompt_tokens``: vLLM does not
    refuse a prompt plus ``max_tokens`` that overflow, it stops the output at the context's end
    (``finish_reason="length"``). A cap below 1 (asked for, or a prompt that fills the context)
    is ``SamplingParams``' "max_tokens must be at least 1".
    """
    if prompt_tokens > max_model_len:
        raise prompt_too_long_error(
            max_model_len=max_model_len, prompt_tokens=prompt_tokens, text_prompt=text_prompt
        )
    room = max_model_len - prompt_tokens
    max_tokens = room if requested is None else min(requested, room)
    if max_tokens < 1:
        raise validation_error(
            f"max_tokens must be at least 1, got {max_tokens}.", parameter="max_tokens", value=max_tokens
        )
    return max_tokens


def _check_sampling(fields: _SamplingFields, max_tokens: int) -> None:
    """``SamplingParams``' own checks that the emulator acts on, in vLLM's order."""
    if fields.n < 1:
        raise ApiError(f"n must be at least 1, got {fields.n}.")
    if fields.n > 1:
        raise ApiError(
            f"n={fields.n} is not supported by this replica emulator: it generates one choice per request.",
            param="n",
        )
    if fields.min_tokens < 0:
        raise ApiError(f"min_tokens must be greater than or equal to 0, got {fields.min_tokens}.")
    if fields.min_tokens > max_tokens:
        raise ApiError(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {fields.min_tokens}."
        )


def _completion_prompt(prompt: list[int] | list[list[int]] | str | list[str] | None) -> str | list[int]:
    """The single prompt of a completion request (a text or token ids)."""
    if prompt is None or prompt == "" or prompt == []:
        raise validation_error(
            "Either prompt or prompt_embeds must be provided and non-empty.", parameter="prompt"
        )
    if isinstance(prompt, str):
        return prompt
    first = prompt[0]
    if isinstance(first, int):
        return [int(p) for p in prompt if isinstance(p, int)]
    if len(prompt) > 1:
        raise ApiError(
            f"This replica emulator serves one prompt per request; got a batch of {len(prompt)}.",
            param="prompt",
        )
    if isinstance(first, str):
        if first == "":
            raise validation_error(
                "Either prompt or prompt_embeds must be provided and non-empty.", parameter="prompt"
            )
        return first
    return list(first)


def parse_completion_request(
    body: Mapping[str, Any], *, served_model: str, max_model_len: int
) -> GenerationRequest:
    """Validate a ``POST /v1/completions`` body as vLLM does (raises :class:`ApiError`).

    An absent (or null) ``max_tokens`` is 16, vLLM's default, clamped like an explicit one.
    """
    try:
        req = _CompletionBody.model_validate(body)
    except ValidationError as exc:
        raise _body_errors(exc) from None
    _validate_stream_options(req)
    _validate_model(req.model, served_model)
    requested = req.max_tokens if req.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
    _check_output_limit(requested, param="max_tokens", max_model_len=max_model_len)
    prompt = _completion_prompt(req.prompt)
    prompt_tokens = tokens.count_completion_prompt(prompt)
    max_tokens = _resolve_max_tokens(
        requested=requested,
        prompt_tokens=prompt_tokens,
        max_model_len=max_model_len,
        text_prompt=isinstance(prompt, str),
    )
    _check_sampling(req, max_tokens)
    seed_text = prompt if isinstance(prompt, str) else ",".join(map(str, prompt))
    return _generation_request("completion", req, served_model, prompt_tokens, max_tokens, seed_text)


def parse_chat_request(
    body: Mapping[str, Any], *, served_model: str, max_model_len: int
) -> GenerationRequest:
    """Validate a ``POST /v1/chat/completions`` body as vLLM does (raises :class:`ApiError`).

    ``max_completion_tokens`` wins over the deprecated ``max_tokens``; with neither, the output
    may fill the context: ``max_model_len - prompt_tokens`` (vLLM's default for chat).
    """
    try:
        req = _ChatBody.model_validate(body)
    except ValidationError as exc:
        raise _body_errors(exc) from None
    _validate_stream_options(req)
    _validate_model(req.model, served_model)
    requested: int | None = req.max_tokens
    param = "max_tokens"
    if req.max_completion_tokens is not None:
        requested, param = req.max_completion_tokens, "max_completion_tokens"
    _check_output_limit(requested, param=param, max_model_len=max_model_len)
    messages = [m.model_dump() for m in req.messages]
    prompt_tokens = tokens.count_chat_prompt(messages)
    max_tokens = _resolve_max_tokens(
        requested=requested, prompt_tokens=prompt_tokens, max_model_len=max_model_len, text_prompt=True
    )
    _check_sampling(req, max_tokens)
    seed_text = "\n".join(tokens.message_text(m.get("content")) for m in messages)
    return _generation_request("chat", req, served_model, prompt_tokens, max_tokens, seed_text)


def _generation_request(
    kind: Literal["completion", "chat"],
    req: _SamplingFields,
    served_model: str,
    prompt_tokens: int,
    max_tokens: int,
    seed_text: str,
) -> GenerationRequest:
    options = req.stream_options
    stream = bool(req.stream)
    return GenerationRequest(
        kind=kind,
        model=served_model,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        stream=stream,
        include_usage=stream and options is not None and bool(options.include_usage),
        continuous_usage_stats=stream and options is not None and bool(options.continuous_usage_stats),
        text_seed=tokens.text_seed(seed_text),
    )


# ---------------------------------------------------------------------------------------------
# Response bodies and SSE framing (pure)
# ---------------------------------------------------------------------------------------------


def _dumps(obj: object) -> str:
    # Compact separators, as pydantic's model_dump_json writes vLLM's bodies.
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def _json(payload: object, *, status: int = 200) -> web.Response:
    """A JSON response typed ``application/json`` without a charset, as FastAPI sends it."""
    return web.Response(body=_dumps(payload).encode(), status=status, content_type="application/json")


def sse_event(payload: Mapping[str, Any]) -> bytes:
    """One server-sent event carrying ``payload``: ``data: {json}\\n\\n``."""
    return f"data: {_dumps(payload)}\n\n".encode()


def sse_error_event(err: ApiError) -> bytes:
    """vLLM's mid-stream error event: its body through ``json.dumps`` (default separators)."""
    body = error_body(err.message, status=err.status, err_type=err.err_type, param=err.param)
    return f"data: {json.dumps(body)}\n\n".encode()


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """vLLM's ``UsageInfo`` in a whole body (the token details come only with server flags: null)."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def stream_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """``UsageInfo`` in a chunk: the three counts (vLLM leaves the unset or null details out)."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


@dataclass(frozen=True, slots=True)
class ResponseIds:
    """What every body and chunk of one response repeats."""

    id: str
    #: Unix time, seconds.
    created: int
    model: str
    #: The server's ``system_fingerprint`` (:func:`system_fingerprint`); None sends null.
    fingerprint: str | None = None


def completion_body(
    ids: ResponseIds, text: str, finish_reason: str | None, use: Mapping[str, Any]
) -> dict[str, Any]:
    """A non-streaming ``text_completion`` body, with vLLM 0.32's keys."""
    choice = {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": None,
        "token_ids": None,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "routed_experts": None,
    }
    return {
        "id": ids.id,
        "object": "text_completion",
        "created": ids.created,
        "model": ids.model,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": ids.fingerprint,
        "usage": dict(use),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def chat_body(
    ids: ResponseIds, text: str, finish_reason: str | None, use: Mapping[str, Any]
) -> dict[str, Any]:
    """A non-streaming ``chat.completion`` body, with vLLM 0.32's keys."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": text,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": None,
    }
    choice = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": None,
        "token_ids": None,
        "routed_experts": None,
    }
    return {
        "id": ids.id,
        "object": "chat.completion",
        "created": ids.created,
        "model": ids.model,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": ids.fingerprint,
        "usage": dict(use),
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "prompt_text": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def _chunk(obj: str, ids: ResponseIds, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": ids.id, "object": obj, "created": ids.created, "model": ids.model, "choices": choices}


def completion_chunk(
    ids: ResponseIds,
    text: str,
    finish_reason: str | None,
    use: Mapping[str, Any] | None = None,
    *,
    fingerprint: bool = False,
) -> dict[str, Any]:
    """One streamed ``text_completion`` chunk.

    ``use``: only with ``continuous_usage_stats``. ``fingerprint``: stamp ``system_fingerprint``,
    which vLLM does on the finishing chunk when no usage chunk follows it.
    """
    choice = {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": None,
        "prompt_token_ids": None,
        "token_ids": None,
    }
    chunk = _chunk("text_completion", ids, [choice])
    if use is not None:
        chunk["usage"] = dict(use)
    if fingerprint:
        chunk["system_fingerprint"] = ids.fingerprint
    return chunk


def chat_chunk(
    ids: ResponseIds,
    delta: Mapping[str, Any],
    finish_reason: str | None,
    use: Mapping[str, Any] | None = None,
    *,
    fingerprint: bool = False,
) -> dict[str, Any]:
    """One streamed ``chat.completion.chunk``; the first (``delta.role`` set) has vLLM's own keys.

    ``use`` and ``fingerprint`` as in :func:`completion_chunk`; a chunk's ``usage`` also has
    ``completion_tokens_details`` (null), as vLLM sets it on chat chunks.
    """
    first = "role" in delta
    choice: dict[str, Any] = {
        "index": 0,
        "delta": dict(delta),
        "logprobs": None,
        "finish_reason": finish_reason,
    }
    if finish_reason is not None:
        choice["stop_reason"] = None
    if not first:
        choice["token_ids"] = None
    chunk = _chunk("chat.completion.chunk", ids, [choice])
    if use is not None:
        chunk["usage"] = {**use, "completion_tokens_details": None}
    if fingerprint:
        chunk["system_fingerprint"] = ids.fingerprint
    if first:
        chunk["prompt_token_ids"] = None
        chunk["prompt_text"] = None
    return chunk


def usage_chunk(
    kind: Literal["completion", "chat"], ids: ResponseIds, use: Mapping[str, Any]
) -> dict[str, Any]:
    """The last chunk with ``stream_options.include_usage``: no choices, the final usage, fingerprint."""
    obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
    chunk = _chunk(obj, ids, [])
    chunk["usage"] = dict(use)
    if ids.fingerprint is not None:
        chunk["system_fingerprint"] = ids.fingerprint
    return chunk


# ---------------------------------------------------------------------------------------------
# Handlers
# ---------------------------------------------------------------------------------------------


async def _generate(request: web.Request, kind: Literal["completion", "chat"]) -> web.StreamResponse:
    replica = request.app[REPLICA]
    started = asyncio.get_running_loop().time()
    check_content_type(request.headers.get("Content-Type"))
    body = parse_json_body(await request.read())
    parse = parse_completion_request if kind == "completion" else parse_chat_request
    req = parse(body, served_model=replica.model_name, max_model_len=replica.max_model_len)
    replica.metrics.record_request()
    if not replica.try_acquire():
        # Only TGI has a permit limit: its router refuses at once (a stream gets an error event).
        replica.metrics.record_rejected("overloaded")
        return await _overloaded(request, stream=req.stream)
    try:
        replica.metrics.record_admitted(
            req.prompt_tokens, req.max_tokens, asyncio.get_running_loop().time() - started
        )
        # As in vLLM, the engine's request id is the response's id.
        ids = ResponseIds(
            f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{random_id()}",
            int(time.time()),
            req.model,
            replica.system_fingerprint,
        )
        entry = replica.submit(ids.id, req, request)
        try:
            if req.stream:
                return await _stream(request, replica, ids, entry, req)
            return await _collect(replica, ids, entry, req)
        finally:
            replica.release(ids.id)
    finally:
        replica.release_permit()


async def _overloaded(request: web.Request, *, stream: bool) -> web.StreamResponse:
    """TGI's refusal past ``max_concurrent_requests``: 429 with ``{"error", "error_type"}``; a
    stream has already answered 200, so it carries the same body as an SSE event, then ``[DONE]``
    (TGI's ``generate_stream_internal`` yields the error inside the stream)."""
    if not stream:
        return _json(tgi.OVERLOADED_BODY, status=429)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(sse_event(tgi.OVERLOADED_BODY))
    await response.write(SSE_DONE)
    await response.write_eof()
    return response


async def _collect(
    replica: Replica, ids: ResponseIds, entry: Inflight, req: GenerationRequest
) -> web.StreamResponse:
    """Wait for the whole output, then answer with one JSON body."""
    while True:
        last = (await next_events(entry))[-1]
        if last.finished:
            break
    if last.finish_reason == "abort":
        err = abort_error(replica)
        if err is not None:
            raise err
        # The client is gone: nobody reads this. 499 is what proxies log for it.
        return web.Response(status=499)
    n = last.num_output_tokens
    text = tokens.fake_text(req.text_seed, 0, n)
    build = completion_body if req.kind == "completion" else chat_body
    payload = build(ids, text, last.finish_reason, usage(req.prompt_tokens, n))
    return _json(payload)


async def _stream(
    request: web.Request, replica: Replica, ids: ResponseIds, entry: Inflight, req: GenerationRequest
) -> web.StreamResponse:
    """Answer with SSE: (chat: a role chunk), one chunk per engine step, usage, ``[DONE]``.

    A request aborted under a connected client (dead engine, shutdown) ends with vLLM's mid-stream
    error event, ``data: {"error": {...}}``, then ``[DONE]``.
    """
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    sent = 0
    try:
        await response.prepare(request)
        while True:
            events = await next_events(entry)
            last = events[-1]
            if last.finish_reason == "abort":
                err = abort_error(replica)
                if err is not None:
                    await response.write(sse_error_event(err))
                    await response.write(SSE_DONE)
                return response
            new = last.num_output_tokens - sent
            for chunk in _step_chunks(req, ids, sent, new, last):
                await response.write(sse_event(chunk))
            sent = last.num_output_tokens
            if last.finished:
                break
        if req.include_usage:
            await response.write(sse_event(usage_chunk(req.kind, ids, stream_usage(req.prompt_tokens, sent))))
        await response.write(SSE_DONE)
        await response.write_eof()
    except ConnectionError:
        # A failed write: the client went away mid-stream (vLLM aborts the request likewise).
        replica.abort(ids.id)
    return response


def _step_chunks(
    req: GenerationRequest, ids: ResponseIds, sent: int, new: int, last: TokenEvent
) -> list[dict[str, Any]]:
    """The SSE chunks for ``new`` tokens after ``sent``; ``finish_reason`` rides on the last one.

    The finishing chunk carries ``system_fingerprint`` unless a usage chunk follows it (vLLM
    stamps only the stream's true last message).
    """
    text = tokens.fake_text(req.text_seed, sent, new)
    finish = last.finish_reason if last.finished else None
    stamp = finish is not None and not req.include_usage and ids.fingerprint is not None
    continuous = req.continuous_usage_stats
    use = stream_usage(req.prompt_tokens, sent + new) if continuous else None
    if req.kind == "completion":
        return [completion_chunk(ids, text, finish, use, fingerprint=stamp)]
    chunks = []
    if sent == 0:
        # vLLM's first chat chunk announces the role, with empty content and no output yet.
        role_use = stream_usage(req.prompt_tokens, 0) if continuous else None
        chunks.append(chat_chunk(ids, {"role": "assistant", "content": ""}, None, role_use))
    chunks.append(chat_chunk(ids, {"content": text}, finish, use, fingerprint=stamp))
    return chunks


async def handle_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions``."""
    return await _generate(request, "completion")


async def handle_chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions``."""
    return await _generate(request, "chat")


async def handle_models(request: web.Request) -> web.Response:
    """``GET /v1/models``: vLLM's ``ModelList`` with the one served model (TGI's own shape, with
    no ``max_model_len``, when imitating TGI)."""
    replica = request.app[REPLICA]
    if replica.engine_kind == "tgi":
        return _json(tgi.models_body(replica.model_name))
    permission = {
        "id": f"modelperm-{random_id()}",
        "object": "model_permission",
        "created": replica.created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    card = {
        "id": replica.model_name,
        "object": "model",
        "created": replica.created,
        "owned_by": "vllm",
        "root": replica.model_name,
        "parent": None,
        "max_model_len": replica.max_model_len,
        "permission": [permission],
    }
    return _json({"object": "list", "data": [card]})


async def handle_health(request: web.Request) -> web.Response:
    """``GET /health``: 200 with an empty body; 503 once the engine has died (vLLM: empty body,
    TGI: ``{"error": "unhealthy", "error_type": "healthcheck"}``)."""
    replica = request.app[REPLICA]
    if replica.dead is None:
        return web.Response(status=200)
    if replica.engine_kind == "tgi":
        return _json({"error": "unhealthy", "error_type": "healthcheck"}, status=503)
    return web.Response(status=503)


async def handle_version(request: web.Request) -> web.Response:
    """``GET /version``: the vLLM version whose API this emulator reproduces."""
    return _json({"version": VLLM_VERSION})


async def handle_load(request: web.Request) -> web.Response:
    """``GET /load``: requests in flight (vLLM's ``--enable-server-load-tracking`` answer)."""
    return _json({"server_load": request.app[REPLICA].num_inflight})


async def handle_metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus text with the emulated engine's metric names."""
    replica = request.app[REPLICA]
    content_type = tgi.CONTENT_TYPE if replica.engine_kind == "tgi" else CONTENT_TYPE
    return web.Response(body=replica.metrics.exposition(), headers={"Content-Type": content_type})


async def handle_ping(request: web.Request) -> web.Response:
    """``GET/POST /ping``: SageMaker's health check, same answer as ``/health``."""
    return await handle_health(request)


async def handle_tokenize(request: web.Request) -> web.Response:
    """``POST /tokenize``: the emulator's own token count for a prompt or a chat.

    Token ids are stable fakes (one per counted token), so ``count`` always equals what a
    completion request with the same input reports as ``usage.prompt_tokens``.
    """
    replica = request.app[REPLICA]
    check_content_type(request.headers.get("Content-Type"))
    body = parse_json_body(await request.read())
    _validate_model(body.get("model"), replica.model_name)
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ApiError("messages: Input should be a valid list of messages", param="messages")
        count = tokens.count_chat_prompt(messages)
        seed_text = "\n".join(tokens.message_text(m.get("content")) for m in messages)
        ids = [tokens.text_seed(f"{seed_text}#{i}") % tokens.VOCAB_SIZE for i in range(count)]
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise ApiError("prompt: Input should be a valid string", param="prompt")
        ids = [1] * tokens.BOS_TOKENS + tokens.fake_token_ids(prompt)
        count = len(ids)
    return _json(
        {"count": count, "max_model_len": replica.max_model_len, "tokens": ids, "token_strs": None},
    )


# ---------------------------------------------------------------------------------------------
# Application
# ---------------------------------------------------------------------------------------------


@web.middleware
async def _errors_as_vllm(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
    """Render :class:`ApiError` as vLLM's JSON body; routing errors as FastAPI's ``{"detail"}``."""
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except ApiError as err:
        return _error_response(err)
    except BodyParseError as err:
        return _json({"detail": str(err)}, status=400)
    except web.HTTPException as exc:
        if exc.status in (404, 405):
            return _json({"detail": exc.reason}, status=exc.status)
        raise


async def _server_header(request: web.Request, response: web.StreamResponse) -> None:
    # vLLM and SGLang run under uvicorn; keep a header sniffer from telling them apart. (TGI's
    # axum sends no Server header; aiohttp's own stays there.)
    if request.app[REPLICA].engine_kind != "tgi":
        response.headers["server"] = "uvicorn"


def build_app(
    profile: Profile,
    *,
    seed: int | None = None,
    jitter: float = 0.0,
    engine: EngineKind = "vllm",
    max_concurrent_requests: int | None = None,
) -> web.Application:
    """An aiohttp application serving one emulated replica of ``profile``.

    The engine task starts with the application (``cleanup_ctx``) and stops with it; in-flight
    requests are aborted at shutdown. ``seed`` makes output lengths and step-time jitter
    reproducible; ``jitter`` is the relative step-time noise passed to the engine. ``engine``
    picks whose ``/metrics``, info endpoint, native API and overload behaviour it shows (the
    OpenAI routes are vLLM's for all); ``max_concurrent_requests`` is TGI's permit limit
    (default 128, TGI's; ignored by the other engines).
    """
    app = web.Application(middlewares=[_errors_as_vllm])
    limit = (max_concurrent_requests or tgi.DEFAULT_MAX_CONCURRENT_REQUESTS) if engine == "tgi" else None

    async def replica_ctx(app: web.Application) -> AsyncIterator[None]:
        replica = Replica(
            profile, seed=seed, jitter=jitter, engine_kind=engine, max_concurrent_requests=limit
        )
        app[REPLICA] = replica
        await replica.start()
        yield
        await replica.stop()

    async def abort_inflight(app: web.Application) -> None:
        # Runs before aiohttp waits for open handlers, so streams end now, not at a timeout.
        replica = app[REPLICA]
        replica.stopping = True
        replica.abort_all()

    app.cleanup_ctx.append(replica_ctx)
    app.on_shutdown.append(abort_inflight)
    app.on_response_prepare.append(_server_header)
    app.router.add_post("/v1/completions", handle_completions)
    app.router.add_post("/v1/chat/completions", handle_chat_completions)
    app.router.add_get("/v1/models", handle_models)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/version", handle_version)
    app.router.add_get("/load", handle_load)
    app.router.add_get("/metrics", handle_metrics)
    app.router.add_get("/ping", handle_ping)
    app.router.add_post("/ping", handle_ping)
    app.router.add_post("/tokenize", handle_tokenize)
    native.add_routes(app, engine)
    return app


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice sim",
        description="Run one emulated replica (OpenAI API, SSE, /metrics) of vLLM, TGI or SGLang in "
        "the foreground.",
    )
    parser.add_argument("--profile", required=True, help="profile name (config/profiles/NAME.yaml) or path")
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="vllm",
        help="engine to imitate: its /metrics, info endpoint (TGI /info, SGLang /get_server_info), "
        "native API (TGI /generate, /generate_stream) and overload behaviour (default vllm)",
    )
    parser.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=None,
        help="TGI only: requests queued + running before a 429 "
        f"(default {tgi.DEFAULT_MAX_CONCURRENT_REQUESTS})",
    )
    parser.add_argument("--port", type=int, default=8000, help="TCP port; 0 picks a free one (default 8000)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--seed", type=int, default=None, help="seed for output lengths and jitter")
    parser.add_argument(
        "--jitter", type=float, default=0.0, help="relative step-time noise, e.g. 0.05 (default 0)"
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    return parser


async def serve(
    profile: Profile,
    *,
    host: str,
    port: int,
    seed: int | None = None,
    jitter: float = 0.0,
    ready: Callable[[str], None] | None = None,
    engine: EngineKind = "vllm",
    max_concurrent_requests: int | None = None,
) -> None:
    """Serve ``profile`` on ``host:port`` until SIGINT/SIGTERM (or cancellation), then shut down.

    ``ready`` is called with the base URL once the socket listens (the port is the real one when
    ``port`` is 0).
    """
    app = build_app(
        profile, seed=seed, jitter=jitter, engine=engine, max_concurrent_requests=max_concurrent_requests
    )
    # handler_cancellation: a vanished client cancels its handler at once (the watcher is the
    # fallback); shutdown_timeout: streams are aborted at shutdown, so this is only a backstop.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        # Handlers first: whoever waits for the ready line may signal right after it.
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            bound_host, bound_port = runner.addresses[0][:2]
            if ready is not None:
                ready(f"http://{_url_host(str(bound_host))}:{bound_port}")
            await stop.wait()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
    finally:
        await runner.cleanup()


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a runtime dependency off Windows
        return None
    return uvloop.new_event_loop


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m simulator`` / ``sluice sim``: run one replica in the foreground.

    Logs one ready line (``... ready on http://HOST:PORT: ...``, the real port when ``--port 0``)
    to stderr once it accepts connections. Returns 0 after SIGINT/SIGTERM, 1 when it cannot
    listen, 2 for a profile it cannot load (argparse exits 2 on bad arguments).
    """
    args = _parser().parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        profile = load_profile(args.profile)
    except (OSError, ValueError) as exc:
        print(f"sluice sim: cannot load profile {args.profile!r}: {exc}", file=sys.stderr)
        return 2

    if args.max_concurrent_requests is not None and args.max_concurrent_requests < 1:
        print("sluice sim: --max-concurrent-requests must be >= 1", file=sys.stderr)
        return 2
    engine: EngineKind = args.engine
    what = {
        "vllm": f"vLLM {VLLM_VERSION}",
        "tgi": f"TGI {tgi.TGI_VERSION}",
        "sglang": f"SGLang {sglang.SGLANG_VERSION}",
    }

    def ready(url: str) -> None:
        log.info(
            "replica emulator ready on %s: model %s, profile %s, %s API",
            url,
            profile.served_model_name,
            profile.name,
            what[engine],
        )

    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(
                serve(
                    profile,
                    host=args.host,
                    port=args.port,
                    seed=args.seed,
                    jitter=args.jitter,
                    ready=ready,
                    engine=engine,
                    max_concurrent_requests=args.max_concurrent_requests,
                )
            )
    except OSError as exc:
        print(f"sluice sim: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    log.info("replica emulator stopped")
    return 0
