"""BlockManager: the paged KV pool's bookkeeping (which block holds which tokens), not the tensors.

- Fixed-size blocks; sequences own lists of block ids; ref counts let sequences share blocks.
- Prefix caching: every full block is registered under hash(parent_hash, its token ids). A new
  sequence reuses the longest chain of registered blocks; each hit is verified token by token
  (a hash collision must never serve wrong K/V).
- Freed blocks keep their hash and stay reusable until evicted, least recently freed first.
- Invariant: with no sequence alive, every block has ref count 0 (`num_used_blocks() == 0`).
- `hash_seed`: the chain's first parent (None, or engine/kv_connector.key_seed when a KV connector
  shares the hashes as keys); `newly_full`, when a list, collects (hash, block) of each block registered.
- `sliding` (engine/sliding_kv.py): the sliding-window layers' smaller pool, slaved to this one; a
  sequence returns its out-of-window sliding blocks as it advances.
"""
from __future__ import annotations

from collections import OrderedDict

from tokenfab.engine.sequence import Sequence
from tokenfab.engine.sliding_kv import SlidingBlocks


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding: SlidingBlocks | None = None):
        assert num_blocks > 0 and block_size > 0
        self.sliding = sliding
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        # Blocks with ref count 0, in eviction order (front = evicted first). Values unused.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        # Blocks ever handed out. The pool is reserved, not written, at start, so its pages become resident as
        # blocks are first used; and a block, once freed, keeps its prefix-cache contents until the blocks
        # never used are gone (the free order above), so a long-running server's RSS climbs until the whole
        # pool has been used once. A soak subtracts this to see memory growing anywhere else.
        self.touched = bytearray(num_blocks)
        self.num_touched = 0
        self.hash_to_block: dict[int, int] = {}
        self.hash_seed: int | None = None
        self.newly_full: list[tuple[int, int]] | None = None   # a KV connector's blocks to save, when set
        # Prefix-cache statistics, in tokens, as vLLM counts them.
        self.prefix_queries = 0
        self.prefix_hits = 0

    # -- queries -----------------------------------------------------------------------------
    def num_free_blocks(self) -> int:
        return len(self.free)

    def num_used_blocks(self) -> int:
        """Blocks held, the sliding pool's included (0 once every sequence is gone)."""
        return self.num_blocks - len(self.free) + (self.sliding.num_used() if self.sliding else 0)

    def usage(self) -> float:
        return (self.num_blocks - len(self.free)) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache ------------------------------------------------------------------------
    @staticmethod
    def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
        return hash((parent, tokens))

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks holding the longest cached prefix of `seq`, leaving at least one token to compute."""
        if seq.needs_prompt_logprobs:
            return []   # cached K/V would skip the positions whose logits score the prompt
        return self.cached_blocks(seq.token_ids)

    def cached_blocks(self, token_ids: list[int]) -> list[int]:
        """The cached full blocks a sequence of `token_ids` would reuse (at least one token left to
        compute). Read-only: the SLO admission also calls it from the server's event loop while the
        engine thread steps; a block evicted meanwhile only makes the answer stale."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs   # at least one token must run to produce logits
        blocks: list[int] = []
        parent = self.hash_seed
        for i in range(max_blocks):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = self.chain_hash(parent, tokens)
            b = self.hash_to_block.get(h)
            if b is None or self.block_tokens[b] != tokens:
                break
            blocks.append(b)
            parent = h
        if self.sliding is not None:      # the window before the first computed token must still be there
            blocks = blocks[:self.sliding.hit_length(blocks)]
        return blocks

    def prefix_hashes(self, token_ids: list[int], cached: list[int]) -> list[int]:
        """The chain hashes of the full blocks of `token_ids` after the `cached` ones, leaving at least one
        token to compute (what a KV connector is asked for)."""
        bs = self.block_size
        parent = self.block_hash[cached[-1]] if cached else self.hash_seed
        hashes = []
        for i in range(len(cached), (len(token_ids) - 1) // bs):
            parent = self.chain_hash(parent, tuple(token_ids[i * bs:(i + 1) * bs]))
            hashes.append(parent)
        return hashes

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that `seq` has completely computed since the last call."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        parent = seq.block_hashes[-1] if seq.block_hashes else self.hash_seed
        for i in range(len(seq.block_hashes), full):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = self.chain_hash(parent, tokens)
            b = seq.block_table[i]
            if self.block_hash[b] is None and h not in self.hash_to_block:
                self.block_hash[b], self.block_tokens[b] = h, tokens
                self.hash_to_block[h] = b
            if self.newly_full is not None:
                self.newly_full.append((h, b))
            seq.block_hashes.append(h)
            parent = h

    # -- allocation --------------------------------------------------------------------------
    def can_admit(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> bool:
        """Would `allocate(seq, num_new_tokens, cached)` succeed?"""
        needed = self.blocks_needed(seq.num_computed_tokens + len(cached) * self.block_size + num_new_tokens)
        needed -= len(seq.block_table) + len(cached)
        reclaimable_cached = sum(1 for b in cached if self.ref_counts[b] == 0)  # free now, taken by the hit
        if self.sliding is not None and needed + self.sliding.reclaimable(cached) > len(self.sliding.free):
            return False
        return needed + reclaimable_cached <= len(self.free)

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] = ()) -> bool:
        """Give `seq` blocks for `num_new_tokens` more tokens (after taking `cached` prefix blocks).

        Returns False, changing nothing but returning out-of-window sliding blocks, when the pool is short.
        """
        if self.sliding is not None:
            self.sliding.release_out_of_window(seq, self.block_hash)
        if not self.can_admit(seq, list(cached), num_new_tokens):
            return False
        if self.sliding is not None and cached:
            self.sliding.take_cached(seq, list(cached))
        for b in cached:
            if self.ref_counts[b] == 0:
                del self.free[b]
            self.ref_counts[b] += 1
            seq.block_table.append(b)
            seq.block_hashes.append(self.block_hash[b])
        target = self.blocks_needed(seq.num_computed_tokens + len(cached) * self.block_size + num_new_tokens)
        while len(seq.block_table) < target:
            b, _ = self.free.popitem(last=False)
            if not self.touched[b]:
                self.touched[b] = 1
                self.num_touched += 1
            if self.block_hash[b] is not None:   # evict its cached contents
                del self.hash_to_block[self.block_hash[b]]
                self.block_hash[b] = self.block_tokens[b] = None
            self.ref_counts[b] = 1
            seq.block_table.append(b)
            if self.sliding is not None:
                self.sliding.new_block(b)
        return True

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free the blocks past the first `num_tokens` tokens' (rejected draft tokens' blocks). They
        were never registered in the prefix cache: only fully computed, accepted blocks are."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_table) > keep:
            if self.sliding is not None:
                self.sliding.release_tail(seq, seq.block_table[-1])
            b = seq.block_table.pop()
            self.ref_counts[b] -= 1
            assert self.ref_counts[b] == 0 and self.block_hash[b] is None
            self.free[b] = None
            self.free.move_to_end(b, last=False)

    def free_seq(self, seq: Sequence) -> None:
        """Release the sequence's blocks. The tail goes first into the eviction order, so a shared
        prefix (the head of the chain) outlives the request-specific tail."""
        if self.sliding is not None:
            self.sliding.release_all(seq, self.block_hash)
        for b in reversed(seq.block_table):
            self.ref_counts[b] -= 1
            assert self.ref_counts[b] >= 0
            if self.ref_counts[b] == 0:
                if self.block_hash[b] is None:
                    self.free[b] = None
                    self.free.move_to_end(b, last=False)   # holds nothing reusable: hand it out first
                else:
                    self.free[b] = None
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
