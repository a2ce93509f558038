"""The engine-specific routes of the emulator: TGI's and SGLang's info endpoints and native APIs.

TGI (``--engine tgi``): ``GET /info``, ``POST /`` (compat), ``/generate`` and ``/generate_stream``,
each behind ``max_concurrent_requests`` permits (none free: 429 ``overloaded``; validation: 422).
SGLang (``--engine sglang``): ``/get_server_info`` (and ``/server_info``), ``/get_model_info``,
``/health_generate`` and ``POST /generate``. Body shapes, sources and what was verified:
docs/emulator.md.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from aiohttp import web

from simulator import sglang, tgi, tokens
from simulator.replica import REPLICA, GenerationRequest, Inflight, Replica, next_events, random_id


def add_routes(app: web.Application, engine: str) -> None:
    """Add ``engine``'s own routes to an emulator application (none for vLLM)."""
    if engine == "tgi":
        app.router.add_get("/info", handle_tgi_info)
        app.router.add_post("/", handle_tgi_compat)
        app.router.add_post("/generate", handle_tgi_generate)
        app.router.add_post("/generate_stream", handle_tgi_generate_stream)
    elif engine == "sglang":
        app.router.add_post("/generate", handle_sglang_generate)
        app.router.add_get("/get_server_info", handle_sglang_server_info)
        app.router.add_get("/server_info", handle_sglang_server_info)
        app.router.add_get("/get_model_info", handle_sglang_model_info)
        app.router.add_get("/health_generate", handle_sglang_health_generate)


