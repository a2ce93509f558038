"""vLLM V1's paged KV-cache block pool with automatic prefix caching, reduced to bookkeeping.

What it keeps of ``vllm/v1/core/block_pool.py`` and ``kv_cache_manager.py``:

* a full block of tokens is named by a chained hash: ``hash(parent block's hash, its token ids)``
  (:func:`block_hashes`), so two requests share a block only when every token before it matches;
  only full blocks are ever cached (a partial tail block never hits);
* a block is cached (its hash registered) once a step has scheduled every token of it; a second
  block with a hash already registered stays uncached, as vLLM keeps the first;
* freed blocks go to the tail of one free queue, a request's blocks in reverse order (its tail is
  evicted first); a new block is taken from the head of the queue, and a cached block taken so is
  evicted (its hash forgotten): least recently freed first;
* a hit takes a cached block out of the free queue (or shares a block still in use) and counts
  against the free blocks only when it was free.

Blocks are counted, not numbered: a run of uncached free blocks is one queue entry. The hash is
Python's tuple hash over ints (stable across runs and machines), standing in for vLLM's sha256:
collisions are as unlikely and nothing outside the emulator reads the values.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

#: A full block's chained hash.
BlockHash = int
#: The parent hash of a sequence's first block (vLLM's ``NONE_HASH``, here a fixed int).
ROOT_HASH: Final[BlockHash] = 0


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """The hash of one full block: its parent block's hash and its token ids."""
    return hash((parent, tuple(token_ids)))


def block_hashes(
    token_ids: Sequence[int], block_size: int, *, start: int = 0, parent: BlockHash = ROOT_HASH
) -> list[BlockHash]:
    """Chained hashes of the full blocks of ``token_ids[start:]`` (``start`` on a block boundary,
    ``parent`` the hash of the block before it); a partial last block gets none."""
    hashes: list[BlockHash] = []
    for begin in range(start, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[begin : begin + block_size])
        hashes.append(parent)
    return hashes


@dataclass(slots=True)
class BlockTable:
    """The blocks one request holds, in token order: a cached block's hash, or None (uncached)."""

    blocks: list[BlockHash | None] = field(default_factory=list)
    #: Leading blocks already offered to the cache (each full and scheduled once).
    num_offered: int = 0

    def __len__(self) -> int:
        return len(self.blocks)

    def cached_tokens_end(self, block_size: int) -> int:
        """Tokens up to the end of the last block of this table that is cached (0: none)."""
        for index in range(len(self.blocks) - 1, -1, -1):
            if self.blocks[index] is not None:
                return (index + 1) * block_size
        return 0


