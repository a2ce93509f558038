"""What the replica ledger costs per request: Redis round trips, their time, and the delay until
another gateway has applied a change (``python -m bench.ledger_cost``, docs/benchmarks.md).

One ``redis-server`` on a free port (loopback, persistence off) and two in-process ledgers
(``gateway.ledger.live.LiveLedger``, the live code) on one event loop. Two runs:

* **one at a time**: each request is dispatched, gets its first token, streams for
  ``STREAM_S`` and ends, alone: nothing to batch with, the worst case per request. Reported:
  publish round trips per request (dispatch, first token, progress at most every
  ``progress_interval_s``, finish), the process's CPU per request beyond the two ledgers' idle
  cost (both ledgers: publishing and applying), the time of one round trip (median and p99, microseconds,
  as the publishing gateway's loop waits for it; the loop serves other requests meanwhile), and
  the delay from ``tracked`` at one gateway until the other has applied the dispatch;
* **a burst**: ``BURST`` requests dispatched in the same loop turn, then ended together:
  round trips per request when changes batch into one pipeline;
* **steady load**: ``STEADY_RATE`` requests a second, overlapping: round trips and CPU per
  request as under real traffic (changes made while a pipeline is in flight share the next).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.ledger.config import LedgerSettings
from gateway.ledger.live import LiveLedger
from gateway.limits.config import RedisSettings
from gateway.replicas.snapshot import InFlight

REQUESTS = 200
STREAM_S = 0.3
BURST = 64
#: The steady run: requests a second, for this many seconds.
STEADY_RATE = 200.0
STEADY_S = 5.0
#: Seconds the two ledgers idle first, to measure their cost without requests.
IDLE_S = 5.0
SETTINGS = LedgerSettings(enabled=True, heartbeat_s=1.0, expiry_s=3.0, progress_interval_s=0.25)


@dataclass
class _Live:
    tokens: int = 0
    first_token_at: float | None = None
    request_class: str = "interactive"
    expected_output_tokens: float = 48.0
    predicted_tpot_s: float = 0.02

    def in_flight(self, now: float) -> InFlight:
        return InFlight("bench", 300, self.tokens, now, 48, first_token_at=self.first_token_at)

    __hash__ = object.__hash__


class _Timed(LiveLedger):
    """A ledger that keeps each publish round trip's duration."""

    calls: list[float]

    async def flush(self) -> None:
        started = time.perf_counter()
        before = self.stats.publish_calls_total
        await super().flush()
        if self.stats.publish_calls_total > before:
            self.calls.append(time.perf_counter() - started)


