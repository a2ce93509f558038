"""Test doubles for the limiter layer: a hand-driven clock and a limiter whose storage can fail."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from gateway.limits.base import LimiterUnavailable, Reservation, TenantLevels, TenantLimits
from gateway.limits.memory import MemoryLimiter


@dataclass
class FakeClock:
    """A monotonic clock that moves only when told to, in seconds."""

    now: float = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        assert seconds >= 0, "a monotonic clock never goes back"
        self.now += seconds


class FlakyStorage:
    """A real ``MemoryLimiter`` behind a switch: while ``down``, every call raises ``LimiterUnavailable``.

    Stands in for Redis in the failure-policy tests; ``calls`` counts the calls that reached it.
    """

    def __init__(self, inner: MemoryLimiter) -> None:
        self.inner = inner
        self.name = inner.name
        self.stats = inner.stats
        self.down = False
        self.calls = 0
        self.closed = False
        #: When set, ``reserve`` waits for this event first: a storage call still in flight.
        self.hold: asyncio.Event | None = None

    def _check(self) -> None:
        self.calls += 1
        if self.down:
            raise LimiterUnavailable(f"{self.name}: connection refused")

    async def reserve(
        self, tenant: str, *, cost_tokens: float, limits: TenantLimits, request_id: str
    ) -> Reservation:
        self._check()
        if self.hold is not None:
            await self.hold.wait()
        return await self.inner.reserve(tenant, cost_tokens=cost_tokens, limits=limits, request_id=request_id)

    async def settle(self, reservation: Reservation, *, actual_cost_tokens: float) -> None:
        self._check()
        await self.inner.settle(reservation, actual_cost_tokens=actual_cost_tokens)

    async def in_flight(self, tenant: str) -> int:
        self._check()
        return await self.inner.in_flight(tenant)

    async def levels(self, tenant: str, limits: TenantLimits) -> TenantLevels:
        self._check()
        return await self.inner.levels(tenant, limits)

    async def close(self) -> None:
        self.closed = True