class BlockPool:
    """``num_blocks`` KV blocks of ``block_size`` tokens; with ``enable_caching`` full blocks are
    kept by hash after their request frees them, until the free queue hands them out again.

    Not thread-safe. Without caching it only counts blocks (every block is uncached).
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        #: Blocks no request holds (uncached, or cached and evictable).
        self.num_free = 0
        #: Every cached block (held or free) -> how many requests hold it.
        self._refs: dict[BlockHash, int] = {}
        #: The free queue, head first: seq -> a free cached block's hash, or None for a run of
        #: uncached free blocks whose length is ``_run_len[seq]``.
        self._queue: OrderedDict[int, BlockHash | None] = OrderedDict()
        self._run_len: dict[int, int] = {}
        #: Free cached block -> its seq in the queue.
        self._queued: dict[BlockHash, int] = {}
        self._seq = 0
        self._push_uncached(num_blocks)
        #: Cached blocks evicted so far (taken from the free queue for new data).
        self.num_evicted = 0

    # ------------------------------------------------------------------ introspection

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens of KV."""
        return math.ceil(num_tokens / self.block_size)

    @property
    def usage(self) -> float:
        """Share of blocks held by requests, 0-1 (vLLM's ``kv_cache_usage_perc``: a cached block
        no request holds counts as free)."""
        return 1.0 - self.num_free / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose hash is registered, held or free."""
        return len(self._refs)

    @property
    def num_free_cached_blocks(self) -> int:
        """Cached blocks no request holds: evictable, and hits for whoever asks first."""
        return len(self._queued)

    def is_cached(self, block_hash: BlockHash) -> bool:
        return block_hash in self._refs

    # ------------------------------------------------------------------ hits, allocation, freeing

    def find_hit(self, hashes: Sequence[BlockHash], max_tokens: int) -> list[BlockHash]:
        """The longest run of cached blocks at the start of ``hashes`` covering at most
        ``max_tokens`` tokens (vLLM passes ``num_tokens - 1``: the last token is always computed)."""
        if not self.enable_caching:
            return []
        hit: list[BlockHash] = []
        for block_hash in hashes[: max_tokens // self.block_size]:
            if block_hash not in self._refs:
                break
            hit.append(block_hash)
        return hit

    def allocate(self, table: BlockTable, num_tokens: int, hit: Sequence[BlockHash] = ()) -> bool:
        """Grow ``table`` to hold ``num_tokens`` tokens, first taking the ``hit`` blocks (from
        :meth:`find_hit`, appended to an empty table). False, and nothing taken, when the free
        blocks do not cover the new ones plus the hit blocks that are free."""
        need = self.blocks_for(num_tokens) - len(table) - len(hit)
        free_hits = sum(1 for h in hit if h in self._queued)
        if max(need, 0) + free_hits > self.num_free:
            return False
        if hit:
            for block_hash in hit:
                self._touch(block_hash)
            table.blocks.extend(hit)
            table.num_offered = len(table.blocks)
        if need > 0:
            self._pop_free(need)
            table.blocks.extend([None] * need)
        return True

    def cache_blocks(self, table: BlockTable, hashes: Sequence[BlockHash], num_tokens: int) -> None:
        """Register the blocks of ``table`` that the first ``num_tokens`` tokens fill (``hashes``:
        the request's full-block hashes); a hash already cached leaves that block uncached."""
        if not self.enable_caching:
            return
        end = min(num_tokens // self.block_size, len(hashes), len(table.blocks))
        for index in range(table.num_offered, end):
            block_hash = hashes[index]
            if table.blocks[index] is None and block_hash not in self._refs:
                self._refs[block_hash] = 1
                table.blocks[index] = block_hash
        table.num_offered = max(table.num_offered, end)

    def free(self, table: BlockTable) -> None:
        """Return every block of ``table``, tail first, to the tail of the free queue."""
        for block_hash in reversed(table.blocks):
            if block_hash is None:
                self._push_uncached(1)
                continue
            refs = self._refs[block_hash] - 1
            self._refs[block_hash] = refs
            if refs == 0:
                self._seq += 1
                self._queue[self._seq] = block_hash
                self._queued[block_hash] = self._seq
                self.num_free += 1
        table.blocks.clear()
        table.num_offered = 0

    # ------------------------------------------------------------------ the free queue

    def _touch(self, block_hash: BlockHash) -> None:
        """One more holder of a cached block; a free one leaves the free queue."""
        seq = self._queued.pop(block_hash, None)
        if seq is not None:
            del self._queue[seq]
            self.num_free -= 1
        self._refs[block_hash] += 1

    def _push_uncached(self, count: int) -> None:
        if count <= 0:
            return
        self.num_free += count
        if self._queue:
            last = next(reversed(self._queue))
            if self._queue[last] is None:
                self._run_len[last] += count
                return
        self._seq += 1
        self._queue[self._seq] = None
        self._run_len[self._seq] = count

    def _pop_free(self, count: int) -> None:
        """Take ``count`` blocks from the head of the free queue, evicting cached ones."""
        self.num_free -= count
        while count > 0:
            seq, block_hash = next(iter(self._queue.items()))
            if block_hash is None:
                run = self._run_len[seq]
                taken = min(run, count)
                if taken == run:
                    del self._queue[seq]
                    del self._run_len[seq]
                else:
                    self._run_len[seq] = run - taken
                count -= taken
                continue
            del self._queue[seq]
            del self._queued[block_hash]
            del self._refs[block_hash]
            self.num_evicted += 1
            count -= 1
