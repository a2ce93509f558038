"""What the replica ledger costs per request: Redis round trips, their time, and the delay until
another gateway has applied a change (``python -m bench.ledger_cost``, docs/benchmarks.md).

One ``redis-server`` on a free port (loopback, persistence off) and two in-process ledgers
(``gateway.ledger.live.LiveLedger``, the live code) on one event loop. Two runs:

* **one at a time**: each request is dispatched, gets its first token, streams for
  ``STREAM_S`` and ends, alone: nothing to batch with, the worst case per request. Reported:
  publish round trips per request (dispatch, first token, progress at most every
  ``progress_interval_s``, finish), the time of one round trip (median and p99, microseconds,
  as the publishing gateway's loop waits for it; the loop serves other requests meanwhile), and
  the delay from ``tracked`` at one gateway until the other has applied the dispatch;
* **a burst**: ``BURST`` requests dispatched in the same loop turn, then ended together:
  round trips per request when changes batch into one pipeline.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass

from gateway.ledger.config import LedgerSettings
from gateway.ledger.live import LiveLedger
from gateway.limits.config import RedisSettings
from gateway.replicas.snapshot import InFlight

REQUESTS = 200
STREAM_S = 0.3
BURST = 64
SETTINGS = LedgerSettings(enabled=True, heartbeat_s=1.0, expiry_s=3.0, progress_interval_s=0.25)


@dataclass
class _Live:
    tokens: int = 0
    first_token_at: float | None = None
    request_class: str = "interactive"
    expected_output_tokens: float = 48.0

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


async def _until(condition: object, timeout_s: float = 5.0) -> float:
    started = time.perf_counter()
    while not condition():  # type: ignore[operator]
        if time.perf_counter() - started > timeout_s:
            raise TimeoutError("not applied")
        await asyncio.sleep(0)
    return time.perf_counter() - started


async def measure(redis_url: str, requests: int = REQUESTS) -> dict[str, float]:
    redis = RedisSettings(url=redis_url, timeout_s=0.5)
    a = _Timed(SETTINGS, redis, replicas=lambda: ["r0"], gateway_id="bench-a")
    a.calls = []
    b = LiveLedger(SETTINGS, redis, replicas=lambda: ["r0"], gateway_id="bench-b")
    await a.start()
    await b.start()
    try:
        applied: list[float] = []
        for _ in range(requests):
            live = _Live()
            a.tracked("r0", live, live)
            applied.append(await _until(lambda: len(b.in_flight("r0")) == 1))
            live.tokens, live.first_token_at = 1, time.monotonic()
            await asyncio.sleep(STREAM_S)
            live.tokens = 20
            a.forgotten("r0", live)
            await _until(lambda: b.in_flight("r0") == ())
        one_calls = a.stats.publish_calls_total
        rtts = sorted(a.calls)
        a.calls = []
        lives = [_Live() for _ in range(BURST)]
        for live in lives:
            a.tracked("r0", live, live)
        await _until(lambda: len(b.in_flight("r0")) == BURST)
        for live in lives:
            a.forgotten("r0", live)
        await _until(lambda: b.in_flight("r0") == ())
        burst_calls = a.stats.publish_calls_total - one_calls
    finally:
        await a.stop()
        await b.stop()
    applied.sort()
    return {
        "round_trips_per_request": one_calls / requests,
        "rtt_p50_us": statistics.median(rtts) * 1e6,
        "rtt_p99_us": rtts[int(0.99 * (len(rtts) - 1))] * 1e6,
        "applied_p50_us": statistics.median(applied) * 1e6,
        "applied_p99_us": applied[int(0.99 * (len(applied) - 1))] * 1e6,
        "burst_round_trips_per_request": burst_calls / BURST,
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
        f"round trip p50 {found['rtt_p50_us']:.0f} us, p99 {found['rtt_p99_us']:.0f} us; "
        f"applied by the other gateway p50 {found['applied_p50_us']:.0f} us, "
        f"p99 {found['applied_p99_us']:.0f} us"
    )
    print(f"burst of {BURST}: {found['burst_round_trips_per_request']:.3f} publish round trips per request")


if __name__ == "__main__":
    main()
