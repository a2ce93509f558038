"""In-process limiter: the embedded default, and the local fallback while Redis is down.

The same contract and ``bucket`` arithmetic as ``redis.RedisLimiter``, kept per tenant in a dict
on an injectable monotonic clock. ``share`` (0 < share <= 1) scales every budget to this gateway's
part of the fleet's; a cost that fits the fleet's bucket but not the share is admitted when the
local bucket is full (leaving it in debt), never answered "never". ``lease_ttl_s`` bounds how long
an unsettled reservation holds its slot. Reserves do not await, so they are atomic under asyncio;
state is per process.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.limits import bucket
from gateway.limits.base import (
    LimiterStats,
    LimitKind,
    Reservation,
    TenantLevels,
    TenantLimits,
    build_reservation,
    tenant_levels,
)

#: Default lease of a concurrency slot, in seconds: longer than any request should run.
DEFAULT_LEASE_TTL_S = 900.0


@dataclass
class _Tenant:
    """One tenant's state: ``full_at`` of both buckets and the unsettled leases (id -> expiry)."""

    tokens_full_at: float = -math.inf
    requests_full_at: float = -math.inf
    leases: dict[str, float] = field(default_factory=dict)

    def prune(self, now: float) -> None:
        """Drop the leases whose expiry is at or before ``now``.

        Leases are inserted in expiry order (one limiter, one TTL, a monotonic clock), so only
        the expired ones at the front are visited: O(expired), not O(in flight).
        """
        while self.leases:
            rid, expiry = next(iter(self.leases.items()))
            if expiry > now:
                return
            del self.leases[rid]


