"""The sliding-window layers' own KV pool (engine/sliding_kv.py), bookkeeping only: a long sequence
holds a bounded number of sliding blocks, and a prefix hit is cut where its window's sliding blocks
are gone. The model-level tests (token-exact output with the pool) are in test_gemma3.py."""
from tokenfab import SamplingParams
from tokenfab.engine.kv_cache import BlockManager
from tokenfab.engine.sequence import Sequence
from tokenfab.engine.sliding_kv import SlidingBlocks
from tokenfab.worker.kv_sizing import per_sequence_blocks

BS = 4
WINDOW = 16


def _seq(tokens: list[int]) -> Sequence:
    return Sequence("r", 0, tokens, SamplingParams(max_tokens=1000), max_tokens=1000)


def _manager(num_blocks=200, sliding_blocks=40) -> BlockManager:
    return BlockManager(num_blocks, BS, True, SlidingBlocks(sliding_blocks, BS, WINDOW, num_blocks))


def _advance(bm: BlockManager, seq: Sequence, n: int) -> None:
    """Schedule and 'compute' n more tokens of seq, as the engine does."""
    while seq.num_tokens < seq.num_computed_tokens + n:
        seq.token_ids.append(7)
    assert bm.allocate(seq, n)
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq)


def test_long_sequence_holds_sliding_blocks_bounded_by_the_window():
    bm = _manager()
    seq = _seq(list(range(60)))
    bound = per_sequence_blocks(WINDOW, BS, 16)
    for _ in range(4):                                  # a 60-token prompt in 16-token chunks
        _advance(bm, seq, min(16, seq.num_tokens - seq.num_computed_tokens) or 1)
        assert bm.sliding.held(seq) <= bound
    for _ in range(300):                                # then 300 decodes, far past the window
        _advance(bm, seq, 1)
        assert bm.sliding.held(seq) <= per_sequence_blocks(WINDOW, BS, 1)
    assert len(seq.block_table) == -(-seq.num_computed_tokens // BS)   # the global layers keep everything
    assert bm.sliding.num_used() == bm.sliding.held(seq) <= 6
    bm.free_seq(seq)
    assert bm.num_used_blocks() == 0


def test_prefix_hit_is_cut_where_the_windows_sliding_blocks_were_evicted():
    bm = _manager(sliding_blocks=24)
    prompt = list(range(100, 164))                      # 16 full blocks
    a = _seq(prompt)
    for _ in range(4):
        _advance(bm, a, 16)
    bm.free_seq(a)
    b = _seq(prompt + [1, 2, 3])
    assert len(bm.find_cached_prefix(b)) == 16          # global and window blocks still cached
    c = _seq(list(range(5000, 5080)))                   # unrelated: its blocks evict the free sliding ones
    for _ in range(5):
        _advance(bm, c, 16)
    assert bm.cached_blocks(prompt + [1]) == []         # no window's sliding blocks are left...
    sliding, bm.sliding = bm.sliding, None
    assert len(bm.cached_blocks(prompt + [1])) == 16    # ...though every global block is still cached
    bm.sliding = sliding
    bm.free_seq(c)
    assert bm.num_used_blocks() == 0


def test_fit_blocks_charges_only_the_global_layers_past_the_sliding_need():
    from tokenfab.worker.kv_sizing import fit_blocks
    gb, sb = 100, 500                                    # 1 global layer's block bytes, 5 sliding layers'
    assert fit_blocks(600 * 10 + 500, gb, sb, sliding_need=50) == 10   # under the need: both pools grow
    # 20 sliding blocks (+ the zero block) cost 10,500; the rest of 100,000 buys global blocks at 100 each
    assert fit_blocks(100_000, gb, sb, sliding_need=20) == (100_000 - 21 * sb) // gb
