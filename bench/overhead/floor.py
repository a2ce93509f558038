"""The floor: a pass-through proxy doing only the least of the work "everything on" means.

The bare proxy (``bench/overhead/bare.py``) plus, per ``POST /v1/...`` request, the cheapest form
of each feature the overhead bench turns on in Sluice, written with the libraries Sluice must use
(aiohttp, redis-py asyncio with hiredis, prometheus-client, the standard ``json`` and
``logging``):

* **API key**: the ``Authorization`` bearer's SHA-256 looked up in a set (401 otherwise);
* **Redis token bucket**: the JSON body parsed for its size and ``max_tokens``, one ``EVALSHA``
  of a ten-line token-bucket script awaited before the request goes upstream (429 when it is
  refused), and one more after the answer, not awaited, giving back what was not used
  (``usage`` read from the JSON answer, or from the one SSE event that carries it). The calls go
  over Sluice's pipelined connection (``gateway.limits.pipelined``: one write and one future
  per call), the cheapest way to Redis here; ``--redis-client redis-py`` makes them through
  redis-py's ``Script`` call instead, as a gateway written on redis-py alone would;
* **bad input**: a body that is not a JSON object or a ``max_tokens`` that is not a positive
  integer gets an OpenAI-style 400 before the bucket is touched; an upstream that cannot be
  reached a 502, with everything reserved given back (an answer that never told its ``usage``
  is charged the whole reservation);
* **metrics**: one labelled counter and one histogram per request, ``/metrics`` served;
* **access log**: one JSON line per request on stdout.

Left out, because they have no cheap form: predictions and the SLO admission (the step model,
the forecast of every request on every replica, queueing), prediction and rate-limit headers,
per-tenant request and concurrency buckets, settles that are tracked to the end, Redis
failover, the disconnect monitor. Sluice does all of these and more; what this proxy costs is
therefore a floor under what Sluice with everything on can cost, not a competitor to it. Its
row in the overhead table says how far the targets "keeps >= 50 % of a bare proxy's
throughput" and "adds <= 0.5 ms p50 at concurrency 1" are from what the stack itself allows.

Run: ``python -m bench.overhead.floor --port N --upstream URL --redis-url URL --key-sha256 HEX``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import math
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import redis.asyncio as redis
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from bench.overhead.bare import HOP, serve
from gateway.limits.pipelined import for_client

#: Tokens per minute of each key's bucket by default: the bench's load never runs it dry.
TOKENS_PER_MINUTE = 1.0e12
#: The bucket's capacity by default, in tokens.
CAPACITY = 1.0e12

#: KEYS[1]: the bucket; ARGV: now (ms), refill per ms, capacity, cost. 1: taken; 0: refused.
RESERVE = """
local b = redis.call('HMGET', KEYS[1], 'level', 'at')
local now, rate, cap, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local level = tonumber(b[1]) or cap
local at = tonumber(b[2]) or now
level = math.min(cap, level + math.max(0, now - at) * rate)
if level < cost then return 0 end
redis.call('HSET', KEYS[1], 'level', level - cost, 'at', now)
redis.call('PEXPIRE', KEYS[1], 120000)
return 1
"""
#: KEYS[1]: the bucket; ARGV[1]: tokens given back (reserved minus used).
SETTLE = """
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HINCRBYFLOAT', KEYS[1], 'level', ARGV[1]) end
return 1
"""


#: Output tokens a request without ``max_tokens`` reserves up front.
DEFAULT_MAX_TOKENS = 256


def _error(status: int, message: str, kind: str, param: str | None = None) -> web.Response:
    """An OpenAI-style error answer."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return web.json_response(body, status=status)


