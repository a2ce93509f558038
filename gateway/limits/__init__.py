"""Per-tenant token, request and concurrency budgets: one contract, a memory and a Redis backend.

``base`` holds the contract (``Limiter``, ``Reservation``, ``TenantLimits``, ``LimiterUnavailable``);
``memory`` and ``redis`` the backends; ``cache`` the in-process over-limit cache; ``failover`` the
fail-open / fail-closed policy; ``config`` the YAML sections; ``factory.build_limiter`` wires them.
``config`` and ``factory`` are not imported here, so ``gateway.config.settings`` may import
``gateway.limits.config`` without a cycle through this package.
"""

from gateway.limits.base import (
    BucketState,
    ConcurrencyState,
    Limiter,
    LimiterStats,
    LimiterUnavailable,
    LimitKind,
    Reservation,
    TenantLimits,
)
from gateway.limits.memory import MemoryLimiter

__all__ = [
    "BucketState",
    "ConcurrencyState",
    "LimitKind",
    "Limiter",
    "LimiterStats",
    "LimiterUnavailable",
    "MemoryLimiter",
    "Reservation",
    "TenantLimits",
]
