"""Issued API keys in Redis, shared by every gateway (``limits.backend: redis``).

Two keys under the limiter's ``key_prefix``, in one cluster slot (the ``{apikeys}`` hash tag):
``<prefix>:{apikeys}:records``, a hash of key id -> JSON ``{tenant, prefix, hash, created_at}``,
and ``<prefix>:{apikeys}:version``, a counter every change increments in the same transaction.
Each gateway reads the counter every ``poll_s`` seconds (one ``GET``) and reloads the records
only when it moved, so a key issued or revoked on one gateway applies on all within about
``poll_s`` plus a round trip. Keys written in the configuration stay there (listed, never
revoked here). Nothing here logs or stores a secret.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

from gateway.limits.redis import RedisClient
from gateway.observability.repeats import repeat_key
from gateway.tenants.config import TenantsSettings
from gateway.tenants.key_store import KeyRecord, KeyStoreError, configured_records, issued_record, new_secret
from gateway.tenants.keys import key_hash_problem

__all__ = ["REDIS_POLL_S", "RedisKeyStore"]

log = logging.getLogger("sluice.keys")

#: Seconds between two reads of the keys' version counter.
REDIS_POLL_S: Final = 0.25


def _unavailable(exc: Exception) -> KeyStoreError:
    return KeyStoreError(
        f"The key store (Redis) did not answer: {type(exc).__name__}; try again.",
        status=503,
        code="keys_unavailable",
    )


class RedisKeyStore:
    """Issued keys in Redis (see the module docstring); a ``KeyStore``.

    ``client``: a redis-py asyncio client (plain or cluster), closed by ``close``. ``settings()``:
    the current tenants settings. ``timeout_s`` bounds each call; ``clock``: Unix seconds.
    """

    def __init__(
        self,
        client: RedisClient,
        settings: Callable[[], TenantsSettings],
        *,
        key_prefix: str = "sluice",
        poll_s: float = REDIS_POLL_S,
        timeout_s: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if poll_s <= 0 or timeout_s <= 0:
            raise ValueError("poll_s and timeout_s must be > 0")
        self._client = client
        self._settings = settings
        self.records_key = f"{key_prefix}:{{apikeys}}:records"
        self.version_key = f"{key_prefix}:{{apikeys}}:version"
        self.poll_s = poll_s
        self.timeout_s = timeout_s
        self._clock = clock
        self._version: bytes | str | None = None
        self._added: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"RedisKeyStore({self.records_key})"

    # -- reading --------------------------------------------------------------------------------------

    async def _all(self) -> list[KeyRecord]:
        """Every valid record in Redis (an entry that does not parse is skipped and logged)."""
        async with asyncio.timeout(self.timeout_s):
            raw: Mapping[Any, Any] = await self._client.hgetall(self.records_key)
        found: list[KeyRecord] = []
        for key_id, value in raw.items():
            record = _parse(_text(key_id), value)
            if record is None:
                log.warning("skipping a malformed key record %s in %s", _text(key_id)[:40], self.records_key)
                continue
            found.append(record)
        return found

    async def refresh(self) -> bool:
        """Reload the records if the version counter moved; True when the keys changed."""
        async with asyncio.timeout(self.timeout_s):
            version = await self._client.get(self.version_key)
        if version == self._version and self._version is not None:
            return False
        records = await self._all()
        added = {r.key_hash: r.tenant for r in records}
        changed = added != self._added
        self._added, self._version = added, version
        return changed

    async def poll(self, on_change: Callable[[], object]) -> None:
        """``refresh`` every ``poll_s`` seconds, calling ``on_change`` after a change, until
        cancelled; Redis trouble is logged (once per outage) and retried at the next period."""
        while True:
            try:
                if await self.refresh():
                    on_change()
            except Exception as exc:
                log.warning(
                    "cannot read the issued API keys from Redis (%s); keeping the last ones read",
                    type(exc).__name__,
                    extra=repeat_key("keys unreadable", self.records_key),
                )
            await asyncio.sleep(self.poll_s)

    # -- the KeyStore ---------------------------------------------------------------------------------

    async def issue(self, tenant: str) -> tuple[KeyRecord, str]:
        secret = new_secret()
        record = issued_record(tenant, secret, "redis", self._clock())
        value = json.dumps({"tenant": tenant, **record.stored()})
        await self._change(lambda pipe: pipe.hset(self.records_key, record.id, value))
        self._added[record.key_hash] = tenant
        return record, secret

    async def records(self, tenant: str) -> list[KeyRecord]:
        try:
            stored = await self._all()
        except Exception as exc:
            raise _unavailable(exc) from None
        configured = configured_records(self._settings())
        return [r for r in (*configured, *stored) if r.tenant == tenant]

    async def revoke(self, tenant: str, key_id: str) -> KeyRecord | None:
        found = next((r for r in await self.records(tenant) if r.id == key_id), None)
        if found is None:
            return None
        if found.source == "config":
            raise KeyStoreError(
                f"Key {key_id} is written in the configuration (tenants.{tenant}.api_keys or the keys "
                "file): remove its hash there and reload.",
                code="key_not_revocable",
            )
        await self._change(lambda pipe: pipe.hdel(self.records_key, key_id))
        self._added.pop(found.key_hash, None)
        return found

    def snapshot(self) -> tuple[Mapping[str, str], frozenset[str]]:
        return dict(self._added), frozenset()

    async def _change(self, command: Callable[[Any], object]) -> None:
        """Run ``command`` on a transaction that also increments the version counter."""
        try:
            async with asyncio.timeout(self.timeout_s):
                pipe = self._client.pipeline(transaction=True)
                command(pipe)
                pipe.incr(self.version_key)
                result: Awaitable[Any] = pipe.execute()
                await result
        except Exception as exc:
            raise _unavailable(exc) from None

    async def close(self) -> None:
        """Close the client."""
        await self._client.aclose()


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _parse(key_id: str, value: object) -> KeyRecord | None:
    """A record from its stored JSON; ``None`` when it is not one."""
    try:
        data = json.loads(_text(value))
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("tenant"), str):
        return None
    key_hash, prefix, created = data.get("hash"), data.get("prefix"), data.get("created_at")
    if key_hash_problem(key_hash) is not None or not isinstance(key_hash, str):
        return None
    return KeyRecord(
        key_id,
        data["tenant"],
        prefix if isinstance(prefix, str) else None,
        key_hash.lower(),
        float(created) if isinstance(created, int | float) else None,
        "redis",
    )
