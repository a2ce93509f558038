"""The emulator's endpoints beside generation: ``/v1/models``, ``/health`` and ``/ping``,
``/version``, ``/load``, ``/metrics`` and ``/tokenize``, answered as vLLM 0.32 answers them
(TGI's shapes for ``/v1/models`` and an unhealthy ``/health`` under ``--engine tgi``).

Each reads the application's ``Replica`` (``simulator.replica.REPLICA``); none changes it.
"""

from __future__ import annotations

from aiohttp import web

from simulator import tgi, tokens
from simulator.metrics import CONTENT_TYPE
from simulator.openai_bodies import json_response
from simulator.openai_requests import check_content_type, parse_json_body, validate_model
from simulator.replica import REPLICA, VLLM_VERSION, ApiError, random_id


async def handle_models(request: web.Request) -> web.Response:
    """``GET /v1/models``: vLLM's ``ModelList`` with the one served model (TGI's own shape, with
    no ``max_model_len``, when imitating TGI)."""
    replica = request.app[REPLICA]
    if replica.engine_kind == "tgi":
        return json_response(tgi.models_body(replica.model_name))
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
    return json_response({"object": "list", "data": [card]})


async def handle_health(request: web.Request) -> web.Response:
    """``GET /health``: 200 with an empty body; 503 once the engine has died (vLLM: empty body,
    TGI: ``{"error": "unhealthy", "error_type": "healthcheck"}``)."""
    replica = request.app[REPLICA]
    if replica.dead is None:
        return web.Response(status=200)
    if replica.engine_kind == "tgi":
        return json_response({"error": "unhealthy", "error_type": "healthcheck"}, status=503)
    return web.Response(status=503)


async def handle_version(request: web.Request) -> web.Response:
    """``GET /version``: the vLLM version whose API this emulator reproduces."""
    return json_response({"version": VLLM_VERSION})


async def handle_load(request: web.Request) -> web.Response:
    """``GET /load``: requests in flight (vLLM's ``--enable-server-load-tracking`` answer)."""
    return json_response({"server_load": request.app[REPLICA].num_inflight})


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

    Token ids are stable fakes (one per counted token), the ids the prefix cache hashes, so
    ``count`` always equals what a request with the same input reports as ``usage.prompt_tokens``.
    """
    replica = request.app[REPLICA]
    check_content_type(request.headers.get("Content-Type"))
    body = parse_json_body(await request.read())
    validate_model(body.get("model"), replica.model_name)
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ApiError("messages: Input should be a valid list of messages", param="messages")
        ids = tokens.chat_prompt_ids(messages)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise ApiError("prompt: Input should be a valid string", param="prompt")
        ids = tokens.completion_prompt_ids(prompt)
    count = len(ids)
    return json_response(
        {"count": count, "max_model_len": replica.max_model_len, "tokens": ids, "token_strs": None},
    )