class _Changes:
    """Wakes whoever waits when the other gateway's view of a replica changed (no polling)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def __call__(self, replica: str | None, freed: bool) -> None:
        self.event.set()

    async def until(self, condition: Callable[[], bool], timeout_s: float = 5.0) -> float:
        """Seconds until ``condition()`` held, checked at each change."""
        started = time.perf_counter()
        async with asyncio.timeout(timeout_s):
            while not condition():
                self.event.clear()
                await self.event.wait()
        return time.perf_counter() - started


async def _steady(a: LiveLedger, changes: _Changes, b: LiveLedger, idle_per_s: float) -> dict[str, float]:
    """``STEADY_RATE`` requests a second for ``STEADY_S``, each streaming ``STREAM_S`` (first token
    after 50 ms): round trips and CPU per request beyond the idle cost, as under real load."""
    calls_before = a.stats.publish_calls_total
    cpu_started, wall_started = time.process_time(), time.perf_counter()
    count = int(STEADY_RATE * STEADY_S)

    async def one() -> None:
        live = _Live()
        a.tracked("r0", live, live)
        await asyncio.sleep(0.05)
        live.tokens, live.first_token_at = 1, time.monotonic()
        await asyncio.sleep(STREAM_S - 0.05)
        live.tokens = 20
        a.forgotten("r0", live)

    tasks = []
    for _ in range(count):
        tasks.append(asyncio.create_task(one()))
        await asyncio.sleep(1.0 / STEADY_RATE)
    await asyncio.gather(*tasks)
    await changes.until(lambda: b.in_flight("r0") == ())
    cpu_s = time.process_time() - cpu_started - idle_per_s * (time.perf_counter() - wall_started)
    return {
        "steady_round_trips_per_request": (a.stats.publish_calls_total - calls_before) / count,
        "steady_cpu_us_per_request": cpu_s / count * 1e6,
    }


async def measure(redis_url: str, requests: int = REQUESTS) -> dict[str, float]:
    redis = RedisSettings(url=redis_url, timeout_s=0.5)
    a = _Timed(SETTINGS, redis, replicas=lambda: ["r0"], gateway_id="bench-a")
    a.calls = []
    changes = _Changes()
    b = LiveLedger(SETTINGS, redis, replicas=lambda: ["r0"], on_change=changes, gateway_id="bench-b")
    await a.start()
    await b.start()
    try:
        # The idle cost (ticker, heartbeats, subscriptions), to take off the requests' CPU.
        idle_started, idle_wall = time.process_time(), time.perf_counter()
        await asyncio.sleep(IDLE_S)
        idle_per_s = (time.process_time() - idle_started) / (time.perf_counter() - idle_wall)
        applied: list[float] = []
        cpu_started, wall_started = time.process_time(), time.perf_counter()
        for _ in range(requests):
            live = _Live()
            a.tracked("r0", live, live)
            applied.append(await changes.until(lambda: len(b.in_flight("r0")) == 1))
            live.tokens, live.first_token_at = 1, time.monotonic()
            await asyncio.sleep(STREAM_S)
            live.tokens = 20
            a.forgotten("r0", live)
            await changes.until(lambda: b.in_flight("r0") == ())
        cpu_s = time.process_time() - cpu_started - idle_per_s * (time.perf_counter() - wall_started)
        one_calls = a.stats.publish_calls_total
        rtts = sorted(a.calls)
        a.calls = []
        lives = [_Live() for _ in range(BURST)]
        for live in lives:
            a.tracked("r0", live, live)
        await changes.until(lambda: len(b.in_flight("r0")) == BURST)
        for live in lives:
            a.forgotten("r0", live)
        await changes.until(lambda: b.in_flight("r0") == ())
        burst_calls = a.stats.publish_calls_total - one_calls
        steady = await _steady(a, changes, b, idle_per_s)
    finally:
        await a.stop()
        await b.stop()
    applied.sort()
    return {
        "round_trips_per_request": one_calls / requests,
        "cpu_us_per_request": cpu_s / requests * 1e6,
        "idle_cpu_ms_per_s": idle_per_s * 1e3,
        "rtt_p50_us": statistics.median(rtts) * 1e6,
        "rtt_p99_us": rtts[int(0.99 * (len(rtts) - 1))] * 1e6,
        "applied_p50_us": statistics.median(applied) * 1e6,
        "applied_p99_us": applied[int(0.99 * (len(applied) - 1))] * 1e6,
        "burst_round_trips_per_request": burst_calls / BURST,
        **steady,
    }


def main(argv: list[str] | None = None) -> None:
    from tests.support.redis import redis_server

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=REQUESTS)
    args = parser.parse_args(argv)
    with redis_server(name="redis-ledger-cost") as server:
        found = asyncio.run(measure(server.url, args.requests))
    print(
        f"one at a time ({args.requests} requests, {STREAM_S:g} s streams): "
        f"{found['round_trips_per_request']:.2f} publish round trips per request; "
        f"CPU {found['cpu_us_per_request']:.0f} us per request (publisher and applier together, "
        f"beyond their idle {found['idle_cpu_ms_per_s'] / 2:.1f} ms/s each); "
        f"round trip p50 {found['rtt_p50_us']:.0f} us, p99 {found['rtt_p99_us']:.0f} us; "
        f"applied by the other gateway p50 {found['applied_p50_us']:.0f} us, "
        f"p99 {found['applied_p99_us']:.0f} us"
    )
    print(f"burst of {BURST}: {found['burst_round_trips_per_request']:.3f} publish round trips per request")
    print(
        f"steady {STEADY_RATE:g} requests/s ({STREAM_S:g} s streams): "
        f"{found['steady_round_trips_per_request']:.2f} publish round trips per request; "
        f"CPU {found['steady_cpu_us_per_request']:.0f} us per request (publisher and applier together)"
    )


if __name__ == "__main__":
    main()
