"""Response bodies and SSE framing of vLLM's OpenAI API (pure): whole ``text_completion`` and
``chat.completion`` bodies, streamed chunks, usage, and the JSON/SSE encodings vLLM writes.

Keys and their order follow vLLM 0.32's pydantic models; JSON is compact (``model_dump_json``),
except the mid-stream error event (``json.dumps`` defaults), as vLLM sends them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from aiohttp import web

from simulator.openai_errors import error_body
from simulator.replica import ApiError

SSE_DONE: Final = b"data: [DONE]\n\n"


def _dumps(obj: object) -> str:
    # Compact separators, as pydantic's model_dump_json writes vLLM's bodies.
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def json_response(payload: object, *, status: int = 200) -> web.Response:
    """A JSON response typed ``application/json`` without a charset, as FastAPI sends it."""
    return web.Response(body=_dumps(payload).encode(), status=status, content_type="application/json")


def sse_event(payload: Mapping[str, Any]) -> bytes:
    """One server-sent event carrying ``payload``: ``data: {json}\\n\\n``."""
    return f"data: {_dumps(payload)}\n\n".encode()


def sse_error_event(err: ApiError) -> bytes:
    """vLLM's mid-stream error event: its body through ``json.dumps`` (default separators)."""
    body = error_body(err.message, status=err.status, err_type=err.err_type, param=err.param)
    return f"data: {json.dumps(body)}\n\n".encode()


def usage(
    prompt_tokens: int, completion_tokens: int, details: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """vLLM's ``UsageInfo`` in a whole body; ``details`` (:func:`prompt_tokens_details`) come
    only with ``--enable-prompt-tokens-details``, else null."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None if details is None else dict(details),
        "completion_tokens_details": None,
    }


def stream_usage(
    prompt_tokens: int, completion_tokens: int, details: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """``UsageInfo`` in a chunk: the three counts (vLLM leaves the unset or null details out),
    then ``prompt_tokens_details`` when given (the final usage chunk, with the flag)."""
    use: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if details is not None:
        use["prompt_tokens_details"] = dict(details)
    return use


def prompt_tokens_details(
    kind: Literal["completion", "chat"], cached_tokens: int, created_cache_tokens: int, *, stream: bool
) -> dict[str, Any]:
    """vLLM 0.32's ``PromptTokenUsageInfo`` for ``--enable-prompt-tokens-details``, as each route
    writes it: chat sets all three fields (a stream's usage chunk drops the nulls), completions
    set only ``cached_tokens`` (a stream's usage chunk drops the unset ones)."""
    if kind == "chat":
        details: dict[str, Any] = {
            "cached_tokens": cached_tokens,
            "created_cache_tokens": created_cache_tokens,
        }
        return details if stream else {**details, "multimodal_tokens": None}
    if stream:
        return {"cached_tokens": cached_tokens}
    return {"cached_tokens": cached_tokens, "created_cache_tokens": None, "multimodal_tokens": None}


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
