"""What tenancy costs a request through the whole gateway: off, memory limiter, Redis limiter, one run.

Three gateways run side by side in this process, built by ``gateway.app.build_app`` exactly as
``sluice serve`` builds them, each in front of the same instant fake replica (a JSON answer with
usage, no model time), so what differs between them is the tenancy layer alone:

* ``off``: no tenant configured (tenancy off: the middleware passes requests through);
* ``memory``: one tenant with a key and budgets the load never reaches, ``limits.backend: memory``;
* ``redis``: the same tenant on ``limits.backend: redis`` (failover policy and over-limit cache
  included, as shipped) against a real ``redis-server`` this script starts (or ``--redis-url``);
  with ``--cluster``, also ``cluster``: a three-master Redis Cluster.

Measured, per gateway:

* added latency: ``--requests`` sequential requests, interleaved round-robin across the gateways
  (so load drift hits all alike), p50 and p99 client latency in ms; "added" is the p50 minus
  ``off``'s p50, in microseconds: key hashing, body parse, one reserve (the request waits for it)
  and the bookkeeping around the settle (which runs after the answer, off the request's path);
* admission throughput: ``--concurrency`` clients for ``--seconds`` seconds per gateway, in ten
  short bursts taken in turn across the gateways, answered requests per second (client,
  gateways and replica share one process and CPU here, so compare the rows, not the absolute
  number).

Admission is ``admit_all`` everywhere (the SLO admitter is the same for all rows and is measured by
``bench/admission_cost.py``). Numbers depend on the machine; nothing here asserts a speed.
Run: ``.venv/bin/python -m bench.tenancy_cost``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np
from aiohttp import web

from bench.limiter_cost import new_loop_factory
from gateway.app import build_app
from gateway.config.settings import Settings
from gateway.config.store import SettingsStore
from gateway.tenants import hash_api_key
from tests.support.redis import redis_cluster, redis_server

MODEL = "bench-model"
KEY = "sk-bench-tenant-0d9f2a"
BODY: dict[str, Any] = {"model": MODEL, "prompt": "Say hello to the benchmark. " * 8, "max_tokens": 16}
ANSWER: dict[str, Any] = {
    "id": "cmpl-bench",
    "object": "text_completion",
    "model": MODEL,
    "choices": [{"index": 0, "text": "hello " * 12, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 48, "completion_tokens": 12, "total_tokens": 60},
}
#: Budgets the benchmark never reaches: every request is admitted.
ROOMY = {"tokens_per_minute": 1.0e12, "requests_per_minute": 1.0e9, "max_concurrent": 100_000}


def replica_app() -> web.Application:
    """An instant OpenAI-compatible replica: health, model list, one canned completion."""

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def complete(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response(ANSWER)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", complete)
    return app


def gateway_settings(replica_url: str, limits: dict[str, Any] | None) -> Settings:
    """A gateway in front of ``replica_url``; ``limits`` None: no tenant (tenancy off)."""
    data: dict[str, Any] = {
        "server": {"port": 0},
        "replicas": [{"name": "r", "url": replica_url}],
        "health": {"interval_s": 300.0, "timeout_s": 2.0},
        "logging": {"access_log": False},
        "admission": {"policy": "admit_all"},
    }
    if limits is not None:
        data["tenants"] = {"tenants": {"bench": {"api_keys": [hash_api_key(KEY)], "limits": ROOMY}}}
        data["limits"] = {**limits, "token_weights": {"prompt": 1.0, "output": 2.0}}
    return Settings.model_validate(data)


@contextlib.asynccontextmanager
async def serve(app: web.Application) -> AsyncIterator[str]:
    """Run ``app`` on a free port as ``run_app`` would; yields its base URL."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        await runner.cleanup()


@dataclass(frozen=True)
class Row:
    name: str
    p50_ms: float
    p99_ms: float
    added_us: float
    requests_per_s: float


async def timed_post(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> float:
    """Seconds for one completion request; raises when it is not answered 200."""
    start = time.perf_counter()
    async with session.post(url, json=BODY, headers=headers) as resp:
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}")
    return time.perf_counter() - start


async def burst(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str], concurrency: int, seconds: float
) -> tuple[int, float]:
    """(requests answered, seconds taken) by ``concurrency`` clients sending back to back."""
    stop_at = time.perf_counter() + seconds
    done = 0

    async def client() -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            await timed_post(session, url, headers)
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return done, time.perf_counter() - start