def _is_count(value: Any) -> bool:
    """A whole number of tokens (an ``int``, not a ``bool``), zero or more."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def request_cost(body: bytes) -> int | web.Response:
    """Tokens a request reserves up front (its body's bytes / 4 plus its ``max_tokens``,
    ``DEFAULT_MAX_TOKENS`` without one), or the 400 for a body that is not a JSON object or a
    ``max_tokens`` that is not a positive integer (a negative one would fill the bucket)."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return _error(400, "The body is not JSON.", "invalid_request_error")
    if not isinstance(parsed, dict):
        return _error(400, "The body must be a JSON object.", "invalid_request_error")
    cap = parsed.get("max_tokens")
    if cap is None:
        return len(body) // 4 + DEFAULT_MAX_TOKENS
    if not _is_count(cap) or cap < 1:
        return _error(400, "`max_tokens` must be a positive integer.", "invalid_request_error", "max_tokens")
    return len(body) // 4 + int(cap)


def _usage_tokens(payload: Any) -> int | None:
    usage = payload.get("usage") if isinstance(payload, dict) else None
    if isinstance(usage, dict) and _is_count(usage.get("total_tokens")):
        return int(usage["total_tokens"])
    return None


def _stream_usage(chunk: bytes) -> int | None:
    """``usage.total_tokens`` of the SSE event in ``chunk`` that carries it, if any."""
    if b'"usage"' not in chunk:
        return None
    for line in chunk.split(b"\n"):
        if line.startswith(b"data: {") and b'"usage"' in line:
            try:
                found = _usage_tokens(json.loads(line[6:]))
            except ValueError:
                continue
            if found is not None:
                return found
    return None


