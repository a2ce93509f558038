"""The HTTP face of an emulated replica: one aiohttp application serving vLLM's OpenAI API over
the emulated engine.

A client should not be able to tell this server from ``vllm serve`` (0.32) by its API: same
endpoints, JSON and SSE shapes, error bodies and ``/metrics`` names; only the model is fake.
``--engine tgi|sglang`` swaps ``/metrics``, the info endpoints and the native routes
(:mod:`simulator.native`); the OpenAI routes stay vLLM's. A client that goes away aborts its
request within about ``simulator.replica.DISCONNECT_POLL_S``. This module wires the routes
(:mod:`simulator.openai_handlers`, :mod:`simulator.info_handlers`) and renders errors; entry
points: :func:`build_app` (in-process) and :func:`simulator.cli.main` (``python -m simulator``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from simulator import native, tgi
from simulator.info_handlers import (
    handle_health,
    handle_load,
    handle_metrics,
    handle_models,
    handle_ping,
    handle_tokenize,
    handle_version,
)
from simulator.openai_bodies import json_response
from simulator.openai_errors import BodyParseError, error_body
from simulator.openai_handlers import handle_chat_completions, handle_completions
from simulator.profile import Profile
from simulator.replica import REPLICA, ApiError, EngineKind, Replica


def _error_response(err: ApiError) -> web.Response:
    body = error_body(err.message, status=err.status, err_type=err.err_type, param=err.param)
    return json_response(body, status=err.status)


@web.middleware
async def _errors_as_vllm(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
    """Render :class:`ApiError` as vLLM's JSON body; routing errors as FastAPI's ``{"detail"}``."""
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except ApiError as err:
        return _error_response(err)
    except BodyParseError as err:
        return json_response({"detail": str(err)}, status=400)
    except web.HTTPException as exc:
        if exc.status in (404, 405):
            return json_response({"detail": exc.reason}, status=exc.status)
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
    enable_prompt_tokens_details: bool = False,
) -> web.Application:
    """An aiohttp application serving one emulated replica of ``profile``.

    The engine task starts with the application (``cleanup_ctx``) and stops with it; in-flight
    requests are aborted at shutdown. ``seed`` makes output lengths and step-time jitter
    reproducible; ``jitter`` is the relative step-time noise passed to the engine. ``engine``
    picks whose ``/metrics``, info endpoint, native API and overload behaviour it shows (the
    OpenAI routes are vLLM's for all); ``max_concurrent_requests`` is TGI's permit limit
    (default 128, TGI's; ignored by the other engines); ``enable_prompt_tokens_details`` is
    vLLM's flag (``usage.prompt_tokens_details.cached_tokens``).
    """
    app = web.Application(middlewares=[_errors_as_vllm])
    limit = (max_concurrent_requests or tgi.DEFAULT_MAX_CONCURRENT_REQUESTS) if engine == "tgi" else None

    async def replica_ctx(app: web.Application) -> AsyncIterator[None]:
        replica = Replica(
            profile,
            seed=seed,
            jitter=jitter,
            engine_kind=engine,
            max_concurrent_requests=limit,
            enable_prompt_tokens_details=enable_prompt_tokens_details,
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
