"""``LiveLedger.stop`` returns in bounded time whatever the Redis client does on the way down: a
cancellation it turns into one of its own errors (the subscriber would retry forever), a
connection teardown it shields from cancellation. Neither fault can be caused on demand with a
real ``redis-server``, so the Redis calls here are a stand-in (the ledger on a real Redis:
``tests/integration/ledger/test_ledger_redis.py``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import cast

import pytest

from gateway.ledger import live
from gateway.ledger.config import LedgerSettings
from gateway.ledger.live import LiveLedger
from gateway.ledger.redis_io import LedgerRedis, LedgerUnavailable
from gateway.ledger.state import Entry, Op, Saturation
from gateway.limits.config import RedisSettings

SETTINGS = LedgerSettings(enabled=True, heartbeat_s=0.1, expiry_s=0.3, progress_interval_s=0.05)
#: How long the stand-in's hanging close takes, seconds (``stop`` waits 0.2 s for it here).
HANG_S = 3.0


class StubbornRedis:
    """Answers every call at once; its subscription turns a cancellation into
    ``LedgerUnavailable`` (as a client converting ``CancelledError`` would), and, with
    ``hang_on_close``, ``aclose`` takes ``HANG_S`` seconds whatever cancels it (a teardown
    shielded from cancellation)."""

    def __init__(self, *, hang_on_close: bool) -> None:
        self.hang_on_close = hang_on_close
        self.subscriptions = 0
        self.close_started = False

    async def publish(self, gateway: str, ops: Sequence[Op], saturations: Sequence[Saturation] = ()) -> None:
        return None

    async def rewrite(self, entries: Iterable[Entry]) -> None:
        return None

    async def heartbeat(self, gateway: str, expiry_s: float) -> bool:
        return False

    async def alive(self, gateways: Sequence[str]) -> set[str]:
        return set(gateways)

    async def read(self, replicas: Sequence[str]) -> dict[str, list[Entry]]:
        return {r: [] for r in replicas}

    async def purge(self, dead: dict[str, list[str]]) -> None:
        return None

    async def messages(self, on_subscribed: Callable[[], None] = lambda: None) -> AsyncIterator[bytes]:
        self.subscriptions += 1
        on_subscribed()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise LedgerUnavailable("ConnectionError: cancelled while reading") from None
        yield b""  # pragma: no cover - never reached

    async def aclose(self) -> None:
        self.close_started = True
        if not self.hang_on_close:
            return
        loop = asyncio.get_running_loop()
        until = loop.time() + HANG_S
        while loop.time() < until:
            try:
                await asyncio.sleep(until - loop.time())
            except asyncio.CancelledError:
                continue


@pytest.mark.parametrize("hang_on_close", [False, True], ids=["closes", "close hangs"])
async def test_stop_returns_in_bounded_time(monkeypatch: pytest.MonkeyPatch, hang_on_close: bool) -> None:
    monkeypatch.setattr(live, "STOP_WAIT_S", 0.2)
    io = StubbornRedis(hang_on_close=hang_on_close)
    ledger = LiveLedger(
        SETTINGS,
        RedisSettings(url="redis://127.0.0.1:1/0"),
        replicas=lambda: ["r0"],
        io=cast(LedgerRedis, io),
        gateway_id="gw",
    )
    await ledger.start()
    await asyncio.sleep(0.05)
    assert io.subscriptions == 1
    started = time.perf_counter()
    await asyncio.wait_for(ledger.stop(), timeout=10.0)
    # Far above the two 0.2 s waits, below the hanging close's 3 s.
    assert time.perf_counter() - started < 0.8 * HANG_S
    assert io.close_started
    # The subscriber ended on the closed ledger instead of subscribing again.
    await asyncio.sleep(2 * live.PROBE_S)
    assert io.subscriptions == 1