def _tgi_json(payload: object, *, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    # serde_json writes compact JSON.
    body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
    return web.Response(body=body, status=status, content_type="application/json", headers=headers)


def _tgi_event(payload: object) -> bytes:
    """An axum SSE event carrying ``payload`` as compact JSON: ``data: {...}\\n\\n``."""
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


# ---------------------------------------------------------------------------------------------
# TGI
# ---------------------------------------------------------------------------------------------


async def handle_tgi_info(request: web.Request) -> web.Response:
    """``GET /info``."""
    replica = request.app[REPLICA]
    return _tgi_json(
        tgi.info_body(
            model_id=replica.model_name,
            max_concurrent_requests=replica.max_concurrent_requests or tgi.DEFAULT_MAX_CONCURRENT_REQUESTS,
            max_input_tokens=replica.max_model_len - 1,
            max_total_tokens=replica.max_model_len,
        )
    )


class _Rejected(Exception):
    """What axum's ``Json`` extractor answers before the handler runs: plain text, no counting."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.response = web.Response(status=status, text=text, content_type="text/plain")


async def _tgi_body(request: web.Request) -> dict[str, Any]:
    """The JSON body as axum's ``Json<GenerateRequest>`` accepts it: 400 for text that is not
    JSON, 422 for JSON without a string ``inputs`` (both plain text, as axum words them)."""
    raw = await request.read()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _Rejected(400, f"Failed to parse the request body as JSON: {exc}") from None
    if not isinstance(body, dict) or not isinstance(body.get("inputs"), str):
        raise _Rejected(
            422, "Failed to deserialize the JSON body into the target type: missing field `inputs`"
        )
    return body


def _validate(replica: Replica, body: dict[str, Any], started: float) -> tgi.GenerateRequest:
    """TGI's validation of a native body; counts a failure as ``err="validation"``."""
    inputs = body["inputs"]
    prompt_tokens = tokens.count_completion_prompt(inputs) if inputs else 0
    try:
        req = tgi.parse_generate(
            body,
            prompt_tokens=prompt_tokens,
            max_input_tokens=replica.max_model_len - 1,
            max_total_tokens=replica.max_model_len,
        )
    except tgi.TgiError:
        replica.metrics.record_rejected("validation")
        raise
    replica.metrics.record_admitted(
        req.prompt_tokens, req.max_new_tokens, asyncio.get_running_loop().time() - started
    )
    return req


def _submit(replica: Replica, req: tgi.GenerateRequest, request: web.Request) -> tuple[str, Inflight, int]:
    """Add a native request to the engine: (its id, its in-flight entry, its text seed)."""
    request_id = f"tgi-{random_id()}"
    seed = tokens.text_seed(req.inputs)
    generation = GenerationRequest(
        kind="completion",
        model=replica.model_name,
        prompt_tokens=req.prompt_tokens,
        max_tokens=req.max_new_tokens,
        ignore_eos=False,
        min_tokens=0,
        stream=False,
        include_usage=False,
        continuous_usage_stats=False,
        text_seed=seed,
        prompt_token_ids=tuple(tokens.completion_prompt_ids(req.inputs)),
    )
    return request_id, replica.submit(request_id, generation, request), seed


def _tokens(seed: int, start: int, count: int) -> list[dict[str, Any]]:
    out = []
    for i in range(start, start + count):
        word = tokens.fake_word(seed, i)
        out.append(tgi.token(tokens.fake_token_ids(word)[0], word))
    return out


async def handle_tgi_compat(request: web.Request) -> web.StreamResponse:
    """``POST /``: TGI's compat route, ``/generate`` or ``/generate_stream`` by the body's ``stream``."""
    try:
        body = await _tgi_body(request)
    except _Rejected as rejected:
        return rejected.response
    # aiohttp keeps the body read: the handler below reads the same bytes again.
    if body.get("stream") is True:
        return await handle_tgi_generate_stream(request)
    return await handle_tgi_generate(request)


async def handle_tgi_generate(request: web.Request) -> web.Response:
    """``POST /generate``: the whole generation in one body, with TGI's timing headers."""
    replica = request.app[REPLICA]
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        body = await _tgi_body(request)
    except _Rejected as rejected:
        return rejected.response
    try:
        replica.metrics.record_request()
        if not replica.try_acquire():
            replica.metrics.record_rejected("overloaded")
            raise tgi.overloaded()
        try:
            req = _validate(replica, body, started)
            queued = loop.time()
            request_id, entry, seed = _submit(replica, req, request)
            try:
                while True:
                    last = (await next_events(entry))[-1]
                    if last.finished:
                        break
            finally:
                replica.release(request_id)
        finally:
            replica.release_permit()
    except tgi.TgiError as err:
        return _tgi_json(err.body(), status=err.status)
    if last.finish_reason == "abort":
        if replica.dead is not None:
            failed = tgi.TgiError("Request failed during generation", error_type="generation", status=424)
            return _tgi_json(failed.body(), status=failed.status)
        return web.Response(status=499)  # the client is gone: nobody reads this
    n = last.num_output_tokens
    generated = _tokens(seed, 0, n)
    text = "".join(t["text"] for t in generated)
    if req.return_full_text:
        text = req.inputs + text
    reason = tgi.finish_reason(last.finish_reason)
    total = loop.time() - started
    stats = entry.stats
    queue_s = stats.queue_s if stats is not None else 0.0
    inference_s = stats.inference_s if stats is not None else total
    headers = {
        "x-compute-type": tgi.COMPUTE_TYPE,
        "x-compute-time": repr(total),
        "x-compute-characters": str(len(req.inputs)),
        "x-total-time": str(int(total * 1000)),
        "x-validation-time": str(int((queued - started) * 1000)),
        "x-queue-time": str(int(queue_s * 1000)),
        "x-inference-time": str(int(inference_s * 1000)),
        "x-time-per-token": str(int(inference_s / max(n, 1) * 1000)),
        "x-prompt-tokens": str(req.prompt_tokens),
        "x-generated-tokens": str(n),
    }
    payload = tgi.generate_body(
        text, details=req.details or req.decoder_input_details, reason=reason, tokens=generated, seed=req.seed
    )
    return _tgi_json(payload, headers=headers)


async def handle_tgi_generate_stream(request: web.Request) -> web.StreamResponse:
    """``POST /generate_stream``: SSE, one event per token; errors after the 200 are events."""
    replica = request.app[REPLICA]
    started = asyncio.get_running_loop().time()
    try:
        body = await _tgi_body(request)
    except _Rejected as rejected:
        return rejected.response
    replica.metrics.record_request()
    characters = len(body["inputs"])
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "x-compute-type": tgi.COMPUTE_TYPE,
            "x-compute-characters": str(characters),
            "X-Accel-Buffering": "no",
        }
    )
    await response.prepare(request)
    if not replica.try_acquire():
        replica.metrics.record_rejected("overloaded")
        await response.write(_tgi_event(tgi.OVERLOADED_BODY))
        await response.write_eof()
        return response
    try:
        await _stream_tokens(request, replica, response, body, started)
    except ConnectionError:
        pass  # the client left; releasing the request aborts it in the engine
    finally:
        replica.release_permit()
    return response


