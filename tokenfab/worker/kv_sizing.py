"""How many KV blocks a worker reserves: the pool's budget and the sliding-window layers' own pool.

- `kv_pool_blocks`: the global pool's blocks, from `num_kv_blocks`, `kv_cache_memory_bytes`, what
  `max_num_seqs` full-length sequences need, or a share of available memory (the smallest that applies).
- `pool_size` / `fit_blocks`: the sliding layers' pool (engine/sliding_kv.py holds its block map):
  sized for `max_num_seqs` sequences each holding its window, and what a budget holds with it.
- `sliding_savings`: what the sliding pool saves, for `tokenfab info`.
"""
from __future__ import annotations

from tokenfab.worker.memory import available_memory


def kv_pool_blocks(config, max_len: int, block_bytes: int, fit=None) -> tuple[int, str]:
    """How many KV blocks to reserve, and why: `num_kv_blocks`, else `kv_cache_memory_bytes`, else what
    `max_num_seqs` sequences of `max_len` tokens need when that is less than the free-memory share
    (`kv_cache_memory_fraction` of available, at most `kv_cache_memory_max`), else that share.
    `fit(bytes)`: blocks that fit in a budget (default: bytes // block_bytes; fit_blocks)."""
    fit = fit or (lambda budget: budget // block_bytes)
    if config.num_kv_blocks:
        return config.num_kv_blocks, "num_kv_blocks"
    if config.kv_cache_memory_bytes:
        return fit(config.kv_cache_memory_bytes), "kv_cache_memory_bytes"
    share = fit(min(int(available_memory(config.device) * config.kv_cache_memory_fraction),
                    config.kv_cache_memory_max))
    need = config.max_num_seqs * -(-max_len // config.block_size)
    if need < share:
        return need, f"max_num_seqs {config.max_num_seqs} x max_model_len {max_len}"
    return share, (f"kv_cache_memory_fraction {config.kv_cache_memory_fraction:.0%} of available memory, "
                   f"at most kv_cache_memory_max {config.kv_cache_memory_max / 2**30:.3g} GiB")


def per_sequence_blocks(window: int, block_size: int, step_tokens: int) -> int:
    """The most sliding blocks one sequence holds: the window before its step's first token, plus
    the step's new tokens, plus one block where they straddle block boundaries."""
    return -(-(window - 1 + step_tokens) // block_size) + 1


def pool_size(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
              num_global_blocks: int) -> int:
    """Sliding blocks (the zero block included) for max_num_seqs running sequences sharing one step's
    token budget: each holds its window, and the step's new tokens add at most the budget (plus a
    straddled block each). More than the global pool is never useful."""
    need = (max_num_seqs * (-(-(window - 1) // block_size) + 2)
            + -(-max_num_batched_tokens // block_size))
    # One sequence must always fit alone, or preemption could never make progress.
    need = max(need, per_sequence_blocks(window, block_size, max_num_batched_tokens))
    return min(need, num_global_blocks) + 1


def fit_blocks(budget: int, global_block_bytes: int, sliding_block_bytes: int, sliding_need: int) -> int:
    """Global blocks that fit in `budget` bytes when each block costs `global_block_bytes` in the global
    layers and the sliding pool holds min(global blocks, sliding_need) + 1 blocks of
    `sliding_block_bytes` (the savings: past sliding_need, a block costs only its global layers)."""
    gb, sb = global_block_bytes, sliding_block_bytes
    n = (budget - sb) // (gb + sb)
    if n <= sliding_need:
        return max(n, 0)
    return max((budget - (sliding_need + 1) * sb) // gb, 0)


def sliding_layer_share(model_config) -> tuple[int, int]:
    """(sliding layers, layers)."""
    n = model_config.num_layers
    return sum(model_config.is_sliding(i) for i in range(n)), n


def sliding_savings(model_config, config, bytes_per_token: int, context: int = 8192) -> dict:
    """For `tokenfab info`: one sequence's KV bytes at `context` tokens with every position kept and as
    the engine holds them (sliding layers: their decode-time blocks), and the tokens a GiB of KV pool
    holds each way (the engine's own sizing rule: the sliding pool is sized for max_num_seqs sequences
    each holding its window, so it saves only where contexts average well past the window)."""
    n_sliding, n = sliding_layer_share(model_config)
    bs, window = config.block_size, model_config.sliding_window
    per_layer_block = bytes_per_token * bs // n
    ctx_blocks = -(-context // bs)
    held_blocks = min(per_sequence_blocks(window, bs, 1), ctx_blocks)
    gib = 1 << 30

    def tokens(max_num_seqs: int) -> int:
        need = pool_size(window, bs, max_num_seqs, config.max_num_batched_tokens, 1 << 62) - 1
        return fit_blocks(gib, per_layer_block * (n - n_sliding), per_layer_block * n_sliding, need) * bs
    return {
        f"kv_bytes_{context // 1024}k_float32_all_positions": ctx_blocks * n * per_layer_block,
        f"kv_bytes_{context // 1024}k_float32_held": (ctx_blocks * (n - n_sliding) + held_blocks * n_sliding) * per_layer_block,
        "kv_tokens_per_gib_float32": {
            "all positions": gib // (bytes_per_token * bs) * bs,
            **{f"sliding pool, max_num_seqs {m}": tokens(m) for m in sorted({8, config.max_num_seqs})}},
    }