class MemoryLimiter:
    """A ``Limiter`` kept in this process; see the module docstring."""

    def __init__(
        self,
        *,
        share: float = 1.0,
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
        clock: Callable[[], float] = time.monotonic,
        stats: LimiterStats | None = None,
        name: str = "memory",
    ) -> None:
        if not 0.0 < share <= 1.0:
            raise ValueError(f"share must be in (0, 1], got {share!r}")
        if lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {lease_ttl_s!r}")
        self.name = name
        self.share = share
        self.lease_ttl_s = lease_ttl_s
        self.stats = stats if stats is not None else LimiterStats()
        self._clock = clock
        self._tenants: dict[str, _Tenant] = {}

    async def reserve(
        self, tenant: str, *, cost_tokens: float, limits: TenantLimits, request_id: str
    ) -> Reservation:
        reservation = self.reserve_now(tenant, cost_tokens=cost_tokens, limits=limits, request_id=request_id)
        self.stats.count_reserve(reservation)
        return reservation

    def reserve_now(
        self, tenant: str, *, cost_tokens: float, limits: TenantLimits, request_id: str
    ) -> Reservation:
        """The synchronous core of ``reserve`` (no stats); see ``Limiter.reserve``."""
        if cost_tokens < 0 or not math.isfinite(cost_tokens):
            raise ValueError(f"cost_tokens must be a finite number >= 0, got {cost_tokens!r}")
        now = self._clock()
        state = self._tenants.setdefault(tenant, _Tenant())
        state.prune(now)
        local = limits.scaled(self.share)
        token_need = min(cost_tokens, local.token_capacity) if local.token_capacity is not None else 0.0
        token_level = self._level(state.tokens_full_at, now, local.tokens_per_minute, local.token_capacity)
        request_level = self._level(
            state.requests_full_at, now, local.requests_per_minute, local.request_capacity
        )
        # A reserve repeating a held request id is a retry: allowed, nothing more is taken.
        repeat = request_id in state.leases
        oversize = not repeat and limits.token_capacity is not None and cost_tokens > limits.token_capacity
        blocked = (
            frozenset[LimitKind]()
            if repeat
            else self._blocked(
                state,
                local,
                oversize=oversize,
                token_ok=token_level >= token_need,
                request_ok=request_level >= 1.0,
            )
        )
        if not blocked and not repeat:
            token_level -= cost_tokens
            request_level -= 1.0
            self._take(state, local, now, token_level, request_level)
            state.leases[request_id] = now + self.lease_ttl_s
        return build_reservation(
            tenant=tenant,
            request_id=request_id,
            cost_tokens=cost_tokens,
            limits=limits,
            enforced=local,
            token_level=token_level,
            token_need=token_need,
            request_level=request_level,
            in_flight=len(state.leases),
            blocked=blocked,
            oversize=oversize,
            origin=self.name,
        )

    @staticmethod
    def _blocked(
        state: _Tenant, local: TenantLimits, *, oversize: bool, token_ok: bool, request_ok: bool
    ) -> frozenset[LimitKind]:
        """The budgets that refuse this reservation (empty: it is allowed)."""
        blocked: set[LimitKind] = set()
        if oversize or not token_ok:
            blocked.add("tokens")
        if not request_ok:
            blocked.add("requests")
        if local.max_concurrent is not None and len(state.leases) >= local.max_concurrent:
            blocked.add("concurrency")
        return frozenset(blocked)

    def _take(
        self, state: _Tenant, local: TenantLimits, now: float, token_level: float, request_level: float
    ) -> None:
        """Store both buckets at their new levels."""
        state.tokens_full_at = self._full_at(token_level, now, local.tokens_per_minute, local.token_capacity)
        state.requests_full_at = self._full_at(
            request_level, now, local.requests_per_minute, local.request_capacity
        )

    async def settle(self, reservation: Reservation, *, actual_cost_tokens: float) -> None:
        self.stats.count_settle(self.settle_now(reservation, actual_cost_tokens=actual_cost_tokens))

    def settle_now(self, reservation: Reservation, *, actual_cost_tokens: float) -> bool:
        """The synchronous core of ``settle``; True when it applied, False for a no-op."""
        if actual_cost_tokens < 0 or not math.isfinite(actual_cost_tokens):
            raise ValueError(f"actual_cost_tokens must be a finite number >= 0, got {actual_cost_tokens!r}")
        if not reservation.allowed:
            return False
        state = self._tenants.get(reservation.tenant)
        now = self._clock()
        if state is None:
            return False
        state.prune(now)
        if state.leases.pop(reservation.request_id, None) is None:
            return False
        local = reservation.limits.scaled(self.share)
        rate_per_minute, capacity = local.tokens_per_minute, local.token_capacity
        if rate_per_minute is not None and capacity is not None:
            rate = rate_per_minute / 60.0
            level = bucket.level_at(state.tokens_full_at, now, rate, capacity)
            level = bucket.settled_level(level, actual_cost_tokens - reservation.cost_tokens, capacity)
            state.tokens_full_at = bucket.full_at_for(level, now, rate, capacity)
        return True

    async def in_flight(self, tenant: str) -> int:
        state = self._tenants.get(tenant)
        if state is None:
            return 0
        state.prune(self._clock())
        return len(state.leases)

    async def levels(self, tenant: str, limits: TenantLimits) -> TenantLevels:
        """``tenant``'s buckets at this gateway's share of ``limits``, now (``LevelReader``);
        creates, prunes and writes nothing."""
        now = self._clock()
        local = limits.scaled(self.share)
        state = self._tenants.get(tenant) or _Tenant()
        tokens = self._level(state.tokens_full_at, now, local.tokens_per_minute, local.token_capacity)
        requests = self._level(state.requests_full_at, now, local.requests_per_minute, local.request_capacity)
        in_flight = sum(1 for expiry in state.leases.values() if expiry > now)
        return tenant_levels(local, tokens, requests, in_flight, self.name)

    async def close(self) -> None:
        self._tenants.clear()

    @staticmethod
    def _level(full_at: float, now: float, per_minute: float | None, capacity: float | None) -> float:
        """Level of a bucket, ``math.inf`` for an unlimited one."""
        if per_minute is None or capacity is None:
            return math.inf
        return bucket.level_at(full_at, now, per_minute / 60.0, capacity)

    @staticmethod
    def _full_at(level: float, now: float, per_minute: float | None, capacity: float | None) -> float:
        if per_minute is None or capacity is None:
            return -math.inf
        return bucket.full_at_for(level, now, per_minute / 60.0, capacity)