async def _stream_tokens(
    request: web.Request, replica: Replica, response: web.StreamResponse, body: dict[str, Any], started: float
) -> None:
    try:
        req = _validate(replica, body, started)
    except tgi.TgiError as err:
        await response.write(_tgi_event(err.body()))
        await response.write_eof()
        return
    request_id, entry, seed = _submit(replica, req, request)
    try:
        sent = 0
        while True:
            events = await next_events(entry)
            last = events[-1]
            if last.finish_reason == "abort":
                if replica.dead is not None:
                    failed = {"error": "Request failed during generation", "error_type": "generation"}
                    await response.write(_tgi_event(failed))
                return
            new = _tokens(seed, sent, last.num_output_tokens - sent)
            for i, tok in enumerate(new):
                index = sent + i + 1
                final = last.finished and i == len(new) - 1
                if not final:
                    await response.write(_tgi_event(tgi.stream_event(index, tok)))
                    continue
                text = tokens.fake_text(seed, 0, last.num_output_tokens)
                if req.return_full_text:
                    text = req.inputs + text
                details = (
                    tgi.stream_details(
                        tgi.finish_reason(last.finish_reason),
                        last.num_output_tokens,
                        req.seed,
                        req.prompt_tokens,
                    )
                    if req.details
                    else None
                )
                await response.write(
                    _tgi_event(tgi.stream_event(index, tok, generated_text=text, details=details))
                )
            sent = last.num_output_tokens
            if last.finished:
                await response.write_eof()
                return
    finally:
        replica.release(request_id)


# ---------------------------------------------------------------------------------------------
# SGLang
# ---------------------------------------------------------------------------------------------


async def handle_sglang_server_info(request: web.Request) -> web.Response:
    """``GET /get_server_info`` (``/server_info``): server arguments and scheduler state."""
    replica = request.app[REPLICA]
    profile = replica.profile
    metrics = replica.metrics
    throughput = metrics.last_gen_throughput if isinstance(metrics, sglang.SglangMetrics) else 0.0
    body = sglang.server_info_body(
        model_path=replica.model_name,
        served_model_name=replica.model_name,
        max_running_requests=profile.engine.max_num_seqs,
        chunked_prefill_size=profile.engine.max_num_batched_tokens,
        page_size=profile.engine.block_size,
        context_length=replica.max_model_len,
        tp_size=profile.tensor_parallel,
        kv_capacity_tokens=profile.kv_cache_size_tokens,
        last_gen_throughput=throughput,
    )
    return web.json_response(body)


async def handle_sglang_model_info(request: web.Request) -> web.Response:
    """``GET /get_model_info``."""
    return web.json_response(sglang.model_info_body(request.app[REPLICA].model_name))


async def handle_sglang_health_generate(request: web.Request) -> web.Response:
    """``GET /health_generate``: runs a one-token generation; 200 when it finished, 503 otherwise."""
    replica = request.app[REPLICA]
    if replica.dead is not None:
        return web.Response(status=503)
    request_id = f"health-{random_id()}"
    generation = GenerationRequest(
        kind="completion",
        model=replica.model_name,
        prompt_tokens=2,
        max_tokens=1,
        ignore_eos=True,
        min_tokens=0,
        stream=False,
        include_usage=False,
        continuous_usage_stats=False,
        text_seed=int(time.time()),
    )
    entry = replica.submit(request_id, generation, request)
    try:
        while not (await next_events(entry))[-1].finished:
            pass
    finally:
        replica.release(request_id)
    return web.Response(status=200 if entry.stats is not None else 503)


