"""The fake OpenAI backend every configuration of the overhead bench talks to: instant answers.

A tiny aiohttp server that looks enough like vLLM for every proxy in the bench, Sluice included:

* ``GET /health``: 200, empty (vLLM's liveness probe; Sluice's health checker and vllm-router's);
* ``GET /v1/models``: one model card with ``max_model_len`` (Sluice routes by it);
* ``GET /metrics``: a vLLM V1 exposition (``vllm:num_requests_running``/``waiting``, KV usage,
  ``vllm:cache_config_info``, token and request counters, TTFT, inter-token latency and e2e
  histograms) kept up to date by the requests it served, so Sluice's scraper and step model see a
  live, healthy replica;
* ``POST /v1/chat/completions`` and ``POST /v1/completions``: ``max_tokens`` (default 16) tokens
  of canned text. Not streamed: answered at once (no model time), JSON with ``usage``. Streamed:
  one SSE event per token, each after ``token_delay_s`` (the first one too: a "prefill" of one
  token time), then a ``finish_reason`` event, the usage event when the request asked for it
  (``stream_options.include_usage``, as Sluice always does), and ``data: [DONE]``.

Run it as its own process: ``python -m bench.overhead.backend --port N [--token-delay-ms 5]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

MODEL = "bench-model"
MAX_MODEL_LEN = 8192
#: Pretend KV capacity (tokens) reported in ``vllm:cache_config_info``: 16-token blocks.
KV_BLOCKS, BLOCK_SIZE = 8192, 16
TOKEN_TEXT = "tok "
#: Histogram bucket bounds (seconds) of the latency histograms in ``/metrics``.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class _Histogram:
    """A cumulative Prometheus histogram over ``LATENCY_BUCKETS`` (seconds)."""

    counts: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS))
    total: float = 0.0
    n: int = 0

    def observe(self, value_s: float, times: int = 1) -> None:
        for i, bound in enumerate(LATENCY_BUCKETS):
            if value_s <= bound:
                self.counts[i] += times
        self.total += value_s * times
        self.n += times

    def render(self, name: str, labels: str) -> list[str]:
        lines = [f"# TYPE {name} histogram"]
        lines += [
            f'{name}_bucket{{{labels},le="{bound}"}} {count}'
            for bound, count in zip(LATENCY_BUCKETS, self.counts, strict=True)
        ]
        lines += [
            f'{name}_bucket{{{labels},le="+Inf"}} {self.n}',
            f"{name}_sum{{{labels}}} {self.total}",
            f"{name}_count{{{labels}}} {self.n}",
        ]
        return lines


@dataclass
class BackendState:
    """What ``/metrics`` reports: requests running now, and counters since start."""

    running: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: int = 0
    ttft: _Histogram = field(default_factory=_Histogram)
    itl: _Histogram = field(default_factory=_Histogram)
    e2e: _Histogram = field(default_factory=_Histogram)

    def exposition(self) -> str:
        labels = f'engine="0",model_name="{MODEL}"'
        lines = [
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {self.running}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} 0",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{labels}}} {min(1.0, self.running * 64 / (KV_BLOCKS * BLOCK_SIZE))}",
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="{BLOCK_SIZE}",engine="0",'
            f'num_gpu_blocks="{KV_BLOCKS}"}} 1.0',
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{{{labels}}} {self.prompt_tokens}",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{labels}}} {self.generation_tokens}",
            "# TYPE vllm:request_success_total counter",
            f'vllm:request_success_total{{{labels},finished_reason="length"}} {self.finished}',
            *self.ttft.render("vllm:time_to_first_token_seconds", labels),
            *self.itl.render("vllm:inter_token_latency_seconds", labels),
            *self.e2e.render("vllm:e2e_request_latency_seconds", labels),
        ]
        return "\n".join(lines) + "\n"


def _prompt_tokens(body: dict[str, Any]) -> int:
    """A rough token count of the prompt: one token per four characters, at least one."""
    if "messages" in body:
        text = "".join(str(m.get("content", "")) for m in body["messages"] if isinstance(m, dict))
    else:
        text = str(body.get("prompt", ""))
    return max(1, len(text) // 4)


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def build_app(token_delay_s: float) -> web.Application:
    """The backend; streamed answers send one token per ``token_delay_s`` seconds."""
    state = BackendState()

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    async def models(request: web.Request) -> web.Response:
        card = {"id": MODEL, "object": "model", "owned_by": "bench", "max_model_len": MAX_MODEL_LEN}
        return web.json_response({"object": "list", "data": [card]})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=state.exposition(), content_type="text/plain", charset="utf-8")

    async def complete(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        chat = request.path.endswith("/chat/completions")
        n = int(body.get("max_tokens") or 16)
        prompt = _prompt_tokens(body)
        started = time.perf_counter()
        state.running += 1
        state.prompt_tokens += prompt
        try:
            if body.get("stream"):
                return await _stream(request, body, chat, n, prompt, started)
            text = TOKEN_TEXT * n
            choice: dict[str, Any] = (
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                if chat
                else {"index": 0, "text": text, "finish_reason": "length"}
            )
            state.generation_tokens += n
            state.finished += 1
            state.ttft.observe(time.perf_counter() - started)
            state.e2e.observe(time.perf_counter() - started)
            return web.json_response(
                {
                    "id": "cmpl-bench",
                    "object": "chat.completion" if chat else "text_completion",
                    "created": int(time.time()),
                    "model": MODEL,
                    "choices": [choice],
                    "usage": _usage(prompt, n),
                }
            )
        finally:
            state.running -= 1

    async def _stream(
        request: web.Request, body: dict[str, Any], chat: bool, n: int, prompt: int, started: float
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream", "cache-control": "no-cache"})
        await resp.prepare(request)
        kind = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())

        def event(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
            data: dict[str, Any] = {
                "id": "cmpl-bench",
                "object": kind,
                "created": created,
                "model": MODEL,
                "choices": choices,
            }
            if usage is not None:
                data["usage"] = usage
            return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"

        for i in range(n):
            await asyncio.sleep(token_delay_s)
            if chat:
                delta: dict[str, Any] = (
                    {"content": TOKEN_TEXT} if i else {"role": "assistant", "content": TOKEN_TEXT}
                )
                await resp.write(event([{"index": 0, "delta": delta, "finish_reason": None}]))
            else:
                await resp.write(event([{"index": 0, "text": TOKEN_TEXT, "finish_reason": None}]))
            state.generation_tokens += 1
            if i == 0:
                state.ttft.observe(time.perf_counter() - started)
        end_choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if chat:
            end_choice["delta"] = {}
        else:
            end_choice["text"] = ""
        await resp.write(event([end_choice]))
        options = body.get("stream_options") or {}
        if isinstance(options, dict) and options.get("include_usage"):
            await resp.write(event([], _usage(prompt, n)))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        state.finished += 1
        if n > 1:
            state.itl.observe(token_delay_s, n - 1)
        state.e2e.observe(time.perf_counter() - started)
        return resp

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/chat/completions", complete)
    app.router.add_post("/v1/completions", complete)
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="the overhead bench's fake OpenAI backend")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token-delay-ms", type=float, default=5.0, help="time per streamed token (ms)")
    args = parser.parse_args(argv)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        loop_factory = None
    else:
        loop_factory = uvloop.new_event_loop
    web.run_app(
        build_app(args.token_delay_ms / 1000.0),
        host=args.host,
        port=args.port,
        access_log=None,
        print=None,
        loop=loop_factory() if loop_factory else None,
    )


if __name__ == "__main__":
    main()