async def throughputs(
    session: aiohttp.ClientSession,
    urls: dict[str, str],
    headers: dict[str, dict[str, str]],
    concurrency: int,
    seconds: float,
    rounds: int = 10,
) -> dict[str, float]:
    """Requests per second of each gateway: ``rounds`` short bursts each, taken in turn, so a
    machine whose load drifts (other processes) slows every row alike."""
    done = dict.fromkeys(urls, 0)
    taken = dict.fromkeys(urls, 0.0)
    for _ in range(rounds):
        for name, url in urls.items():
            count, spent = await burst(session, url, headers[name], concurrency, seconds / rounds)
            done[name] += count
            taken[name] += spent
    return {name: done[name] / taken[name] for name in urls}


async def run(
    redis_url: str, cluster_url: str | None, requests: int, concurrency: int, seconds: float
) -> list[Row]:
    variants: list[tuple[str, dict[str, Any] | None]] = [
        ("off", None),
        ("memory", {"backend": "memory"}),
        ("redis", {"backend": "redis", "redis": {"url": redis_url, "timeout_s": 1.0}}),
    ]
    if cluster_url is not None:
        redis = {"url": cluster_url, "cluster": True, "timeout_s": 1.0}
        variants.append(("cluster", {"backend": "redis", "redis": redis}))
    async with contextlib.AsyncExitStack() as stack:
        replica_url = await stack.enter_async_context(serve(replica_app()))
        urls = {}
        for name, limits in variants:
            app = build_app(SettingsStore(gateway_settings(replica_url, limits)), spawn_emulators=False)
            urls[name] = await stack.enter_async_context(serve(app)) + "/v1/completions"
        connector = aiohttp.TCPConnector(limit=concurrency + 8)
        session = await stack.enter_async_context(aiohttp.ClientSession(connector=connector))
        headers = {
            name: {} if limits is None else {"Authorization": f"Bearer {KEY}"} for name, limits in variants
        }
        for name in urls:  # warm connections, scripts, per-tenant state
            for _ in range(50):
                await timed_post(session, urls[name], headers[name])
        latencies: dict[str, list[float]] = {name: [] for name in urls}
        for _ in range(requests):
            for name, url in urls.items():
                latencies[name].append(await timed_post(session, url, headers[name]))
        rates = await throughputs(session, urls, headers, concurrency, seconds)
    base = float(np.percentile(latencies["off"], 50))
    return [
        Row(
            name=name,
            p50_ms=float(np.percentile(samples, 50)) * 1e3,
            p99_ms=float(np.percentile(samples, 99)) * 1e3,
            added_us=(float(np.percentile(samples, 50)) - base) * 1e6,
            requests_per_s=rates[name],
        )
        for name, samples in latencies.items()
    ]


def table(rows: list[Row], requests: int, concurrency: int, seconds: float) -> str:
    header = f"{'tenancy':<10}{'p50 ms':>10}{'p99 ms':>10}{'added p50 us':>15}{'requests/s':>13}"
    lines = [
        f"tenancy cost through the gateway: {requests} sequential requests per row (interleaved), "
        f"then {concurrency} clients for {seconds:g} s per row (interleaved bursts)",
        header,
        "-" * len(header),
    ]
    lines += [
        f"{r.name:<10}{r.p50_ms:>10.3f}{r.p99_ms:>10.3f}{r.added_us:>15.0f}{r.requests_per_s:>13.0f}"
        for r in rows
    ]
    return "\n".join(lines)


@contextlib.contextmanager
def servers(url: str | None, cluster: bool) -> Iterator[tuple[str, str | None]]:
    """The Redis URL to use (ours unless given) and a cluster URL when asked for."""
    with contextlib.ExitStack() as stack:
        if url is None:
            url = stack.enter_context(redis_server(name="redis-bench")).url
        cluster_url = stack.enter_context(redis_cluster(3)).url if cluster else None
        yield url, cluster_url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--requests", type=int, default=2000, help="sequential requests per gateway")
    parser.add_argument("--concurrency", type=int, default=32, help="clients in the throughput run")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each throughput run")
    parser.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    parser.add_argument("--cluster", action="store_true", help="also start and measure a 3-master cluster")
    parser.add_argument("--no-uvloop", action="store_true", help="asyncio's loop instead of uvloop's")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    with (
        servers(args.redis_url, args.cluster) as (url, cluster_url),
        asyncio.Runner(loop_factory=new_loop_factory(not args.no_uvloop)) as runner,
    ):
        rows = runner.run(run(url, cluster_url, args.requests, args.concurrency, args.seconds))
        loop_name = type(runner.get_loop()).__module__.split(".")[0]
    print(table(rows, args.requests, args.concurrency, args.seconds) + f"\nevent loop: {loop_name}")


if __name__ == "__main__":
    main()
