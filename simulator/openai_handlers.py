"""The generation handlers of vLLM's OpenAI API: ``POST /v1/completions`` and
``/v1/chat/completions``, answered whole or streamed as SSE, one chunk per engine step.

A request is parsed (``simulator.openai_requests``), admitted (TGI's permit limit: 429 when full),
submitted to the replica's engine, then collected or streamed (``simulator.openai_bodies``).
A client that goes away aborts its request; an abort under a connected client (dead engine,
shutdown) ends with vLLM's error, mid-stream as an SSE error event.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Literal

from aiohttp import web

from simulator import tgi, tokens
from simulator.engine import TokenEvent
from simulator.openai_bodies import (
    SSE_DONE,
    ResponseIds,
    chat_body,
    chat_chunk,
    completion_body,
    completion_chunk,
    json_response,
    prompt_tokens_details,
    sse_error_event,
    sse_event,
    stream_usage,
    usage,
    usage_chunk,
)
from simulator.openai_requests import (
    check_content_type,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
)
from simulator.replica import (
    REPLICA,
    GenerationRequest,
    Inflight,
    Replica,
    abort_error,
    next_events,
    random_id,
)


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
        return json_response(tgi.OVERLOADED_BODY, status=429)
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
    details = _details(replica, req, entry, stream=False)
    payload = build(ids, text, last.finish_reason, usage(req.prompt_tokens, n, details))
    return json_response(payload)


def _details(
    replica: Replica, req: GenerationRequest, entry: Inflight, *, stream: bool
) -> dict[str, Any] | None:
    """``usage.prompt_tokens_details`` of a finished request: None unless the replica runs with
    ``--enable-prompt-tokens-details``."""
    if not replica.enable_prompt_tokens_details:
        return None
    stats = entry.stats
    cached = 0 if stats is None else stats.cached_tokens
    created = 0 if stats is None else stats.created_cache_tokens
    return prompt_tokens_details(req.kind, cached, created, stream=stream)


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
            use = stream_usage(req.prompt_tokens, sent, _details(replica, req, entry, stream=True))
            await response.write(sse_event(usage_chunk(req.kind, ids, use)))
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
