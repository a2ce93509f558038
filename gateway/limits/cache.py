"""Over-limit cache: tenants known to be over a limit are answered in-process, not by Redis.

Wraps a ``Limiter``. After the inner limiter rejects a tenant on its token or request bucket, the
returned bucket states are kept until that rejection's retry time; meanwhile a reserve that would
not fit those states projected forward is rejected locally with exact ``retry_after_s`` and
headers. Anything that might fit goes through. It may reject a little longer than Redis would
(refunds settled by other gateways are unseen), never past the cached retry time. Concurrency
rejections are never cached. The clock is monotonic seconds and injectable.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from gateway.limits.base import (
    BucketState,
    ConcurrencyState,
    LevelReader,
    Limiter,
    LimiterStats,
    LimitKind,
    Reservation,
    TenantLevels,
    TenantLimits,
    overall_retry_after,
    request_bucket_state,
    token_bucket_state,
)

BucketKind = Literal["tokens", "requests"]
_BUCKET_KINDS: tuple[BucketKind, ...] = ("tokens", "requests")


@dataclass(frozen=True, slots=True)
class _Entry:
    """A rejection seen at ``at`` (local clock), valid until ``until``."""

    limits: TenantLimits
    at: float
    until: float
    tokens: BucketState | None
    requests: BucketState | None
    concurrency: ConcurrencyState | None


def projected_level(state: BucketState, elapsed_s: float) -> float:
    """The level of ``state``'s bucket ``elapsed_s`` seconds later, refilled, capped at capacity."""
    return min(state.remaining + state.limit_per_minute / 60.0 * elapsed_s, state.capacity)


class OverLimitCache:
    """A ``Limiter`` that answers known over-limit tenants locally; see the module docstring."""

    def __init__(
        self,
        inner: Limiter,
        *,
        clock: Callable[[], float] = time.monotonic,
        stats: LimiterStats | None = None,
    ) -> None:
        self.inner = inner
        self.name = inner.name
        self.stats = stats if stats is not None else LimiterStats()
        self._clock = clock
        self._entries: dict[tuple[str, BucketKind], _Entry] = {}

    async def reserve(
        self, tenant: str, *, cost_tokens: float, limits: TenantLimits, request_id: str
    ) -> Reservation:
        local = self.lookup(tenant, cost_tokens=cost_tokens, limits=limits, request_id=request_id)
        if local is not None:
            self.stats.count_reserve(local)
            return local
        reservation = await self.inner.reserve(
            tenant, cost_tokens=cost_tokens, limits=limits, request_id=request_id
        )
        self.remember(reservation)
        return reservation

    def lookup(
        self, tenant: str, *, cost_tokens: float, limits: TenantLimits, request_id: str
    ) -> Reservation | None:
        """A local rejection when a live entry shows this cost cannot fit yet; else None."""
        if not self._entries:  # no tenant is known to be over its limit: the admitted path
            return None
        now = self._clock()
        live = [e for k in _BUCKET_KINDS if (e := self._live_entry(tenant, k, limits, now)) is not None]
        # The newest rejection describes both buckets best.
        entry = max(live, key=lambda e: e.at, default=None)
        if entry is None or (limits.token_capacity is not None and cost_tokens > limits.token_capacity):
            return None
        elapsed = now - entry.at
        token_level = math.inf if entry.tokens is None else projected_level(entry.tokens, elapsed)
        request_level = math.inf if entry.requests is None else projected_level(entry.requests, elapsed)
        blocked: set[LimitKind] = set()
        if token_level < cost_tokens:
            blocked.add("tokens")
        if request_level < 1.0:
            blocked.add("requests")
        if not blocked:
            return None
        tokens = token_bucket_state(limits, token_level, cost_tokens, blocked="tokens" in blocked)
        requests = request_bucket_state(limits, request_level, blocked="requests" in blocked)
        frozen = frozenset(blocked)
        return Reservation(
            request_id=request_id,
            tenant=tenant,
            allowed=False,
            cost_tokens=cost_tokens,
            limits=limits,
            tokens=tokens,
            requests=requests,
            concurrency=entry.concurrency,
            blocked_by=frozen,
            oversize=False,
            retry_after_s=overall_retry_after(frozen, False, tokens, requests),
            origin=self.name,
            from_cache=True,
        )

    def remember(self, reservation: Reservation) -> None:
        """Record a bucket rejection until its retry time; forget the tenant after an allow."""
        tenant = reservation.tenant
        if reservation.allowed:
            self.forget(tenant)
            return
        if reservation.oversize:
            return
        now = self._clock()
        pairs: tuple[tuple[BucketKind, BucketState | None], ...] = (
            ("tokens", reservation.tokens),
            ("requests", reservation.requests),
        )
        for kind, state in pairs:
            if kind in reservation.blocked_by and state is not None and state.retry_after_s > 0:
                self._entries[(tenant, kind)] = _Entry(
                    limits=reservation.limits,
                    at=now,
                    until=now + state.retry_after_s,
                    tokens=reservation.tokens,
                    requests=reservation.requests,
                    concurrency=reservation.concurrency,
                )

    def forget(self, tenant: str, kinds: tuple[BucketKind, ...] = _BUCKET_KINDS) -> None:
        """Drop the tenant's entries for ``kinds``."""
        for kind in kinds:
            self._entries.pop((tenant, kind), None)

    def entries(self) -> int:
        """Live and expired entries held (for tests and metrics)."""
        return len(self._entries)

    async def settle(self, reservation: Reservation, *, actual_cost_tokens: float) -> None:
        await self.inner.settle(reservation, actual_cost_tokens=actual_cost_tokens)
        if reservation.allowed and actual_cost_tokens < reservation.cost_tokens:
            # A refund raises the level above what the entry projects: stop answering from it.
            self.forget(reservation.tenant, ("tokens",))

    async def in_flight(self, tenant: str) -> int:
        return await self.inner.in_flight(tenant)

    async def levels(self, tenant: str, limits: TenantLimits) -> TenantLevels:
        """The inner limiter's levels (``LevelReader``); the cache holds only rejections."""
        if not isinstance(self.inner, LevelReader):
            raise TypeError(f"limiter {self.inner.name!r} cannot report levels")
        return await self.inner.levels(tenant, limits)

    async def close(self) -> None:
        self._entries.clear()
        await self.inner.close()

    def _live_entry(self, tenant: str, kind: BucketKind, limits: TenantLimits, now: float) -> _Entry | None:
        """The entry for (tenant, kind) if it is still valid for ``limits``; drops a stale one."""
        entry = self._entries.get((tenant, kind))
        if entry is None:
            return None
        if now >= entry.until or entry.limits != limits:
            del self._entries[(tenant, kind)]
            return None
        return entry
