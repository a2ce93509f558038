"""Build the limiter stack the ``limits:`` section describes."""

from __future__ import annotations

import time
from collections.abc import Callable

from gateway.limits.base import Limiter, LimiterStats
from gateway.limits.cache import OverLimitCache
from gateway.limits.config import LimitsSettings
from gateway.limits.failover import FailoverLimiter
from gateway.limits.memory import MemoryLimiter
from gateway.limits.redis import RedisLimiter, connect


def build_limiter(
    settings: LimitsSettings,
    *,
    stats: LimiterStats,
    clock: Callable[[], float] = time.monotonic,
    memory_share: float = 1.0,
) -> Limiter:
    """The limiter for ``settings``; every layer counts into ``stats``.

    ``memory``: a ``MemoryLimiter`` at ``memory_share`` (0 < share <= 1) of every budget: one
    worker's part when ``server.workers`` processes each keep their own. ``redis``:
    ``FailoverLimiter(OverLimitCache(RedisLimiter), MemoryLimiter at fallback_share)`` (the cache
    only when ``over_limit_cache``), probing a failed Redis with PING every ``probe_interval_s``.
    Creating it opens no connection; call ``await limiter.close()`` at shutdown.
    """
    if settings.backend == "memory" or settings.redis is None:
        return MemoryLimiter(share=memory_share, lease_ttl_s=settings.lease_ttl_s, clock=clock, stats=stats)
    redis_settings = settings.redis
    client = connect(
        redis_settings.url,
        cluster=redis_settings.cluster,
        timeout_s=redis_settings.timeout_s,
        max_connections=redis_settings.max_connections,
    )
    redis_limiter = RedisLimiter(
        client,
        timeout_s=redis_settings.timeout_s,
        lease_ttl_s=settings.lease_ttl_s,
        key_prefix=redis_settings.key_prefix,
        max_concurrent_calls=redis_settings.max_connections,
        stats=stats,
    )
    primary: Limiter = redis_limiter
    if settings.over_limit_cache:
        primary = OverLimitCache(primary, clock=clock, stats=stats)
    fallback = MemoryLimiter(
        share=settings.fallback_share,
        lease_ttl_s=settings.lease_ttl_s,
        clock=clock,
        stats=stats,
        name="fallback",
    )
    return FailoverLimiter(
        primary,
        fallback,
        mode=settings.on_storage_error,
        probe=redis_limiter.ping,
        probe_interval_s=settings.probe_interval_s,
        clock=clock,
        stats=stats,
    )