#: SGLang's ``SamplingParams.max_new_tokens`` default.
SGLANG_DEFAULT_MAX_NEW_TOKENS = 128


def _sglang_finish(reason: str | None, completion_tokens: int) -> dict[str, Any] | None:
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": completion_tokens}
    return {"type": "stop", "matched": 2}  # the EOS token id of Llama-style tokenizers


def _sglang_out(
    text: str, rid: str, reason: str | None, prompt_tokens: int, n: int, cached: int
) -> dict[str, Any]:
    return {
        "text": text,
        "meta_info": {
            "id": rid,
            "finish_reason": _sglang_finish(reason, n),
            "prompt_tokens": prompt_tokens,
            "completion_tokens": n,
            "cached_tokens": cached,
        },
    }


async def handle_sglang_generate(request: web.Request) -> web.StreamResponse:
    """``POST /generate``: SGLang's native generation, whole or streamed (see the module doc)."""
    replica = request.app[REPLICA]
    try:
        body = json.loads(await request.read())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return web.json_response({"error": {"message": "Invalid JSON body"}}, status=400)
    if not isinstance(body, dict):
        body = {}
    text = body.get("text")
    params = body.get("sampling_params") or {}
    if not isinstance(text, str) or not text or not isinstance(params, dict):
        return web.json_response(
            {"error": {"message": "Either text or input_ids should be provided."}}, status=400
        )
    prompt_ids = tokens.completion_prompt_ids(text)
    prompt_tokens = len(prompt_ids)
    max_new = params.get("max_new_tokens", SGLANG_DEFAULT_MAX_NEW_TOKENS)
    room = replica.max_model_len - prompt_tokens
    if not isinstance(max_new, int) or max_new < 1 or room < 1:
        message = f"The input ({prompt_tokens} tokens) is longer than the model's context length"
        return web.json_response({"error": {"message": message}}, status=400)
    rid = str(body.get("rid") or random_id())
    seed = tokens.text_seed(text)
    generation = GenerationRequest(
        kind="completion",
        model=replica.model_name,
        prompt_tokens=prompt_tokens,
        max_tokens=min(max_new, room),
        ignore_eos=bool(params.get("ignore_eos", False)),
        min_tokens=0,
        stream=bool(body.get("stream")),
        include_usage=False,
        continuous_usage_stats=False,
        text_seed=seed,
        prompt_token_ids=tuple(prompt_ids),
    )
    entry = replica.submit(rid, generation, request)
    try:
        if not generation.stream:
            while not (last := (await next_events(entry))[-1]).finished:
                pass
            if last.finish_reason == "abort":
                return web.Response(status=499 if replica.dead is None else 500)
            n = last.num_output_tokens
            # SGLang answers with ORJSONResponse: compact JSON.
            out = _sglang_out(
                tokens.fake_text(seed, 0, n), rid, last.finish_reason, prompt_tokens, n, last.cached_tokens
            )
            return _tgi_json(out)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        try:
            while True:
                last = (await next_events(entry))[-1]
                if last.finish_reason == "abort":
                    return response
                n = last.num_output_tokens
                reason = last.finish_reason if last.finished else None
                text_so_far = tokens.fake_text(seed, 0, n)
                out = _sglang_out(text_so_far, rid, reason, prompt_tokens, n, last.cached_tokens)
                await response.write(b"data: " + json.dumps(out, separators=(",", ":")).encode() + b"\n\n")
                if last.finished:
                    break
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionError:
            pass  # the client left: releasing the request aborts it
        return response
    finally:
        replica.release(rid)
