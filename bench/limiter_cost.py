"""What tenant limits cost an admission: the limiter off, in memory, and on a real Redis, in one run.

For each limiter it measures, on one event loop:

* added latency: one ``reserve`` (what an admission waits for) and one ``settle`` (paid after the
  response), back to back, one at a time; p50 and p99 in microseconds;
* throughput: ``--concurrency`` tasks each doing reserve + settle in a loop, as a loaded gateway
  would; admissions (reserve + settle pairs) per second;
* a flood of a tenant already over its limit (rejections), which the over-limit cache answers
  without Redis.

Rows: ``off`` (an awaited no-op: the floor), ``memory`` (the embedded default), ``redis`` (the bare
``RedisLimiter``), ``redis+policy`` (what ``build_limiter`` ships: failover + over-limit cache) and,
with ``--cluster``, the same stack on a three-master Redis Cluster. Unless ``--redis-url`` is given
it starts its own ``redis-server`` on a free port (persistence off). Numbers depend on the machine;
nothing here asserts a speed. Run: ``.venv/bin/python -m bench.limiter_cost``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

import numpy as np

from gateway.limits.base import Limiter, LimiterStats, Reservation, TenantLimits
from gateway.limits.config import LimitsSettings
from gateway.limits.factory import build_limiter
from gateway.limits.memory import MemoryLimiter
from gateway.limits.redis import RedisLimiter, connect
from tests.support.redis import redis_cluster, redis_server

#: Generous enough that every admission of the latency and throughput runs is allowed.
OPEN = TenantLimits(tokens_per_minute=1e12, requests_per_minute=1e9, max_concurrent=100_000)
#: A tenant whose budget is spent by its first request: everything after is a rejection.
SPENT = TenantLimits(tokens_per_minute=60, token_burst=100)
TENANTS = [f"tenant-{i}" for i in range(64)]


class NoLimiter:
    """The floor: an admission that awaits nothing and always allows (one shared answer)."""

    name = "off"

    def __init__(self) -> None:
        self._answer = MemoryLimiter().reserve_now(
            "any", cost_tokens=0, limits=TenantLimits(), request_id="any"
        )

    async def reserve(
        self, tenant: str, *, cost_tokens: float, limits: TenantLimits, request_id: str
    ) -> Reservation:
        return self._answer

    async def settle(self, reservation: Reservation, *, actual_cost_tokens: float) -> None:
        return None

    async def in_flight(self, tenant: str) -> int:
        return 0

    async def close(self) -> None:
        return None


@dataclass(frozen=True)
class Row:
    name: str
    reserve_p50_us: float
    reserve_p99_us: float
    settle_p50_us: float
    admissions_per_s: float
    flood_p50_us: float


async def timed(call: Callable[[], Awaitable[object]]) -> float:
    start = time.perf_counter_ns()
    await call()
    return (time.perf_counter_ns() - start) / 1000.0


async def measure(name: str, limiter: Limiter, requests: int, concurrency: int) -> Row:
    counter = iter(range(10**12))

    async def reserve(tenant: str, limits: TenantLimits = OPEN) -> Reservation:
        return await limiter.reserve(
            tenant, cost_tokens=100, limits=limits, request_id=f"{name}-{next(counter)}"
        )

    for tenant in TENANTS:  # warm connections, scripts and per-tenant state
        await limiter.settle(await reserve(tenant), actual_cost_tokens=80)
    reserve_us, settle_us = [], []
    for i in range(requests):
        start_ns = time.perf_counter_ns()
        r = await reserve(TENANTS[i % len(TENANTS)])
        reserved_ns = time.perf_counter_ns()
        await limiter.settle(r, actual_cost_tokens=80)
        reserve_us.append((reserved_ns - start_ns) / 1000.0)
        settle_us.append((time.perf_counter_ns() - reserved_ns) / 1000.0)

    async def worker(w: int, count: int) -> None:
        for j in range(count):
            r = await reserve(TENANTS[(w + j) % len(TENANTS)])
            await limiter.settle(r, actual_cost_tokens=80)

    per_worker = max(1, requests // concurrency)
    start = time.perf_counter()
    await asyncio.gather(*(worker(w, per_worker) for w in range(concurrency)))
    throughput = per_worker * concurrency / (time.perf_counter() - start)

    spent = f"spent-{name}"
    await reserve(spent, SPENT)
    flood_us = [await timed(lambda: reserve(spent, SPENT)) for _ in range(requests)]
    return Row(
        name=name,
        reserve_p50_us=float(np.percentile(reserve_us, 50)),
        reserve_p99_us=float(np.percentile(reserve_us, 99)),
        settle_p50_us=float(np.percentile(settle_us, 50)),
        admissions_per_s=throughput,
        flood_p50_us=float(np.percentile(flood_us, 50)),
    )


def policy_stack(url: str, *, cluster: bool) -> Limiter:
    settings = LimitsSettings.model_validate(
        {"backend": "redis", "redis": {"url": url, "cluster": cluster, "timeout_s": 1.0}}
    )
    return build_limiter(settings, stats=LimiterStats())


async def run(url: str, cluster_url: str | None, requests: int, concurrency: int) -> list[Row]:
    limiters: list[tuple[str, Limiter]] = [
        ("off", NoLimiter()),
        ("memory", MemoryLimiter()),
        ("redis", RedisLimiter(connect(url, timeout_s=1.0), timeout_s=1.0)),
        ("redis+policy", policy_stack(url, cluster=False)),
    ]
    if cluster_url is not None:
        limiters.append(("cluster+policy", policy_stack(cluster_url, cluster=True)))
    rows = []
    for name, limiter in limiters:
        try:
            rows.append(await measure(name, limiter, requests, concurrency))
        finally:
            await limiter.close()
    return rows


def table(rows: list[Row], requests: int, concurrency: int) -> str:
    header = (
        f"{'limiter':<16}{'reserve p50 us':>16}{'reserve p99 us':>16}{'settle p50 us':>15}"
        f"{'admissions/s':>14}{'over-limit p50 us':>19}"
    )
    lines = [
        f"limiter cost: {requests} sequential admissions, then {concurrency} concurrent tasks; "
        "admission = reserve + settle",
        header,
        "-" * len(header),
    ]
    lines += [
        f"{r.name:<16}{r.reserve_p50_us:>16.1f}{r.reserve_p99_us:>16.1f}{r.settle_p50_us:>15.1f}"
        f"{r.admissions_per_s:>14.0f}{r.flood_p50_us:>19.1f}"
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
    parser.add_argument("--requests", type=int, default=5000, help="sequential admissions per limiter")
    parser.add_argument("--concurrency", type=int, default=64, help="tasks in the throughput run")
    parser.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    parser.add_argument("--cluster", action="store_true", help="also start and measure a 3-master cluster")
    parser.add_argument("--no-uvloop", action="store_true", help="asyncio's loop instead of uvloop's")
    args = parser.parse_args()
    loop_factory = new_loop_factory(not args.no_uvloop)
    with (
        servers(args.redis_url, args.cluster) as (url, cluster_url),
        asyncio.Runner(loop_factory=loop_factory) as r,
    ):
        rows = r.run(run(url, cluster_url, args.requests, args.concurrency))
        loop_name = type(r.get_loop()).__module__.split(".")[0]
    print(table(rows, args.requests, args.concurrency) + f"\nevent loop: {loop_name}")


def new_loop_factory(use_uvloop: bool) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop, as the gateway runs by default, when asked for and installed."""
    if not use_uvloop:
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


if __name__ == "__main__":
    main()
