"""What a replica's automatic prefix cache probably holds: a bounded index of prompt-prefix blocks.

A prompt is cut into fixed blocks of its UTF-8 bytes, each named by a chained hash (the hash of
every byte before its end, seeded with the model), as vLLM names its KV blocks by their token
ids and every token before them: two prompts share a block only when everything up to its end
matches (``prefix_key``). The gateway never sees the replica's blocks, so ``PrefixIndex`` keeps
what its own dispatches put there, weighs each block by the prompt tokens it stands for, and
forgets the least recently used beyond the replica's KV capacity (vLLM reuses the least recently
freed blocks, a request's tail first); a replica's answer saying fewer tokens were cached than
expected trims the blocks it no longer has (``PrefixIndex.trim``).

Hashes are blake2b (8 bytes), stable across processes and hosts, so gateways can compare them.
Pure: no I/O, no clock.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Final

__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "DEFAULT_MAX_BLOCKS",
    "PrefixIndex",
    "PrefixKey",
    "blocks_for_tokens",
    "expected_hit_tokens",
    "prefix_key",
]

#: Bytes of prompt text per block: about 64 tokens of English, a few of vLLM's blocks.
DEFAULT_BLOCK_BYTES: Final = 256
#: Most blocks hashed per prompt (1 MiB of text at the default block size): a longer prompt's
#: tail is not indexed, so it never counts as a hit.
DEFAULT_MAX_BLOCKS: Final = 4096


@dataclass(frozen=True, slots=True)
class PrefixKey:
    """A prompt's leading full blocks, by chained hash, and the prompt tokens each stands for.

    ``hashes``: one per full block of ``block_bytes`` bytes, in order (a partial tail block has
    none). ``tokens_per_block`` (> 0): the prompt's tokens per block, its token count times the
    block size over its byte length: what a matched block saves of prefill."""

    hashes: tuple[int, ...]
    tokens_per_block: float

    def tokens(self, blocks: int) -> int:
        """Prompt tokens the first ``blocks`` blocks stand for (rounded down)."""
        return int(blocks * self.tokens_per_block)


def prefix_key(
    text: str,
    prompt_tokens: int,
    *,
    seed: str = "",
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    max_blocks: int = DEFAULT_MAX_BLOCKS,
) -> PrefixKey | None:
    """The ``PrefixKey`` of a prompt whose text (as the engine will see it, or any rendering in
    which a shared prefix stays a shared prefix) is ``text`` and whose size is ``prompt_tokens``
    (counted or estimated, >= 1). ``seed`` (the model) starts the chain, so two models never share
    a block. ``None`` when the prompt has no full block."""
    if block_bytes < 1 or max_blocks < 1:
        raise ValueError(f"block_bytes and max_blocks must be >= 1, got {block_bytes}, {max_blocks}")
    data = text[: block_bytes * max_blocks].encode("utf-8", "surrogatepass")
    full = min(len(data) // block_bytes, max_blocks)
    if full == 0 or prompt_tokens < 1:
        return None
    total_bytes = max(len(data), len(text))  # a prompt longer than the indexed text: no more
    h = hashlib.blake2b(seed.encode("utf-8", "surrogatepass"), digest_size=8)
    hashes: list[int] = []
    view = memoryview(data)
    for begin in range(0, full * block_bytes, block_bytes):
        h.update(view[begin : begin + block_bytes])
        hashes.append(int.from_bytes(h.copy().digest(), "little"))
    tokens_per_block = prompt_tokens * block_bytes / total_bytes
    return PrefixKey(tuple(hashes), tokens_per_block)


class PrefixIndex:
    """One replica's prefix cache as the gateway believes it: block hash -> tokens it holds.

    ``capacity_tokens`` (>= 0): the replica's KV capacity in tokens; blocks beyond it are
    forgotten least recently used first. Not thread-safe.
    """

    __slots__ = ("_blocks", "_tokens", "capacity_tokens")

    def __init__(self, capacity_tokens: float) -> None:
        self.capacity_tokens = max(0.0, capacity_tokens)
        #: Least recently used first.
        self._blocks: OrderedDict[int, float] = OrderedDict()
        self._tokens = 0.0

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def tokens(self) -> float:
        """Prompt tokens the indexed blocks stand for."""
        return self._tokens

    def match(self, key: PrefixKey) -> int:
        """How many of ``key``'s leading blocks are indexed (a miss ends the match, as a chained
        hash would); does not count as a use."""
        blocks = self._blocks
        n = 0
        for h in key.hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def insert(self, key: PrefixKey) -> None:
        """``key``'s blocks are now cached there (its prompt was sent): each becomes the most
        recently used, the first block most of all (a request's tail is evicted first), and the
        least recently used beyond the capacity are forgotten."""
        blocks = self._blocks
        weight = key.tokens_per_block
        for h in reversed(key.hashes):
            old = blocks.pop(h, None)
            if old is not None:
                self._tokens -= old
            blocks[h] = weight
            self._tokens += weight
        self._evict()

    def trim(self, key: PrefixKey, kept_blocks: int) -> int:
        """The replica said only ``kept_blocks`` of ``key``'s leading blocks were cached: forget
        the indexed ones after them (it has evicted them). Returns how many were forgotten."""
        forgotten = 0
        blocks = self._blocks
        for h in key.hashes[max(0, kept_blocks) :]:
            old = blocks.pop(h, None)
            if old is not None:
                self._tokens -= old
                forgotten += 1
        if not blocks:
            self._tokens = 0.0
        return forgotten

    def resize(self, capacity_tokens: float) -> None:
        """Set the capacity (tokens, >= 0) and forget what no longer fits."""
        self.capacity_tokens = max(0.0, capacity_tokens)
        self._evict()

    def clear(self) -> None:
        """Forget every block (the replica restarted, or its cache was reset)."""
        self._blocks.clear()
        self._tokens = 0.0

    def _evict(self) -> None:
        blocks = self._blocks
        while blocks and self._tokens > self.capacity_tokens + 1e-9:
            _, weight = blocks.popitem(last=False)
            self._tokens -= weight
        if not blocks:
            self._tokens = 0.0


def expected_hit_tokens(
    key: PrefixKey | None, index: PrefixIndex | None, prompt_tokens: int, realized: float = 1.0
) -> int:
    """Prompt tokens a request with ``key`` should find cached on a replica with ``index``: its
    matched blocks' tokens times ``realized`` (the share of expected hits the replica has been
    delivering, in [0, 1]), at most ``prompt_tokens - 1`` (an engine always computes the last
    token). 0 without a key or an index."""
    if key is None or index is None or prompt_tokens <= 1:
        return 0
    blocks = index.match(key)
    if blocks == 0:
        return 0
    tokens = key.tokens(blocks) * min(1.0, max(0.0, realized))
    return min(prompt_tokens - 1, math.floor(tokens))


def blocks_for_tokens(key: PrefixKey, tokens: int) -> int:
    """How many of ``key``'s leading blocks ``tokens`` cached prompt tokens cover (rounded down)."""
    if tokens <= 0:
        return 0
    return min(len(key.hashes), int(tokens / key.tokens_per_block + 1e-9))
