"""BlockManager: allocation, ref counts, prefix-cache hash chain, verification, LRU eviction."""
from tokenfab.engine.kv_cache import BlockManager
from tokenfab.engine.sequence import Sequence
from tokenfab.sampling import SamplingParams


def seq(tokens, rid="r"):
    return Sequence(rid, 0, list(tokens), SamplingParams(), max_tokens=16)


def admit(bm, s):
    cached = bm.find_cached_prefix(s)
    n = s.num_tokens - len(cached) * bm.block_size
    assert bm.allocate(s, n, cached)
    s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(s)
    return len(cached)


def test_allocate_and_free_return_every_block():
    bm = BlockManager(8, 4)
    s = seq(range(10))
    assert bm.allocate(s, 10)
    assert len(s.block_table) == 3 and bm.num_used_blocks() == 3
    bm.free_seq(s)
    assert bm.num_used_blocks() == 0 and s.block_table == []


def test_allocation_fails_without_side_effects_when_pool_is_short():
    bm = BlockManager(2, 4)
    s = seq(range(12))
    assert not bm.allocate(s, 12)
    assert bm.num_used_blocks() == 0 and s.block_table == []


def test_prefix_hit_reuses_full_blocks_and_shares_them():
    bm = BlockManager(16, 4)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    assert admit(bm, a) == 0
    b = seq([1, 2, 3, 4, 5, 6, 7, 8, 42], "b")
    assert admit(bm, b) == 2
    assert b.block_table[:2] == a.block_table[:2]
    assert bm.ref_counts[a.block_table[0]] == 2
    bm.free_seq(a)
    bm.free_seq(b)
    assert bm.num_used_blocks() == 0


def test_at_least_one_token_is_computed_on_a_full_hit():
    bm = BlockManager(16, 4)
    admit(bm, seq(range(8), "a"))
    again = seq(range(8), "b")
    assert len(bm.find_cached_prefix(again)) == 1   # 8 tokens: only the first block may hit


def test_freed_blocks_stay_cached_until_evicted():
    bm = BlockManager(4, 4)
    a = seq(range(8), "a")
    admit(bm, a)
    bm.free_seq(a)
    b = seq(list(range(8)) + [99], "b")
    assert len(bm.find_cached_prefix(b)) == 2
    # Fill the pool with other content: the cached blocks get evicted.
    c = seq(range(100, 116), "c")
    admit(bm, c)
    assert bm.find_cached_prefix(b) == []


def test_hash_collision_is_caught_by_token_verification():
    bm = BlockManager(8, 4)
    a = seq(range(5), "a")
    admit(bm, a)
    # Forge a chain entry pointing at a's block but for different tokens.
    forged = bm.chain_hash(None, (9, 9, 9, 9))
    bm.hash_to_block[forged] = a.block_table[0]
    assert bm.find_cached_prefix(seq([9, 9, 9, 9, 1], "b")) == []


def test_prefix_caching_off_never_hits():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    admit(bm, seq(range(9), "a"))
    assert bm.find_cached_prefix(seq(range(9), "b")) == []


def test_eviction_prefers_blocks_without_reusable_content():
    bm = BlockManager(4, 4)
    a = seq(range(4), "a")
    admit(bm, a)                       # 1 full block (hashed) + 0 partial
    p = seq(range(50, 53), "p")        # a partial block: nothing reusable
    assert bm.allocate(p, 3)
    bm.free_seq(a)
    bm.free_seq(p)
    n = seq(range(200, 212), "n")     # needs 3 of the 4 blocks
    assert bm.allocate(n, 12)
    assert len(bm.find_cached_prefix(seq(list(range(4)) + [7], "x"))) == 1


def test_touched_blocks_count_each_block_once_and_grow_until_the_pool_is_used():
    """The blocks ever handed out (their pages resident): freed cached blocks are kept while unused ones
    remain, so every new request touches fresh blocks until the pool has been used once, and no more."""
    bm = BlockManager(8, 4)
    for i in range(5):                              # 5 different prompts of 2 blocks each, one at a time
        s = seq(range(100 * i, 100 * i + 8), rid=f"r{i}")
        admit(bm, s)
        bm.free_seq(s)
        assert bm.num_touched == min(2 * (i + 1), 8)
    assert bm.num_used_blocks() == 0 and bm.num_touched == 8
