"""Redis limiter: one budget shared by every gateway replica.

``reserve``, ``settle`` and ``in_flight`` are each one EVALSHA of a shipped Lua script, atomic on
the server, timed by Redis ``TIME``; keys ``{prefix}:{{tenant}}:tokens|requests|leases`` keep a
tenant in one cluster slot. A plain ``redis://`` server is called through
``gateway.limits.pipelined``, anything else through redis-py. Every call is bounded by
``timeout_s``; past it or on any error it raises ``LimiterUnavailable``, never hangs. Scripts are
idempotent per request id, so a failed reserve or settle is repaired in the background (an
idempotent settle, retried with backoff until storage answers or ``lease_ttl_s`` expires);
``close`` flushes pending repairs. ``max_concurrent_calls`` should equal the pool's
``max_connections``. Operations: docs/tenants.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, cast

import redis.asyncio
import redis.exceptions
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript

from gateway.limits.base import (
    LimiterStats,
    LimiterUnavailable,
    LimitKind,
    Reservation,
    TenantLevels,
    TenantLimits,
    build_reservation,
    tenant_levels,
)
from gateway.limits.memory import DEFAULT_LEASE_TTL_S
from gateway.limits.pipelined import Packed, for_client

RedisClient = redis.asyncio.Redis | RedisCluster

#: Backoff between two attempts of a repair: from this, doubling...
REPAIR_BACKOFF_MIN_S = 0.1
#: ...up to this (``RedisLimiter(repair_backoff_max_s=...)``), in seconds.
REPAIR_BACKOFF_MAX_S = 30.0
#: ``close`` waits this much longer than one call's timeout for the repairs' last attempts.
CLOSE_MARGIN_S = 1.0

_BLOCKED_BITS: tuple[tuple[int, LimitKind], ...] = ((1, "tokens"), (2, "requests"), (4, "concurrency"))
_OVERSIZE_BIT = 8
#: Tenants whose keys ``RedisLimiter.keys`` remembers before it starts over.
_KEYS_CACHED = 4096


def script_text(name: str) -> str:
    """The text of ``gateway/limits/<name>`` (a ``.lua`` file shipped as package data)."""
    return resources.files("gateway.limits").joinpath(name).read_text(encoding="utf-8")


def connect(
    url: str, *, cluster: bool = False, timeout_s: float = 0.05, max_connections: int = 64
) -> RedisClient:
    """A client for ``url`` (``redis://host:port/db`` or ``rediss://``), not yet connected.

    The connect timeout is ``timeout_s``; a failed command is retried once on a fresh connection
    (a server restart leaves stale pooled sockets), within the caller's timeout. There is no
    per-command socket timeout: every call of ``RedisLimiter`` is bounded by its own
    ``asyncio.timeout(timeout_s)`` (waiting for a connection, sending and reading included), and
    redis-py's ``socket_timeout`` would arm two more timers per command (a ``wait_for`` around the
    send and a timeout around the read) for the same bound. A call cut by that timeout closes its
    connection (redis-py disconnects on cancellation), so a hung server's reply is never read by a
    later command. With ``cluster``, ``url`` names any node; the others are discovered.
    """
    if cluster:
        return RedisCluster.from_url(
            url,
            socket_timeout=None,
            socket_connect_timeout=timeout_s,
            max_connections=max_connections,
            retry=Retry(NoBackoff(), 3),
        )
    return redis.asyncio.Redis.from_url(
        url,
        socket_timeout=None,
        socket_connect_timeout=timeout_s,
        max_connections=max_connections,
        retry=Retry(NoBackoff(), 1),
    )


@dataclass(frozen=True, slots=True)
class TenantKeys:
    """The Redis keys of one tenant; all share the ``{tenant}`` hash tag."""

    tokens: str
    requests: str
    leases: str


@dataclass(frozen=True, slots=True)
class _TenantArgs:
    """What a tenant's script calls repeat under one ``TenantLimits``, built once
    (``RedisLimiter._args``): its keys; a reserve's keys and its arguments after the request id
    and cost; a settle's keys and its arguments after the request id and delta; the token
    bucket's (rate, capacity) for a repair. The call arguments are pre-encoded (``Packed``) for
    the pipelined path, values for redis-py's; either way a call splats ``*reserve_args`` after
    its own two."""

    keys: TenantKeys
    reserve_keys: Sequence[str] | Packed
    reserve_args: tuple[float | int | Packed, ...]
    settle_keys: Sequence[str] | Packed
    settle_args: tuple[float | Packed, ...]
    token_bucket: tuple[float, float]


class RedisLimiter:
    """A ``Limiter`` on Redis or Redis Cluster; see the module docstring."""

    def __init__(
        self,
        client: RedisClient,
        *,
        timeout_s: float = 0.05,
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
        key_prefix: str = "sluice",
        max_concurrent_calls: int = 64,
        repair_delay_s: float = 1.0,
        repair_backoff_max_s: float = REPAIR_BACKOFF_MAX_S,
        stats: LimiterStats | None = None,
        name: str = "redis",
    ) -> None:
        if timeout_s <= 0 or lease_ttl_s <= 0 or max_concurrent_calls < 1 or repair_delay_s < 0:
            raise ValueError(
                "timeout_s and lease_ttl_s must be > 0, max_concurrent_calls >= 1, repair_delay_s >= 0"
            )
        if repair_backoff_max_s <= 0:
            raise ValueError(f"repair_backoff_max_s must be > 0, got {repair_backoff_max_s!r}")
        if "{" in key_prefix or "}" in key_prefix:
            raise ValueError(
                f"key_prefix must not contain braces (they are the hash tag), got {key_prefix!r}"
            )
        self.name = name
        self.timeout_s = timeout_s
        self.lease_ttl_s = lease_ttl_s
        self.key_prefix = key_prefix
        self.repair_delay_s = repair_delay_s
        self.repair_backoff_max_s = repair_backoff_max_s
        self.stats = stats if stats is not None else LimiterStats()
        self._client = client
        self._calls = asyncio.Semaphore(max_concurrent_calls)
        # redis-py's async cluster client races when many commands trigger its lazy topology
        # discovery at once (connections closed under other commands): discover it once, first.
        self._needs_init = isinstance(client, RedisCluster)
        self._init_lock = asyncio.Lock()
        self._reserve = client.register_script(script_text("token_bucket.lua"))
        self._settle = client.register_script(script_text("settle.lua"))
        self._in_flight = client.register_script(script_text("in_flight.lua"))
        self._levels = client.register_script(script_text("levels.lua"))
        #: Script calls to a single plain server go on one pipelined connection
        #: (``gateway.limits.pipelined``); a cluster, TLS or a Unix socket keep redis-py's path.
        self._fast = for_client(client, stale_after_s=timeout_s)
        if self._fast is not None:
            self._fast.preload(self._reserve, self._settle, self._in_flight, self._levels)
        self._repairs: set[asyncio.Task[None]] = set()
        #: ``keys(tenant)`` remembered (strings built once per tenant, not per call).
        self._keys: dict[str, TenantKeys] = {}
        #: Each tenant's constant call arguments per limits (``_args``): a call builds (and on the
        #: pipelined path encodes) only its request id and cost.
        self._tenant_args: dict[tuple[str, TenantLimits], _TenantArgs] = {}
        #: Set by ``close``: every pending repair stops waiting and tries once more, now.
        self._closing = asyncio.Event()

    def keys(self, tenant: str) -> TenantKeys:
        """The keys of ``tenant``; raises ValueError for a name with braces (it would break the tag)."""
        keys = self._keys.get(tenant)
        if keys is not None:
            return keys
        if "{" in tenant or "}" in tenant:
            raise ValueError(f"tenant names must not contain braces, got {tenant!r}")
        base = f"{self.key_prefix}:{{{tenant}}}"
        keys = TenantKeys(tokens=f"{base}:tokens", requests=f"{base}:requests", leases=f"{base}:leases")
        if len(self._keys) >= _KEYS_CACHED:
            self._keys.clear()
        self._keys[tenant] = keys
        return keys

    async def load_scripts(self, timeout_s: float = 5.0) -> None:
        """SCRIPT LOAD every script (on every primary of a cluster) ahead of the first request.

        Optional: EVALSHA loads a missing script on demand. Raises ``LimiterUnavailable``.
        """
        try:
            async with asyncio.timeout(timeout_s):
                await self._load_all()
        except Exception as exc:  # see _call
            raise LimiterUnavailable(f"{self.name}: cannot load scripts: {exc!r}") from exc

    async def _load_all(self) -> None:
        """SCRIPT LOAD every script (a cluster client sends it to every primary)."""
        for script in (self._reserve, self._settle, self._in_flight, self._levels):
            await self._client.script_load(script.script)

    async def reserve(
        self, tenant: str, *, cost_tokens: float, limits: TenantLimits, request_id: str
    ) -> Reservation:
        if cost_tokens < 0 or not math.isfinite(cost_tokens):
            raise ValueError(f"cost_tokens must be a finite number >= 0, got {cost_tokens!r}")
        a = self._args(tenant, limits)
        try:
            raw = await self._call(self._reserve, a.reserve_keys, (request_id, cost_tokens, *a.reserve_args))
        except LimiterUnavailable:
            # The script may have run and only its reply been lost: give back whatever it took.
            self._repair_later(a.keys, (request_id, -cost_tokens, *a.token_bucket))
            raise
        reservation = _reservation(
            tenant=tenant,
            request_id=request_id,
            cost_tokens=cost_tokens,
            limits=limits,
            mask=int(raw[1]),
            token_level=float(raw[2]),
            request_level=float(raw[3]),
            in_flight=int(raw[4]),
            origin=self.name,
        )
        self.stats.count_reserve(reservation)
        return reservation

    async def settle(self, reservation: Reservation, *, actual_cost_tokens: float) -> None:
        if actual_cost_tokens < 0 or not math.isfinite(actual_cost_tokens):
            raise ValueError(f"actual_cost_tokens must be a finite number >= 0, got {actual_cost_tokens!r}")
        if not reservation.allowed:
            self.stats.count_settle(False)
            return
        a = self._args(reservation.tenant, reservation.limits)
        delta = actual_cost_tokens - reservation.cost_tokens
        try:
            applied = await self._call(
                self._settle, a.settle_keys, (reservation.request_id, delta, *a.settle_args)
            )
        except LimiterUnavailable:
            # Settling is idempotent: trying again is safe.
            self._repair_later(a.keys, (reservation.request_id, delta, *a.token_bucket))
            raise
        self.stats.count_settle(int(applied) == 1)

    async def in_flight(self, tenant: str) -> int:
        return int(await self._call(self._in_flight, (self.keys(tenant).leases,), ()))

    async def levels(self, tenant: str, limits: TenantLimits) -> TenantLevels:
        """``tenant``'s buckets and unexpired leases on Redis's clock (``levels.lua``: reads only,
        so an idle tenant's keys still expire on their own); ``LevelReader``."""
        keys = self.keys(tenant)
        tokens = _rate_and_capacity(limits.tokens_per_minute, limits.token_capacity)
        requests = _rate_and_capacity(limits.requests_per_minute, limits.request_capacity)
        raw = await self._call(self._levels, (keys.tokens, keys.requests, keys.leases), (*tokens, *requests))
        return tenant_levels(limits, float(raw[0]), float(raw[1]), int(raw[2]), self.name)

    async def ping(self) -> None:
        """One ``PING`` within ``timeout_s``, on the path script calls take (the pipelined
        connection, which it opens with the scripts preloaded when needed): the failure policy's
        health probe. Raises ``LimiterUnavailable`` when Redis does not answer."""
        try:
            fast = self._fast
            if fast is not None:
                await fast.ping(deadline=asyncio.get_running_loop().time() + self.timeout_s)
                return
            async with asyncio.timeout(self.timeout_s):
                await self._client.ping()
        except Exception as exc:  # see _call
            raise LimiterUnavailable(f"{self.name}: {type(exc).__name__}: {exc}") from exc

    async def close(self) -> None:
        """Run every pending repair once more, now, and wait for them; then close the client.

        Bounded: each last attempt is one call within ``timeout_s``. A repair whose last attempt
        fails is abandoned (counted): its lease expires on its own.
        """
        self._closing.set()
        if self._repairs:
            await asyncio.wait(set(self._repairs), timeout=self.timeout_s + CLOSE_MARGIN_S)
        for task in list(self._repairs):
            task.cancel()
        await asyncio.gather(*self._repairs, return_exceptions=True)
        if self._fast is not None:
            await self._fast.close()
        await self._client.aclose()

    def pending_repairs(self) -> int:
        """Repairs scheduled and not yet finished (see ``_repair_later``)."""
        return len(self._repairs)

    async def wait_repairs(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` seconds for the pending repairs (and any they are retrying) to
        finish, without hurrying them; returns how many are still pending."""
        if self._repairs:
            await asyncio.wait(set(self._repairs), timeout=timeout_s)
        return len(self._repairs)

    def _repair_later(self, keys: TenantKeys, settle_args: tuple[str | float, ...]) -> None:
        """Run the settle script with ``settle_args`` in the background until storage answers.

        A call that failed may still have run on the server (a timeout only loses the reply), or
        not at all: then a settle's refund is not applied and a reserve that ran holds a
        concurrency slot for ``lease_ttl_s``. Settling is idempotent per request id, so running
        it again applies the settle (releasing the lease, refunding its tokens) exactly once, and
        does nothing if the original call ran. The first attempt waits ``repair_delay_s``, so a
        command still queued on the server runs first; a failed attempt is retried after a
        backoff (doubling from ``REPAIR_BACKOFF_MIN_S``, at most ``repair_backoff_max_s``) until
        one is answered, or the lease has expired (nothing left to repair), or ``close``.
        """
        self.stats.repairs_total += 1
        self.stats.repairs_pending += 1
        expires_at = time.monotonic() + self.lease_ttl_s
        task = asyncio.get_running_loop().create_task(self._repair(keys, settle_args, expires_at))
        self._repairs.add(task)
        task.add_done_callback(self._repair_done)

    def _repair_done(self, task: asyncio.Task[None]) -> None:
        self._repairs.discard(task)
        self.stats.repairs_pending -= 1
        if task.cancelled():
            self.stats.repairs_abandoned_total += 1

    async def _repair(
        self, keys: TenantKeys, settle_args: tuple[str | float, ...], expires_at: float
    ) -> None:
        delay = self.repair_delay_s
        while True:
            if not self._closing.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._closing.wait(), delay)
            try:
                applied = await self._call(self._settle, (keys.tokens, keys.leases), settle_args)
            except LimiterUnavailable:
                delay = min(max(delay * 2.0, REPAIR_BACKOFF_MIN_S), self.repair_backoff_max_s)
                if self._closing.is_set() or time.monotonic() + delay >= expires_at:
                    self.stats.repairs_abandoned_total += 1
                    return
                self.stats.repair_retries_total += 1
                continue
            if int(applied) == 1:
                self.stats.repairs_applied_total += 1
            return

    def _args(self, tenant: str, limits: TenantLimits) -> _TenantArgs:
        """``tenant``'s keys and ``limits``' script arguments (``_TenantArgs``), built once."""
        found = self._tenant_args.get((tenant, limits))
        if found is not None:
            return found
        keys = self.keys(tenant)
        tokens = _rate_and_capacity(limits.tokens_per_minute, limits.token_capacity)
        requests = _rate_and_capacity(limits.requests_per_minute, limits.request_capacity)
        concurrent = -1 if limits.max_concurrent is None else limits.max_concurrent
        reserve_keys = (keys.tokens, keys.requests, keys.leases)
        settle_keys = (keys.tokens, keys.leases)
        reserve_args = (*tokens, *requests, concurrent, self.lease_ttl_s)
        if self._fast is not None:
            found = _TenantArgs(
                keys,
                Packed.keys(reserve_keys),
                (Packed(*reserve_args),),
                Packed.keys(settle_keys),
                (Packed(*tokens),),
                tokens,
            )
        else:
            found = _TenantArgs(keys, reserve_keys, reserve_args, settle_keys, tokens, tokens)
        if len(self._tenant_args) >= _KEYS_CACHED:
            self._tenant_args.clear()
        self._tenant_args[(tenant, limits)] = found
        return found

    async def _call(
        self, script: AsyncScript, keys: Sequence[str] | Packed, args: Sequence[str | float | int | Packed]
    ) -> Any:
        """Run ``script`` within ``timeout_s`` (queueing for a call slot included).

        On the pipelined path the deadline goes with the call (one timer per connection bounds
        every reply's wait; ``gateway.limits.pipelined``); ``asyncio.timeout`` bounds only a wait
        for a call slot, and everything on redis-py's path."""
        fast = self._fast
        if fast is not None:
            calls = self._calls
            deadline = asyncio.get_running_loop().time() + self.timeout_s
            try:
                if calls.locked():
                    async with asyncio.timeout_at(deadline):
                        await calls.acquire()
                else:
                    await calls.acquire()
                try:
                    return await fast.evalsha(script, keys, args, deadline=deadline)
                finally:
                    calls.release()
            except Exception as exc:  # see below
                raise LimiterUnavailable(f"{self.name}: {type(exc).__name__}: {exc}") from exc
        # Only the pipelined path is given pre-encoded arguments (``_packed``).
        plain = cast(Sequence[str | float | int], args)
        assert not isinstance(keys, Packed)
        try:
            async with asyncio.timeout(self.timeout_s), self._calls:
                if self._needs_init:
                    await self._initialize_cluster()
                try:
                    return await self._client.evalsha(script.sha, len(keys), *keys, *plain)
                except redis.exceptions.NoScriptError:
                    await self._load_all()
                    return await self._client.evalsha(script.sha, len(keys), *keys, *plain)
        except Exception as exc:
            # Beyond RedisError, OSError and the timeout, redis-py's cluster client has been seen
            # to raise AttributeError from a connection torn down under a command: every failure
            # of the storage call must become the one error the failure policy handles.
            raise LimiterUnavailable(f"{self.name}: {type(exc).__name__}: {exc}") from exc

    async def _initialize_cluster(self) -> None:
        """Discover the cluster's topology once, before any concurrent command (see ``__init__``)."""
        async with self._init_lock:
            if self._needs_init and isinstance(self._client, RedisCluster):
                await self._client.initialize()
                self._needs_init = False


def _rate_and_capacity(per_minute: float | None, capacity: float | None) -> tuple[float, float]:
    """Script arguments for one bucket: (rate per second, capacity), or (-1, 0) for unlimited."""
    if per_minute is None or capacity is None:
        return (-1.0, 0.0)
    return (per_minute / 60.0, capacity)


def _reservation(
    *,
    tenant: str,
    request_id: str,
    cost_tokens: float,
    limits: TenantLimits,
    mask: int,
    token_level: float,
    request_level: float,
    in_flight: int,
    origin: str,
) -> Reservation:
    """A ``Reservation`` from the reserve script's reply (see ``token_bucket.lua``)."""
    return build_reservation(
        tenant=tenant,
        request_id=request_id,
        cost_tokens=cost_tokens,
        limits=limits,
        enforced=limits,
        token_level=token_level,
        token_need=cost_tokens,
        request_level=request_level,
        in_flight=in_flight,
        blocked=frozenset(kind for bit, kind in _BLOCKED_BITS if mask & bit),
        oversize=bool(mask & _OVERSIZE_BIT),
        origin=origin,
    )
