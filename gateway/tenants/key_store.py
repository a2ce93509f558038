"""API keys issued, listed and revoked while the gateway runs: the records and the file store.

A ``KeyRecord`` is what is kept of a key: an id (``key_`` + 16 hex digits), its tenant, its
``prefix`` (the first ``PREFIX_CHARS`` characters of the secret, for people to tell keys apart),
its ``sha256:`` hash (``hash_api_key``) and when it was issued; never the secret, which
``new_secret`` makes and the issuer shows once. Keys written by hand (``api_keys`` in the YAML,
plain hashes in the keys file) are listed too, with an id derived from their hash and no prefix.

``FileKeyStore`` keeps issued keys in the keys file (``tenants.keys_file``) as mappings beside
the hand-written hashes, rewriting it atomically (a temporary file in the same directory, then
``os.replace``); the Redis store (``gateway.tenants.redis_keys``) keeps them in Redis for every
gateway. ``KeyStore`` is what the admin API needs of either. Nothing here logs or shows a secret.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import secrets
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, Protocol

import yaml

from gateway.config.source import ConfigError
from gateway.tenants.config import TenantsSettings
from gateway.tenants.keys import hash_api_key, normalise_key_hash
from gateway.tenants.keys_file import KEY_ID, load_keys_file

__all__ = [
    "KEY_ID",
    "PREFIX_CHARS",
    "SECRET_PREFIX",
    "FileKeyStore",
    "KeyRecord",
    "KeyStore",
    "KeyStoreError",
    "configured_records",
    "derived_id",
    "issued_record",
    "new_key_id",
    "new_secret",
]

#: How every issued secret starts (then 43 characters of URL-safe base64: 256 random bits).
SECRET_PREFIX: Final = "sk-sluice-"
#: Characters of a secret kept and shown as its prefix (the fixed start and 4 random ones).
PREFIX_CHARS: Final = len(SECRET_PREFIX) + 4

Source = Literal["config", "keys_file", "redis"]


class KeyStoreError(Exception):
    """A key change the store cannot make; ``status`` and ``code`` say how the API answers it
    (409 ``keys_not_writable``: no store for issued keys; 409 ``key_not_revocable``: a key
    written by hand in the configuration; 409 ``keys_file_invalid``; 503 ``keys_unavailable``:
    Redis did not answer)."""

    def __init__(self, message: str, *, status: int = 409, code: str = "keys_not_writable") -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """One API key as stored (never its secret). ``created_at``: Unix seconds; ``None`` for a key
    written by hand. ``source``: where it is kept (``config``: ``api_keys`` in the YAML)."""

    id: str
    tenant: str
    prefix: str | None
    key_hash: str = field(repr=False)
    created_at: float | None
    source: Source

    def public(self) -> dict[str, Any]:
        """The record as the API and the CLI show it: no secret, no hash."""
        return {
            "id": self.id,
            "object": "api_key",
            "tenant": self.tenant,
            "prefix": self.prefix,
            "created_at": self.created_at,
            "source": self.source,
        }

    def stored(self) -> dict[str, Any]:
        """The mapping the keys file and Redis hold for an issued key."""
        return {
            "id": self.id,
            "prefix": self.prefix,
            "hash": self.key_hash,
            "created_at": self.created_at,
        }


def new_secret() -> str:
    """A fresh API key: ``SECRET_PREFIX`` + 256 random bits, URL-safe base64."""
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def new_key_id() -> str:
    """A fresh key id (``KEY_ID``)."""
    return "key_" + secrets.token_hex(8)


def derived_id(key_hash: str) -> str:
    """The id of a key written by hand: from a hash of its hash, so it shows neither."""
    return "key_" + hashlib.sha256(normalise_key_hash(key_hash).encode()).hexdigest()[:16]


def issued_record(tenant: str, secret: str, source: Source, now: float) -> KeyRecord:
    """The record of ``secret``, issued to ``tenant`` at ``now`` (Unix seconds)."""
    return KeyRecord(new_key_id(), tenant, secret[:PREFIX_CHARS], hash_api_key(secret), round(now, 3), source)


def configured_records(settings: TenantsSettings, skip: frozenset[str] = frozenset()) -> list[KeyRecord]:
    """The keys of ``settings``' ``api_keys`` (the keys file's already merged in) whose hashes are
    not in ``skip``, as hand-written records (``config``)."""
    return [
        KeyRecord(derived_id(h), name, None, h, None, "config")
        for name, tenant in settings.tenants.items()
        for h in tenant.api_keys
        if h not in skip
    ]


class KeyStore(Protocol):
    """Where issued keys live; what the admin API and the gateway's authentication need.

    ``issue`` and ``revoke`` raise ``KeyStoreError`` for a change the store cannot make.
    ``snapshot`` is the keys to authenticate with beyond the configuration's: (hash -> tenant
    of every key the store holds, hashes of configured keys it revoked).
    """

    async def issue(self, tenant: str) -> tuple[KeyRecord, str]: ...

    async def records(self, tenant: str) -> list[KeyRecord]: ...

    async def revoke(self, tenant: str, key_id: str) -> KeyRecord | None: ...

    def snapshot(self) -> tuple[Mapping[str, str], frozenset[str]]: ...


# -- the keys file -----------------------------------------------------------------------------------


def _entry_hash(item: object) -> str | None:
    """The hash of one keys-file entry (a hash string, or an issued key's mapping); ``None`` when
    it is neither (the loader reports why)."""
    if isinstance(item, str):
        return normalise_key_hash(item)
    if isinstance(item, dict) and isinstance(item.get("hash"), str):
        return normalise_key_hash(item["hash"])
    return None


def file_records(data: object, tenants: Mapping[str, object]) -> list[KeyRecord]:
    """The records of parsed (already validated) keys-file ``data``, for tenants in ``tenants``."""
    if not isinstance(data, dict):
        return []
    found: list[KeyRecord] = []
    for name, items in data.items():
        if name not in tenants or not isinstance(items, list):
            continue
        for item in items:
            key_hash = _entry_hash(item)
            if key_hash is None:
                continue
            if isinstance(item, dict):
                created = item.get("created_at")
                found.append(
                    KeyRecord(
                        str(item.get("id") or derived_id(key_hash)),
                        name,
                        item.get("prefix") if isinstance(item.get("prefix"), str) else None,
                        key_hash,
                        float(created) if isinstance(created, int | float) else None,
                        "keys_file",
                    )
                )
            else:
                found.append(KeyRecord(derived_id(key_hash), name, None, key_hash, None, "keys_file"))
    return found


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` in one step: a temporary file in the same directory, flushed
    to disk, then renamed over it (keeping the old file's permissions, 0600 for a new one)."""
    mode = 0o600
    with contextlib.suppress(FileNotFoundError):
        mode = path.stat().st_mode & 0o777
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


class FileKeyStore:
    """Issued keys in the keys file (``path``), for a single gateway (see the module docstring).

    ``settings()``: the current tenants settings (the keys file is validated against them).
    ``path`` ``None``: no keys file is configured, so ``issue`` and ``revoke`` are refused with
    what to set. Changes are serialised in this process; the file is re-read before each one,
    so hand edits made meanwhile are kept.
    """

    def __init__(
        self,
        path: Path | None,
        settings: Callable[[], TenantsSettings],
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self._settings = settings
        self._clock = clock
        self._lock = asyncio.Lock()
        #: hash -> tenant of every key in the file as last read or written.
        self._added: dict[str, str] = {}
        #: Hashes this store removed from the file (the loaded configuration may still hold them).
        self._revoked: set[str] = set()
        if path is not None and path.exists():
            self._added = {r.key_hash: r.tenant for r in self._file_records()}

    def __repr__(self) -> str:
        return f"FileKeyStore({self.path})"

    def _read(self) -> dict[str, Any]:
        """The keys file, validated against the configured tenants (``{}`` when it does not exist).

        Its hashes are in the loaded settings already (merged at load), so repeats across the
        file and ``api_keys`` are left to the next load to find."""
        assert self.path is not None
        if not self.path.exists():
            return {}
        settings = self._settings()
        bare = {name: t.model_copy(update={"api_keys": []}) for name, t in settings.tenants.items()}
        load_keys_file(self.path, settings.model_copy(update={"tenants": bare}))
        data = yaml.safe_load(self.path.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}

    def _file_records(self) -> list[KeyRecord]:
        try:
            return file_records(self._read(), self._settings().tenants)
        except ConfigError as exc:
            raise KeyStoreError(f"The keys file is invalid: {exc}", code="keys_file_invalid") from None

    def _writable(self) -> Path:
        if self.path is None:
            raise KeyStoreError(
                "Keys can only be issued where they can be kept: set tenants.keys_file (one gateway) "
                "or limits.backend: redis (every gateway).",
            )
        return self.path

    def _write(self, data: dict[str, Any]) -> None:
        path = self._writable()
        header = "# API key hashes per tenant; entries with an id were issued by `sluice keys`.\n"
        write_atomically(path, header + yaml.safe_dump(data, sort_keys=False, default_flow_style=False))
        self._added = {r.key_hash: r.tenant for r in file_records(data, self._settings().tenants)}

    async def issue(self, tenant: str) -> tuple[KeyRecord, str]:
        self._writable()
        async with self._lock:
            self._file_records()  # validates the file: KeyStoreError when it is invalid
            data = self._read()
            secret = new_secret()
            record = issued_record(tenant, secret, "keys_file", self._clock())
            entries = data.get(tenant)
            data[tenant] = [*(entries if isinstance(entries, list) else []), record.stored()]
            self._write(data)
            return record, secret

    async def records(self, tenant: str) -> list[KeyRecord]:
        in_file = self._file_records() if self.path is not None else []
        skip = frozenset(r.key_hash for r in in_file) | frozenset(self._revoked)
        configured = configured_records(self._settings(), skip)
        return [r for r in (*configured, *in_file) if r.tenant == tenant]

    async def revoke(self, tenant: str, key_id: str) -> KeyRecord | None:
        async with self._lock:
            records = await self.records(tenant)
            found = next((r for r in records if r.id == key_id), None)
            if found is None:
                return None
            if found.source == "config":
                raise KeyStoreError(
                    f"Key {key_id} is written in the configuration (tenants.{tenant}.api_keys): remove "
                    "its hash there and reload.",
                    code="key_not_revocable",
                )
            data = self._read()
            entries = data.get(tenant)
            kept = (
                [e for e in entries if _entry_hash(e) != found.key_hash] if isinstance(entries, list) else []
            )
            if kept:
                data[tenant] = kept
            else:
                data.pop(tenant, None)
            self._write(data)
            self._revoked.add(found.key_hash)
            return found

    def snapshot(self) -> tuple[Mapping[str, str], frozenset[str]]:
        return dict(self._added), frozenset(self._revoked)
