"""Single-stream decode speed of a built model: a short greedy generate through the decoder's own
forward (paged KV cache, one decode token per step, the attention backend and linear kernels the
model was built with), without the engine's scheduler around it.

`quant eval --speed` times the base and the candidate this way in one process, one after the
other, so a pruned or quantized model's tokens/s stands beside its KL. The model's layers and
kernels are what differ between the two; the engine's per-step overhead is the same for both and
left out.

    tps, tokens = decode_speed(model, prompt_ids, new_tokens=32)
"""
from __future__ import annotations

import time

import torch

DEFAULT_DECODE_TOKENS = 32
_WARMUP_TOKENS = 4


@torch.inference_mode()
def greedy_decode(model, prompt: list[int], new_tokens: int, block_size: int = 16) -> tuple[list[int], float]:
    """Greedy tokens after `prompt` (one prefill, then one step per token) and the seconds the decode
    steps took (the first token, from the prefill, is not timed)."""
    from tokenfab.model.attention import AttentionMetadata, PrefillChunk

    cfg = model.config
    dev = model.embed_tokens.weight.device
    total = len(prompt) + new_tokens
    nblocks = -(-total // block_size)
    kv = torch.zeros(cfg.num_layers, 2, nblocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                     dtype=model.embed_tokens.weight.dtype, device=dev)
    caches = [(kv[i, 0], kv[i, 1]) for i in range(cfg.num_layers)]
    table = torch.arange(nblocks, device=dev)
    P = len(prompt)
    pos = torch.arange(P, device=dev)
    meta = AttentionMetadata(slot_mapping=pos, num_decode_tokens=0, decode_block_tables=None,
                             decode_context_lens=None, decode_max_context=0,
                             prefills=[PrefillChunk(0, P, P, table[:-(-P // block_size)])], positions=pos)
    logits = model(torch.tensor(prompt, device=dev), pos, caches, meta, torch.tensor([P - 1], device=dev))
    out = [int(logits[0].argmax())]
    t0 = time.perf_counter()
    for p in range(P, total - 1):
        pos = torch.tensor([p], device=dev)
        meta = AttentionMetadata(slot_mapping=pos, num_decode_tokens=1,
                                 decode_block_tables=table[: p // block_size + 1][None],
                                 decode_context_lens=torch.tensor([p + 1], device=dev), decode_max_context=p + 1,
                                 prefills=[], positions=pos)
        logits = model(torch.tensor([out[-1]], device=dev), pos, caches, meta, torch.tensor([0], device=dev))
        out.append(int(logits[0].argmax()))
    return out, time.perf_counter() - t0


def decode_speed(model, prompt: list[int], new_tokens: int = DEFAULT_DECODE_TOKENS) -> tuple[float, list[int]]:
    """(decode tokens/s, the greedy tokens) of `new_tokens` after `prompt`, after a short warm-up run
    (first calls build kernel plans and caches)."""
    if new_tokens < 2:
        raise ValueError(f"timing decode needs at least 2 new tokens, got {new_tokens}")
    greedy_decode(model, prompt, _WARMUP_TOKENS)
    tokens, seconds = greedy_decode(model, prompt, new_tokens)
    return (new_tokens - 1) / seconds, tokens
