"""The sliding-window layers' own KV pool: a sliding layer keeps only its window's blocks.

Gemma 3 runs 5 of every 6 layers with a sliding window: a query at position p reads keys
p - window < j <= p. Those layers' K/V live in a second, smaller pool, and a sequence returns a
sliding block as soon as no query it will still run can read it.

Design (the simplest one that keeps the prefix cache, chunked prefill, preemption and speculative
decoding unchanged): the sliding pool is *slaved* to the global one. Each global block `b` that has
a sliding block maps to it (`g2s[b] = s`; 0 = none, block 0 of the sliding pool is a never-written
block of zeros). A sequence keeps its one block table; it holds a ref on the sliding blocks of its
logical blocks `sliding_start ..` only. So:
- a step's sliding-layer metadata is its global metadata with every block id mapped through `g2s`
  (`remap`): slots, decode tables, prefill tables. Out-of-window entries map to a block of zeros, or to
  another holder's still-valid copy of the same tokens, and the window mask (the C kernel's start
  offset, or the masked SDPA) never weighs them;
- releasing: before each allocation, the blocks wholly before `num_computed_tokens - window + 1` (the
  earliest key any query from then on reads) go back. Speculative rollback never goes below
  `num_computed_tokens` at scheduling time, so it never needs a released block;
- the prefix cache keys sliding blocks by their global block: a cached global block whose sliding
  block is still mapped is a sliding hit too. A global hit is cut to the longest prefix whose window
  (the blocks the first computed query reads) still has its sliding blocks; earlier ones need none;
- eviction: when a sliding block is handed out again, the mapping to its old global block is dropped;
  when a global block is handed out again, so is its old sliding block's.
A sequence thus holds about (window + the step's new tokens) / block_size + 1 sliding blocks however
long it runs; `worker/kv_sizing.pool_size` sizes the pool from that.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from tokenfab.engine.sequence import Sequence

NULL_BLOCK = 0      # the sliding pool's block of zeros: never allocated, never written


class SlidingBlocks:
    def __init__(self, num_blocks: int, block_size: int, window: int, num_global_blocks: int):
        """num_blocks: the sliding pool's size, the zero block included."""
        assert num_blocks >= 2 and window >= 1
        self.num_blocks, self.block_size, self.window = num_blocks, block_size, window
        self.ref_counts = [0] * num_blocks
        self.g2s = [NULL_BLOCK] * num_global_blocks
        self.g2s_t = torch.zeros(num_global_blocks, dtype=torch.long)   # the same, for remap
        self.s2g = [-1] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))

    # -- queries -----------------------------------------------------------------------------
    def num_used(self) -> int:
        return self.num_blocks - 1 - len(self.free)

    def first_needed(self, num_computed: int) -> int:
        """The first logical block a query at position >= num_computed may read."""
        return max(0, num_computed - self.window + 1) // self.block_size

    def held(self, seq: Sequence) -> int:
        return max(0, len(seq.block_table) - seq.sliding_start)

    def hit_length(self, cached: list[int]) -> int:
        """How many of the cached global blocks `cached` a sequence can take: the first query after
        them must find its window's sliding blocks."""
        k = len(cached)
        while k > 0 and any(self.g2s[cached[i]] == NULL_BLOCK for i in range(self.first_needed(k * self.block_size), k)):
            k -= 1
        return k

    def reclaimable(self, cached: list[int]) -> int:
        """Free sliding blocks a hit on `cached` would take back out of the free list."""
        lo = self.first_needed(len(cached) * self.block_size)
        return sum(1 for b in cached[lo:] if self.ref_counts[self.g2s[b]] == 0)

    # -- changes -----------------------------------------------------------------------------
    def _map(self, b: int, s: int) -> None:
        self.g2s[b] = s
        self.g2s_t[b] = s

    def take_cached(self, seq: Sequence, cached: list[int]) -> None:
        """`seq` (holding nothing yet) took the global prefix `cached`: ref their window's sliding blocks."""
        seq.sliding_start = self.first_needed(len(cached) * self.block_size)
        for b in cached[seq.sliding_start:]:
            s = self.g2s[b]
            assert s != NULL_BLOCK, "hit_length() must cut a hit whose window lost its sliding blocks"
            if self.ref_counts[s] == 0:
                del self.free[s]
            self.ref_counts[s] += 1

    def new_block(self, b: int) -> None:
        """Global block `b` was just handed to a sequence for new tokens: give it a sliding block."""
        old = self.g2s[b]
        if old != NULL_BLOCK and self.s2g[old] == b:   # b's previous contents are gone
            self.s2g[old] = -1
            self.free.move_to_end(old, last=False)
        s, _ = self.free.popitem(last=False)
        if self.s2g[s] >= 0 and self.g2s[self.s2g[s]] == s:
            self._map(self.s2g[s], NULL_BLOCK)          # evict: its old global block loses it
        self.s2g[s] = b
        self.ref_counts[s] = 1
        self._map(b, s)

    def _release(self, b: int, reusable: bool) -> None:
        s = self.g2s[b]
        self.ref_counts[s] -= 1
        assert self.ref_counts[s] >= 0
        if self.ref_counts[s] == 0:
            self.free[s] = None
            if not reusable:
                self.free.move_to_end(s, last=False)    # holds nothing a hit could use: hand it out first

    def release_out_of_window(self, seq: Sequence, cached_hash: list) -> None:
        """Return the sliding blocks no query of `seq` will read again."""
        end = min(self.first_needed(seq.num_computed_tokens), len(seq.block_table))
        for i in range(seq.sliding_start, end):
            b = seq.block_table[i]
            self._release(b, cached_hash[b] is not None)
        seq.sliding_start = max(seq.sliding_start, end)

    def release_tail(self, seq: Sequence, b: int) -> None:
        """The last block of `seq`'s table (global id b) is being dropped (speculative rollback)."""
        if len(seq.block_table) > seq.sliding_start:
            self._release(b, False)

    def release_all(self, seq: Sequence, cached_hash: list) -> None:
        """`seq` frees everything; the tail goes first into the eviction order, as in the global pool."""
        for b in reversed(seq.block_table[seq.sliding_start:]):
            self._release(b, cached_hash[b] is not None)
        seq.sliding_start = 0

    # -- the step's metadata -----------------------------------------------------------------
    def remap(self, meta):
        """The sliding layers' AttentionMetadata: `meta` with every global block id mapped to its
        sliding block."""
        from tokenfab.model.attention import AttentionMetadata, PrefillChunk
        g2s, bs = self.g2s_t.to(meta.slot_mapping.device), self.block_size
        slots = meta.slot_mapping
        return AttentionMetadata(
            slot_mapping=g2s[slots // bs] * bs + slots % bs,
            num_decode_tokens=meta.num_decode_tokens,
            decode_block_tables=None if meta.decode_block_tables is None else g2s[meta.decode_block_tables],
            decode_context_lens=meta.decode_context_lens,
            decode_max_context=meta.decode_max_context,
            prefills=[PrefillChunk(p.query_start, p.query_len, p.context_len, g2s[p.block_table])
                      for p in meta.prefills],
            positions=meta.positions)
