"""Prompts that share prefixes exactly where a trace's block ids say (Mooncake's ``hash_ids``).

A trace names each request's prompt by ids of ``HASH_BLOCK_TOKENS``-token blocks: two requests'
prompts agree on their first k blocks exactly when their first k ids are equal. This module
builds, deterministically from the ids alone, the two renderings of such a prompt the replay
needs:

* ``prompt_token_ids``: what the emulated engine prefills and hashes into its prefix cache
  (``simulator.engine.Engine.add_request(..., prompt_token_ids=...)``): block id h becomes
  ``HASH_BLOCK_TOKENS`` token ids drawn from h (SHAKE-128 of h, two bytes a token, so below
  65,536, inside any served vocabulary of at least that size);
* ``prompt_text``: what the gateway sees (``AdmissionEngine.request(..., prompt_text=...)``):
  block id h becomes one fixed ASCII chunk drawn from h, of about ``CHARS_PER_TOKEN`` characters
  per token (the chunk's own ratio is drawn from h, log-normal with log-space spread
  ``TEXT_SPREAD``, as a real tokeniser's ratio varies with the text).

A prompt shorter than its blocks cover ends part-way into its last block (that block's first
tokens, or the proportional share of its characters); a prompt longer than its blocks cover
(no Mooncake request is) ends in a tail unique to ``tail_key``. Pure; blocks are cached.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from functools import lru_cache
from typing import Final

__all__ = [
    "CHARS_PER_TOKEN",
    "HASH_BLOCK_TOKENS",
    "TEXT_SPREAD",
    "TOKEN_ID_LIMIT",
    "block_text",
    "block_token_ids",
    "prompt_text",
    "prompt_token_ids",
]

#: Tokens per block id (Mooncake's trace: 512).
HASH_BLOCK_TOKENS: Final = 512
#: Median characters per token of the text rendering.
CHARS_PER_TOKEN: Final = 4.0
#: Log-space standard deviation of a block's characters per token.
TEXT_SPREAD: Final = 0.2
#: Token ids are below this (two bytes each).
TOKEN_ID_LIMIT: Final = 1 << 16
#: Blocks kept built (a replay of a few thousand long prompts touches tens of thousands).
_CACHED_BLOCKS: Final = 1 << 16
_ALPHABET: Final = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:-_()"


@lru_cache(maxsize=_CACHED_BLOCKS)
def block_token_ids(block_id: int | str) -> tuple[int, ...]:
    """The ``HASH_BLOCK_TOKENS`` token ids (each in [0, 65536)) of block ``block_id``."""
    data = hashlib.shake_128(f"block:{block_id}".encode()).digest(2 * HASH_BLOCK_TOKENS)
    return tuple(int.from_bytes(data[i : i + 2], "little") for i in range(0, len(data), 2))


@lru_cache(maxsize=_CACHED_BLOCKS)
def block_text(block_id: int | str) -> str:
    """The text of block ``block_id``: ASCII, ``HASH_BLOCK_TOKENS`` x its own characters per token
    (median ``CHARS_PER_TOKEN``, see the module) characters, at least one per token."""
    ratio = CHARS_PER_TOKEN * math.exp(TEXT_SPREAD * random.Random(f"ratio:{block_id}").gauss(0.0, 1.0))
    n = max(HASH_BLOCK_TOKENS, round(HASH_BLOCK_TOKENS * ratio))
    data = hashlib.shake_128(f"text:{block_id}".encode()).digest(n)
    return "".join(_ALPHABET[b % len(_ALPHABET)] for b in data)


def _blocks(hash_ids: Sequence[int], tokens: int, tail_key: str) -> list[tuple[int | str, int]]:
    """(block id, tokens of it in the prompt) for a ``tokens``-token prompt named ``hash_ids``."""
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    out: list[tuple[int | str, int]] = []
    left = tokens
    for h in hash_ids:
        if left <= 0:
            break
        take = min(left, HASH_BLOCK_TOKENS)
        out.append((h, take))
        left -= take
    k = 0
    while left > 0:  # beyond the named blocks: a tail no other request shares
        take = min(left, HASH_BLOCK_TOKENS)
        out.append((f"tail:{tail_key}:{k}", take))
        left -= take
        k += 1
    return out


def prompt_token_ids(hash_ids: Sequence[int], tokens: int, *, tail_key: str = "") -> list[int]:
    """The ``tokens`` token ids of a prompt named ``hash_ids`` (see the module); ``tail_key``
    (unique per request) names its tail beyond the named blocks."""
    ids: list[int] = []
    for block, take in _blocks(hash_ids, tokens, tail_key):
        ids.extend(block_token_ids(block)[:take])
    return ids


def prompt_text(hash_ids: Sequence[int], tokens: int, *, tail_key: str = "") -> str:
    """The text of a ``tokens``-token prompt named ``hash_ids`` (see the module): each block's
    chunk, the last one cut to its share of tokens (at least one character)."""
    parts: list[str] = []
    for block, take in _blocks(hash_ids, tokens, tail_key):
        chunk = block_text(block)
        if take < HASH_BLOCK_TOKENS:
            chunk = chunk[: max(1, len(chunk) * take // HASH_BLOCK_TOKENS)]
        parts.append(chunk)
    return "".join(parts)