def build_app(
    upstream: str,
    redis_url: str,
    key_digests: frozenset[str],
    *,
    pipelined: bool = True,
    tokens_per_minute: float = TOKENS_PER_MINUTE,
    capacity: float = CAPACITY,
) -> web.Application:
    """The floor proxy in front of ``upstream`` (a base URL without trailing slash).

    ``pipelined``: the script calls go over Sluice's pipelined connection
    (``gateway.limits.pipelined``, the cheapest way to Redis here); else through redis-py's
    ``Script`` call, the way a gateway written on redis-py alone would make them.
    ``tokens_per_minute``, ``capacity``: every key's bucket (refill rate, size in tokens); a
    request costs its body's bytes / 4 plus its ``max_tokens`` (256 without one) up front, and is
    charged its answer's ``usage.total_tokens`` in the end (the whole cost when it has none)."""
    session_key = web.AppKey("session", aiohttp.ClientSession)
    registry = CollectorRegistry()
    requests = Counter("floor_requests", "Requests answered.", ["tenant", "status"], registry=registry)
    latency = Histogram("floor_request_duration_seconds", "Time to answer.", registry=registry)
    access = logging.getLogger("floor.access")
    pending: set[asyncio.Task[Any]] = set()
    rate = tokens_per_minute / 60_000.0
    client = redis.Redis.from_url(redis_url)  # connects on first use
    reserve_script = client.register_script(RESERVE)  # EVALSHA, loading the script on NOSCRIPT
    settle_script = client.register_script(SETTLE)
    fast = for_client(client, stale_after_s=math.inf) if pipelined else None
    if pipelined and fast is None:
        raise SystemExit(f"{redis_url}: not a plain TCP Redis; run with --redis-client redis-py")

    async def reserve(*, keys: list[str], args: list[float]) -> Any:
        if fast is not None:
            return await fast.evalsha(reserve_script, keys, args)
        return await reserve_script(keys=keys, args=args)

    async def settle(*, keys: list[str], args: list[float]) -> Any:
        if fast is not None:
            return await fast.evalsha(settle_script, keys, args)
        return await settle_script(keys=keys, args=args)

    async def resources(app: web.Application) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None)
        async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
            app[session_key] = session
            yield
            if pending:
                await asyncio.wait(pending, timeout=5.0)
        if fast is not None:
            await fast.close()
        await client.aclose()

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def forward(request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        status, used, tenant = 0, None, "-"
        try:
            response, status, used, tenant = await _serve(request, body, headers)
            return response
        finally:
            took = time.perf_counter() - started
            requests.labels(tenant, str(status)).inc()
            latency.observe(took)
            line = {"path": request.path, "tenant": tenant, "status": status, "tokens": used, "s": took}
            access.info(json.dumps(line))

    async def _serve(
        request: web.Request, body: bytes, headers: dict[str, str]
    ) -> tuple[web.StreamResponse, int, int | None, str]:
        if request.method != "POST" or not request.path.startswith("/v1/"):
            response = await _relay(request, body, headers, None)
            return response, response.status, None, "-"
        token = request.headers.get("Authorization", "").removeprefix("Bearer ")
        tenant = hashlib.sha256(token.encode()).hexdigest()
        if tenant not in key_digests:
            return _error(401, "Invalid API key.", "invalid_request_error"), 401, None, "-"
        cost = request_cost(body)
        if isinstance(cost, web.Response):
            return cost, cost.status, None, tenant
        bucket = "floor:" + tenant
        taken = await reserve(keys=[bucket], args=[time.time() * 1000.0, rate, capacity, cost])
        if not taken:
            return _error(429, "Rate limit reached.", "rate_limit_error"), 429, None, tenant
        used: list[int] = []
        reached: list[bool] = []
        try:
            response = await _relay(request, body, headers, used, reached)
        finally:
            # Charged the answer's usage; everything back when no replica answered; the whole
            # cost when one did but its usage never came (a client gone mid-stream).
            back = cost - (used[0] if used else cost) if reached else cost
            task = asyncio.get_running_loop().create_task(settle(keys=[bucket], args=[back]))
            pending.add(task)
            task.add_done_callback(pending.discard)
        return response, response.status, used[0] if used else None, tenant

    async def _relay(
        request: web.Request,
        body: bytes,
        headers: dict[str, str],
        used: list[int] | None,
        reached: list[bool] | None = None,
    ) -> web.StreamResponse:
        """The upstream's answer, relayed; ``used`` gets its ``usage.total_tokens`` (when it has
        one), ``reached`` a mark once the upstream answered. A 502 when it could not be reached."""
        try:
            up = await request.app[session_key].request(
                request.method, upstream + request.path_qs, data=body, headers=headers
            )
        except (aiohttp.ClientError, TimeoutError):
            return _error(502, "The upstream could not be reached.", "upstream_error")
        if reached is not None:
            reached.append(True)
        async with up:
            out_headers = {k: v for k, v in up.headers.items() if k.lower() not in HOP}
            if up.content_length is not None:
                try:
                    answer = await up.read()
                except (aiohttp.ClientError, TimeoutError):
                    return _error(502, "The upstream's answer broke off.", "upstream_error")
                if used is not None:
                    try:
                        found = _usage_tokens(json.loads(answer))
                    except ValueError:
                        found = None
                    if found is not None:
                        used.append(found)
                return web.Response(status=up.status, body=answer, headers=out_headers)
            resp = web.StreamResponse(status=up.status, headers=out_headers)
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                if used is not None and not used and (found := _stream_usage(chunk)) is not None:
                    used.append(found)
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    app = web.Application()
    app.cleanup_ctx.append(resources)
    app.router.add_get("/metrics", metrics)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="the floor: a bare proxy with the least of Sluice's work")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--redis-url", required=True, help="e.g. redis://127.0.0.1:6390/0")
    parser.add_argument("--key-sha256", action="append", required=True, help="hex SHA-256 of an API key")
    parser.add_argument(
        "--redis-client",
        choices=("pipelined", "redis-py"),
        default="pipelined",
        help="Sluice's pipelined script calls (default) or redis-py's Script call",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(message)s")
    app = build_app(
        args.upstream.rstrip("/"),
        args.redis_url,
        frozenset(args.key_sha256),
        pipelined=args.redis_client == "pipelined",
    )
    serve(app, args.host, args.port)


if __name__ == "__main__":
    main()
