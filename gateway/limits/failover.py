"""Failure policy for a storage-backed limiter: fail open to local buckets, or fail closed.

Every call goes to ``primary`` while it answers. The first ``LimiterUnavailable`` marks storage
down; from then on reserves never touch storage (no request waits on a dead connection): they
are answered by ``fallback`` (``fail_open``) or refused at once with ``LimiterUnavailable``
(``fail_closed``: 503). Meanwhile one background task probes storage every ``probe_interval_s``
with a cheap call (``probe``: a Redis PING), whatever the request traffic; the first probe
answered marks storage up, so service returns within one interval (plus the probe's own round
trip) of storage answering again. A reservation is settled where it was made
(``Reservation.origin``); a failed settle is counted, never raised. Every failure, transition
and decision is counted in ``LimiterStats``. Behaviour for operators: docs/tenants.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Final, Literal

from gateway.limits.base import (
    LevelReader,
    Limiter,
    LimiterStats,
    LimiterUnavailable,
    Reservation,
    TenantLevels,
    TenantLimits,
)
from gateway.observability.repeats import repeat_key

FailureMode = Literal["fail_open", "fail_closed"]

#: Seconds between two probes of a storage marked down.
DEFAULT_PROBE_INTERVAL_S: Final = 0.25
#: The tenant whose (empty) lease set ``in_flight`` reads when no ``probe`` is given.
PROBE_TENANT: Final = "sluice-probe"

log = logging.getLogger("sluice.limits")


class FailoverLimiter:
    """A ``Limiter`` applying the storage failure policy; see the module docstring.

    ``probe()``: one cheap storage round trip, raising ``LimiterUnavailable`` while storage is
    down (default: ``primary.in_flight(PROBE_TENANT)``). ``probe_interval_s`` > 0: seconds
    between the end of one probe and the start of the next. ``clock`` (monotonic seconds) and
    ``sleep`` drive the probes; tests inject virtual ones.
    """

    def __init__(
        self,
        primary: Limiter,
        fallback: Limiter,
        *,
        mode: FailureMode = "fail_open",
        probe: Callable[[], Awaitable[object]] | None = None,
        probe_interval_s: float = DEFAULT_PROBE_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        stats: LimiterStats | None = None,
        name: str = "failover",
    ) -> None:
        if primary.name == fallback.name:
            raise ValueError(f"primary and fallback need different names, both are {primary.name!r}")
        if not probe_interval_s > 0:
            raise ValueError(f"probe_interval_s must be > 0, got {probe_interval_s!r}")
        self.name = name
        self.primary = primary
        self.fallback = fallback
        self.mode: FailureMode = mode
        self.probe_interval_s = probe_interval_s
        self.stats = stats if stats is not None else LimiterStats()
        self._probe = probe if probe is not None else self._in_flight_probe
        self._clock = clock
        self._sleep = sleep
        self._down_since: float | None = None
        self._prober: asyncio.Task[None] | None = None
        #: Probes sent since the limiter was made (for tests and curiosity).
        self.probes_total = 0

    @property
    def degraded(self) -> bool:
        """True while storage is considered down."""
        return self._down_since is not None

    async def reserve(
        self, tenant: str, *, cost_tokens: float, limits: TenantLimits, request_id: str
    ) -> Reservation:
        if self.degraded:
            return await self._degraded_reserve(tenant, cost_tokens, limits, request_id)
        try:
            return await self.primary.reserve(
                tenant, cost_tokens=cost_tokens, limits=limits, request_id=request_id
            )
        except LimiterUnavailable as exc:
            self._failed(exc)
            return await self._degraded_reserve(tenant, cost_tokens, limits, request_id)

    async def settle(self, reservation: Reservation, *, actual_cost_tokens: float) -> None:
        if reservation.origin == self.fallback.name:
            await self.fallback.settle(reservation, actual_cost_tokens=actual_cost_tokens)
            return
        try:
            await self.primary.settle(reservation, actual_cost_tokens=actual_cost_tokens)
        except LimiterUnavailable as exc:
            self._failed(exc)

    async def in_flight(self, tenant: str) -> int:
        """Unsettled reservations on both limiters; the fallback's alone while storage is down."""
        local = await self.fallback.in_flight(tenant)
        if self.degraded:
            return local
        try:
            return local + await self.primary.in_flight(tenant)
        except LimiterUnavailable as exc:
            self._failed(exc)
            return local

    async def levels(self, tenant: str, limits: TenantLimits) -> TenantLevels:
        """The primary's levels while storage answers, else the fallback's (``LevelReader``);
        read-only either way. A failed read does not mark storage down: an operator's read (or
        the gauges' refresh) must not change how requests are limited; requests find out."""
        if not self.degraded and isinstance(self.primary, LevelReader):
            try:
                return await self.primary.levels(tenant, limits)
            except LimiterUnavailable:
                pass
        if not isinstance(self.fallback, LevelReader):
            raise TypeError(f"limiter {self.fallback.name!r} cannot report levels")
        return await self.fallback.levels(tenant, limits)

    async def close(self) -> None:
        prober, self._prober = self._prober, None
        if prober is not None:
            prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await prober
        try:
            await self.primary.close()
        finally:
            await self.fallback.close()

    async def _degraded_reserve(
        self, tenant: str, cost_tokens: float, limits: TenantLimits, request_id: str
    ) -> Reservation:
        if self.mode == "fail_closed":
            self.stats.fail_closed_total += 1
            raise LimiterUnavailable(f"rate-limit storage {self.primary.name!r} is unavailable")
        self.stats.fail_open_total += 1
        return await self.fallback.reserve(
            tenant, cost_tokens=cost_tokens, limits=limits, request_id=request_id
        )

    def _failed(self, exc: LimiterUnavailable) -> None:
        """Count a storage failure; on the first, mark storage down (logged) and start probing."""
        self.stats.storage_errors_total += 1
        if self.degraded:
            return
        self._down_since = self._clock()
        self.stats.degraded = True
        self.stats.transitions_total += 1
        action = "answering from local buckets at this gateway's share" if self.mode == "fail_open" else "503"
        log.warning(
            "rate-limit storage %s unavailable (%s); %s until it answers again (probed every %g s)",
            self.primary.name,
            exc,
            action,
            self.probe_interval_s,
            extra=repeat_key("storage down", self.primary.name),
        )
        if self._prober is None or self._prober.done():
            self._prober = asyncio.get_running_loop().create_task(self._probe_until_up())

    async def _probe_until_up(self) -> None:
        """Probe storage every ``probe_interval_s`` until a probe is answered, then mark it up."""
        while self.degraded:
            await self._sleep(self.probe_interval_s)
            self.probes_total += 1
            try:
                await self._probe()
            except LimiterUnavailable:
                self.stats.storage_errors_total += 1
                continue
            except Exception:
                # A bug in the probe must not leave storage down for good: log it, probe again.
                log.exception("probing rate-limit storage %s failed", self.primary.name)
                continue
            self._recovered()

    async def _in_flight_probe(self) -> None:
        await self.primary.in_flight(PROBE_TENANT)

    def _recovered(self) -> None:
        """Mark storage up after a probe was answered (logged)."""
        if self._down_since is None:
            return
        down_for = self._clock() - self._down_since
        self._down_since = None
        self.stats.degraded = False
        self.stats.transitions_total += 1
        log.info(
            "rate-limit storage %s available again after %.1f s",
            self.primary.name,
            down_for,
            extra=repeat_key("storage up", self.primary.name),
        )
