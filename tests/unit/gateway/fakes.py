"""Tiny real HTTP replicas for the gateway tests, and a helper to run the gateway in front of them.

These are fakes on purpose: they produce faults on demand (a refused connection, a stream cut
after two events, a body cut mid-way, a 400 or 500 answer, a slow token every 20 ms) that the
replica emulator cannot be told to produce. They speak real HTTP on free ports.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.app import build_app
from gateway.config.settings import ServerSettings, Settings
from gateway.config.store import SettingsStore
from gateway.keys import OUTCOME_LISTENERS
from gateway.observability.outcome import RequestOutcome
from gateway.replicas.config import HardwareSettings, HealthSettings, ReplicaSettings, ScrapeSettings

MODEL = "test-model"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def chat_chunk(content: str, *, finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "model": MODEL,
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}],
    }


def usage_chunk(prompt: int, completion: int) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "model": MODEL,
        "choices": [],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n".encode()


def stream_bytes(words: list[str], *, include_usage: bool, prompt_tokens: int = 5) -> bytes:
    """The SSE body a vLLM chat stream has: role chunk, one chunk per word, finish, usage, [DONE]."""
    role = {
        **chat_chunk(""),
        "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}],
    }
    parts = [sse(role)] + [sse(chat_chunk(w)) for w in words] + [sse(chat_chunk("", finish="stop"))]
    if include_usage:
        parts.append(sse(usage_chunk(prompt_tokens, len(words))))
    parts.append(sse("[DONE]"))
    return b"".join(parts)


@dataclass
class Seen:
    """One request a fake replica received."""

    path: str
    headers: dict[str, str]  # lower-case names
    body: dict[str, Any]


@dataclass
class FakeReplica:
    """A replica whose health, model list and completion handler a test controls at run time."""

    models: list[dict[str, Any]] = field(
        default_factory=lambda: [{"id": MODEL, "object": "model", "max_model_len": 4096}]
    )
    health_status: int = 200
    #: Handles both completion routes; default: ``default_completion``.
    handler: Handler | None = None
    seen: list[Seen] = field(default_factory=list)
    #: Split the default stream into writes of this many bytes (to cut events anywhere).
    write_size: int | None = None
    #: The ``/metrics`` body; ``None`` answers 404 (the gateway's scraper then marks it stale).
    metrics_text: str | None = None
    #: When set, ``/metrics`` waits for it before answering (a replica too slow to scrape).
    metrics_gate: asyncio.Event | None = None
    metrics_scrapes: int = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_post("/v1/completions", self._complete)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.health_status)

    async def _metrics(self, request: web.Request) -> web.Response:
        self.metrics_scrapes += 1
        if self.metrics_gate is not None:
            await self.metrics_gate.wait()
        if self.metrics_text is None:
            return web.Response(status=404, text="no metrics here")
        return web.Response(text=self.metrics_text, content_type="text/plain")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": self.models})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(Seen(request.path, {k.lower(): v for k, v in request.headers.items()}, body))
        handler = self.handler or self.default_completion
        return await handler(request)

    async def default_completion(self, request: web.Request) -> web.StreamResponse:
        """A 3-word answer; streamed (with usage when asked) or one JSON body."""
        body = self.seen[-1].body
        words = ["Hello", " there", "!"]
        if not body.get("stream"):
            return web.json_response(
                {
                    "id": "chatcmpl-1",
                    "object": "chat.completion",
                    "model": MODEL,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(words)}}],
                    "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
                }
            )
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        payload = stream_bytes(words, include_usage=include_usage, prompt_tokens=7)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        step = self.write_size or len(payload)
        for start in range(0, len(payload), step):
            await response.write(payload[start : start + step])
        await response.write_eof()
        return response


#: What an operator would write for an H100 serving Llama-3-8B: enough for a roofline forecast
#: before the first scrape.
H100_LLAMA3_8B = HardwareSettings(
    gpu="H100-SXM", model="Llama-3-8B", max_num_seqs=256, max_num_batched_tokens=8192
)


def gateway_settings(
    replicas: dict[str, str],
    *,
    health: HealthSettings | None = None,
    server: ServerSettings | None = None,
    hardware: HardwareSettings | None = None,
    scrape: ScrapeSettings | None = None,
) -> Settings:
    """Settings for a gateway in front of ``replicas`` (name -> URL); health checks effectively
    only at startup (tests run further rounds themselves with ``app[HEALTH].check_all()``).
    ``hardware`` applies to every replica (default: nothing known)."""
    return Settings(
        replicas=[
            ReplicaSettings(name=name, url=url, hardware=hardware or HardwareSettings())
            for name, url in replicas.items()
        ],
        health=health or HealthSettings(interval_s=300.0, timeout_s=2.0, unhealthy_after=2, healthy_after=1),
        server=server or ServerSettings(port=0),
        scrape=scrape or ScrapeSettings(),
    )


@dataclass
class Gateway:
    """A running gateway app with its test client, store, and the outcomes it reported."""

    client: TestClient[web.Request, web.Application]
    app: web.Application
    store: SettingsStore
    outcomes: list[RequestOutcome]


async def url_of(server: TestServer) -> str:
    return str(server.make_url("")).rstrip("/")


def now() -> float:
    return time.monotonic()


async def wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll ``predicate`` on the event loop (no wall-clock sleep beyond yielding) until true."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


def make_app(settings: Settings) -> tuple[web.Application, SettingsStore, list[RequestOutcome]]:
    store = SettingsStore(settings)
    app = build_app(store, spawn_emulators=False)
    outcomes: list[RequestOutcome] = []
    app[OUTCOME_LISTENERS].append(outcomes.append)
    return app, store, outcomes
