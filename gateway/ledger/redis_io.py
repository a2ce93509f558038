"""The ledger's Redis calls: entries, heartbeats and the event channel (docs/deployment.md).

Keys (``<prefix>`` is ``limits.redis.key_prefix``), hash-tagged so a Cluster keeps each replica's
entries, and each gateway's heartbeat, in one slot:

* ``<prefix>:ledger:{<replica>}``: a hash, one field per in-flight entry (its key), the entry's
  JSON as value (``state.encode_entry``);
* ``<prefix>:ledger:gw:{<gateway>}``: the gateway's heartbeat, a string with a TTL;
* ``<prefix>:ledger:events``: the pub/sub channel every change is published on (classic pub/sub
  reaches every node's subscribers in a Cluster).

Every call is bounded by ``timeout_s``; past it or on any Redis error it raises
``LedgerUnavailable``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any, Final

import redis.asyncio
import redis.exceptions
from redis.asyncio.cluster import RedisCluster

from gateway.ledger.state import Entry, Op, Saturation, decode_entry, encode_entry, encode_message
from gateway.limits.redis import RedisClient

__all__ = ["LedgerRedis", "LedgerUnavailable"]


class LedgerUnavailable(Exception):
    """Redis failed or was slower than the call's timeout."""


#: What a Redis call may raise when Redis fails (a Cluster's own errors are no ``RedisError``).
_FAILURES: Final = (
    TimeoutError,
    redis.exceptions.RedisError,
    redis.exceptions.RedisClusterException,
    OSError,
)


class LedgerRedis:
    """The ledger's Redis calls over ``client`` (single node or Cluster) and ``subscriber`` (a
    plain client for pub/sub: in a Cluster, any node)."""

    def __init__(
        self, client: RedisClient, subscriber: redis.asyncio.Redis, *, prefix: str, timeout_s: float
    ) -> None:
        self._client = client
        self._subscriber = subscriber
        self._prefix = prefix
        self.timeout_s = timeout_s
        self.channel = f"{prefix}:ledger:events"

    def entries_key(self, replica: str) -> str:
        return f"{self._prefix}:ledger:{{{replica}}}"

    def heartbeat_key(self, gateway: str) -> str:
        return f"{self._prefix}:ledger:gw:{{{gateway}}}"

    async def _run(self, calls: Any, *more: Awaitable[Any]) -> list[Any]:
        """Execute the pipeline ``calls`` (and await ``more`` beside it), within the timeout."""
        try:
            async with asyncio.timeout(self.timeout_s):
                if not more:
                    result: list[Any] = await calls.execute()
                    return result
                found = await asyncio.gather(calls.execute(), *more)
                return list(found[0])
        except _FAILURES as exc:
            raise LedgerUnavailable(f"{exc.__class__.__name__}: {exc}") from exc

    async def publish(self, gateway: str, ops: Sequence[Op], saturations: Sequence[Saturation] = ()) -> None:
        """Write ``ops`` to the replicas' hashes and publish them with ``saturations``: one round
        trip (a pipeline; in a Cluster, one per node the replicas' slots are on, and the PUBLISH
        beside them on the subscriber's node: a Cluster pipeline takes no PUBLISH)."""
        pipe = self._client.pipeline(transaction=False)
        for kind, entry in ops:
            key = self.entries_key(entry.replica)
            if kind == "put":
                pipe.hset(key, entry.key, encode_entry(entry))
            else:
                pipe.hdel(key, entry.key)
        message = encode_message(gateway, ops, saturations)
        if isinstance(self._client, RedisCluster):
            await self._run(pipe, self._subscriber.publish(self.channel, message))
        else:
            pipe.publish(self.channel, message)
            await self._run(pipe)

    async def rewrite(self, entries: Iterable[Entry]) -> None:
        """Write ``entries`` again whole (after this gateway's heartbeat had expired)."""
        pipe = self._client.pipeline(transaction=False)
        count = 0
        for entry in entries:
            pipe.hset(self.entries_key(entry.replica), entry.key, encode_entry(entry))
            count += 1
        if count:
            await self._run(pipe)

    async def heartbeat(self, gateway: str, expiry_s: float) -> bool:
        """Renew ``gateway``'s heartbeat for ``expiry_s``; whether it had expired (or never was)."""
        pipe = self._client.pipeline(transaction=False)
        pipe.set(self.heartbeat_key(gateway), b"1", px=max(1, round(expiry_s * 1000)), get=True)
        (previous,) = await self._run(pipe)
        return previous is None

    async def alive(self, gateways: Sequence[str]) -> set[str]:
        """Those of ``gateways`` whose heartbeat has not expired."""
        if not gateways:
            return set()
        pipe = self._client.pipeline(transaction=False)
        for gateway in gateways:
            pipe.exists(self.heartbeat_key(gateway))
        found = await self._run(pipe)
        return {g for g, n in zip(gateways, found, strict=True) if n}

    async def read(self, replicas: Sequence[str]) -> dict[str, list[Entry]]:
        """Every entry of each of ``replicas``, all gateways' (malformed values skipped)."""
        if not replicas:
            return {}
        pipe = self._client.pipeline(transaction=False)
        for replica in replicas:
            pipe.hgetall(self.entries_key(replica))
        found = await self._run(pipe)
        read: dict[str, list[Entry]] = {}
        for replica, fields in zip(replicas, found, strict=True):
            entries = (decode_entry(value) for value in (fields or {}).values())
            read[replica] = [e for e in entries if e is not None]
        return read

    async def purge(self, dead: dict[str, list[str]]) -> None:
        """Delete the fields ``dead`` names, per replica (entries of expired gateways)."""
        pipe = self._client.pipeline(transaction=False)
        count = 0
        for replica, keys in dead.items():
            if keys:
                pipe.hdel(self.entries_key(replica), *keys)
                count += 1
        if count:
            await self._run(pipe)

    async def messages(self, on_subscribed: Callable[[], None] = lambda: None) -> AsyncIterator[bytes]:
        """The channel's messages as they come (``on_subscribed()`` once the subscription holds);
        raises ``LedgerUnavailable`` when the subscription breaks (the caller subscribes again)."""
        pubsub = self._subscriber.pubsub(ignore_subscribe_messages=True)
        try:
            try:
                async with asyncio.timeout(self.timeout_s * 20 + 1.0):
                    await pubsub.subscribe(self.channel)
            except _FAILURES as exc:
                raise LedgerUnavailable(f"subscribe: {exc.__class__.__name__}: {exc}") from exc
            on_subscribed()
            while True:
                try:
                    message = await pubsub.get_message(timeout=1.0)
                except _FAILURES as exc:
                    raise LedgerUnavailable(f"{exc.__class__.__name__}: {exc}") from exc
                if message is not None and message.get("type") == "message":
                    yield message["data"]
        finally:
            with contextlib.suppress(redis.exceptions.RedisError, OSError):
                await pubsub.aclose()

    async def aclose(self) -> None:
        for client in (self._client, self._subscriber):
            with contextlib.suppress(redis.exceptions.RedisError, OSError):
                await client.aclose()
