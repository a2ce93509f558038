"""Failure policy for a storage-backed limiter: fail open to local buckets, or fail closed.

Every call goes to ``primary`` while it answers. The first ``LimiterUnavailable`` marks storage
down; until a probe (one reserve at a time, after a doubling backoff) succeeds, reserves are
answered by ``fallback`` (``fail_open``) or refused with ``LimiterUnavailable`` (``fail_closed``:
503), without touching storage. A reservation is settled where it was made
(``Reservation.origin``); a failed settle is counted, never raised. Every failure, transition and
decision is counted in ``LimiterStats``. Behaviour for operators: docs/tenants.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Literal

from gateway.limits.base import Limiter, LimiterStats, LimiterUnavailable, Reservation, TenantLimits

FailureMode = Literal["fail_open", "fail_closed"]

log = logging.getLogger("sluice.limits")


def next_backoff(current_s: float, maximum_s: float) -> float:
    """The wait before the next probe after one more failed probe: doubled, at most ``maximum_s``."""
    return min(current_s * 2.0, maximum_s)


class FailoverLimiter:
    """A ``Limiter`` applying the storage failure policy; see the module docstring."""

    def __init__(
        self,
        primary: Limiter,
        fallback: Limiter,
        *,
        mode: FailureMode = "fail_open",
        backoff_s: float = 1.0,
        backoff_max_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        stats: LimiterStats | None = None,
        name: str = "failover",
    ) -> None:
        if primary.name == fallback.name:
            raise ValueError(f"primary and fallback need different names, both are {primary.name!r}")
        if not 0 < backoff_s <= backoff_max_s:
            raise ValueError(f"need 0 < backoff_s <= backoff_max_s, got {backoff_s!r}, {backoff_max_s!r}")
        self.name = name
        self.primary = primary
        self.fallback = fallback
        self.mode: FailureMode = mode
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.stats = stats if stats is not None else LimiterStats()
        self._clock = clock
        self._down_since: float | None = None
        self._next_probe_at = 0.0
        self._current_backoff_s = backoff_s
        self._probing = False

    @property
    def degraded(self) -> bool:
        """True while storage is considered down."""
        return self._down_since is not None

    async def reserve(
        self, tenant: str, *, cost_tokens: float, limits: TenantLimits, request_id: str
    ) -> Reservation:
        probe = self._should_probe()
        if self.degraded and not probe:
            return await self._degraded_reserve(tenant, cost_tokens, limits, request_id)
        if probe:
            self._probing = True
        try:
            reservation = await self.primary.reserve(
                tenant, cost_tokens=cost_tokens, limits=limits, request_id=request_id
            )
        except LimiterUnavailable as exc:
            self._failed(exc, probe=probe)
            return await self._degraded_reserve(tenant, cost_tokens, limits, request_id)
        finally:
            if probe:
                self._probing = False
        if probe:
            self._recovered()
        return reservation

    async def settle(self, reservation: Reservation, *, actual_cost_tokens: float) -> None:
        if reservation.origin == self.fallback.name:
            await self.fallback.settle(reservation, actual_cost_tokens=actual_cost_tokens)
            return
        try:
            await self.primary.settle(reservation, actual_cost_tokens=actual_cost_tokens)
        except LimiterUnavailable as exc:
            self._failed(exc, probe=False)

    async def in_flight(self, tenant: str) -> int:
        """Unsettled reservations on both limiters; the fallback's alone while storage is down."""
        local = await self.fallback.in_flight(tenant)
        if self.degraded:
            return local
        try:
            return local + await self.primary.in_flight(tenant)
        except LimiterUnavailable as exc:
            self._failed(exc, probe=False)
            return local

    async def close(self) -> None:
        try:
            await self.primary.close()
        finally:
            await self.fallback.close()

    def _should_probe(self) -> bool:
        """True when storage is down, the backoff has passed and no other probe is running."""
        return self.degraded and not self._probing and self._clock() >= self._next_probe_at

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

    def _failed(self, exc: LimiterUnavailable, *, probe: bool) -> None:
        """Count a storage failure; mark storage down (logged once) or push the next probe back."""
        self.stats.storage_errors_total += 1
        now = self._clock()
        if not self.degraded:
            self._down_since = now
            self._current_backoff_s = self.backoff_s
            self._next_probe_at = now + self._current_backoff_s
            self.stats.degraded = True
            self.stats.transitions_total += 1
            action = (
                "answering from local buckets at this gateway's share" if self.mode == "fail_open" else "503"
            )
            log.warning(
                "rate-limit storage %s unavailable (%s); %s until it answers again",
                self.primary.name,
                exc,
                action,
            )
        elif probe:
            self._current_backoff_s = next_backoff(self._current_backoff_s, self.backoff_max_s)
            self._next_probe_at = now + self._current_backoff_s

    def _recovered(self) -> None:
        """Mark storage up after a successful probe (logged once)."""
        if self._down_since is None:
            return
        down_for = self._clock() - self._down_since
        self._down_since = None
        self._current_backoff_s = self.backoff_s
        self.stats.degraded = False
        self.stats.transitions_total += 1
        log.info("rate-limit storage %s available again after %.1f s", self.primary.name, down_for)
