"""API key hashes: how a key is hashed, what a stored hash looks like, and how secrets are shown.

Sluice never stores an API key, only ``sha256:<64 lower-case hex digits>`` of its UTF-8 bytes
(unsalted, as for any long random token: docs/tenants.md). ``Redacted`` stands in for a secret
wherever a value would otherwise be shown (configuration errors).
"""

from __future__ import annotations

import hashlib
import re
from typing import Final

__all__ = [
    "KEY_HASH_PREFIX",
    "REDACTED",
    "Redacted",
    "hash_api_key",
    "hash_digest",
    "key_digest",
    "key_hash_problem",
    "normalise_key_hash",
]

KEY_HASH_PREFIX: Final = "sha256:"
_HASH: Final = re.compile(r"^sha256:[0-9a-fA-F]{64}$")
#: What a key may contain: visible ASCII (RFC 9110 header value, RFC 6750 token68 and more).
_KEY: Final = re.compile(r"^[\x21-\x7e]+$")


class Redacted:
    """A secret's stand-in: ``repr`` and ``str`` are ``<redacted>`` (the value is not kept)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<redacted>"

    __str__ = __repr__


REDACTED: Final = Redacted()


def hash_api_key(key: str) -> str:
    """The stored form of ``key``: ``sha256:`` + the hex SHA-256 of its UTF-8 bytes (71 characters).

    This is what ``sluice hash-key`` prints and what ``api_keys`` and the keys file hold.
    ``ValueError`` (without the key in its message) when ``key`` is empty or holds anything but
    visible ASCII (spaces included): such a key could not travel in an ``Authorization`` header.
    """
    if not is_valid_key(key):
        raise ValueError("an API key must be non-empty visible ASCII, without spaces")
    return KEY_HASH_PREFIX + hashlib.sha256(key.encode()).hexdigest()


def is_valid_key(key: str) -> bool:
    """Whether ``key`` can be an API key: non-empty visible ASCII (no spaces, no control characters)."""
    return bool(_KEY.match(key))


def key_digest(key: str) -> bytes:
    """The 32-byte SHA-256 digest of a presented key (the bytes ``hash_api_key`` writes as hex)."""
    return hashlib.sha256(key.encode()).digest()


def hash_digest(key_hash: str) -> bytes:
    """The 32-byte digest a valid stored hash (``sha256:<hex>``, any case) stands for."""
    return bytes.fromhex(key_hash.removeprefix(KEY_HASH_PREFIX))


def key_hash_problem(value: object) -> str | None:
    """Why ``value`` is not a stored key hash, as one line for the operator; ``None`` when it is."""
    if not isinstance(value, str):
        return f"should be a key hash string ({KEY_HASH_PREFIX}<64 hex digits>)"
    if _HASH.match(value):
        return None
    if value.startswith(KEY_HASH_PREFIX):
        return f"not a key hash: expected {KEY_HASH_PREFIX} followed by 64 hex digits"
    return (
        f"looks like a plaintext API key; only hashes are stored: run `sluice hash-key` and put the "
        f"{KEY_HASH_PREFIX}<64 hex digits> it prints here instead"
    )


def normalise_key_hash(value: str) -> str:
    """A valid stored hash in its canonical form (lower-case hex)."""
    return value.lower()
