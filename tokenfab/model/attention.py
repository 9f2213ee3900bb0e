"""Paged attention behind one interface.

The runner builds an `AttentionMetadata` per step and passes it down the model explicitly (no global
context). The flat batch is ordered decodes first (one query token each), then prefill chunks.

KV cache layout per layer: `[num_blocks, block_size, num_kv_heads, head_dim]` for K and for V, so a
token's slot is `block_id * block_size + offset` and writes are one `index_copy_` over the flat view.

The portable torch backend gathers each sequence's blocks and calls `scaled_dot_product_attention`.
It runs on CPU and CUDA; faster backends must agree with it in tests.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillChunk:
    query_start: int            # index of its first token in the flat batch
    query_len: int
    context_len: int            # tokens in the cache after this step (cached + new)
    block_table: torch.Tensor   # [num_blocks_needed] int64


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor          # [num_tokens] int64: where each new token's K/V is written
    num_decode_tokens: int              # the first num_decode_tokens tokens are decodes, one per sequence
    decode_block_tables: torch.Tensor | None   # [num_decodes, max_blocks] int64 (padded with 0)
    decode_context_lens: torch.Tensor | None   # [num_decodes] int64
    decode_max_context: int
    prefills: list[PrefillChunk]


class TorchPagedAttention:
    """Portable backend: gather the context's blocks, then SDPA with the causal offset."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size = block_size
        self.scale = head_dim ** -0.5

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        kvh, hd = self.num_kv_heads, self.head_dim
        k_cache.view(-1, kvh, hd).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, kvh, hd).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] for the new tokens. Returns [T, H, D]."""
        self.write_kv(k_cache, v_cache, k, v, meta)
        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta)
        for p in meta.prefills:
            s, e = p.query_start, p.query_start + p.query_len
            out[s:e] = self._prefill(q[s:e], k[s:e], v[s:e], k_cache, v_cache, p)
        return out

    def _gather(self, cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
        # [..., nblocks] -> [..., nblocks * block_size, KVH, D], cut to length
        g = cache[block_table]
        return g.reshape(*block_table.shape[:-1], -1, self.num_kv_heads, self.head_dim)[..., :length, :, :]

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        L = meta.decode_max_context
        keys = self._gather(k_cache, meta.decode_block_tables, L).transpose(1, 2)    # [B, KVH, L, D]
        vals = self._gather(v_cache, meta.decode_block_tables, L).transpose(1, 2)
        qb = q.unsqueeze(2)                                                          # [B, H, 1, D]
        mask = None
        lens = meta.decode_context_lens
        if q.shape[0] > 1:
            mask = (torch.arange(L, device=q.device)[None, :] < lens[:, None])[:, None, None, :]
        o = F.scaled_dot_product_attention(qb, keys.to(q.dtype), vals.to(q.dtype), attn_mask=mask,
                                           scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads)
        return o.squeeze(2)

    def _prefill(self, q, k, v, k_cache, v_cache, p: PrefillChunk) -> torch.Tensor:
        gqa = self.num_heads != self.num_kv_heads
        if p.context_len == p.query_len:   # nothing cached before: attend to the fresh K/V directly
            keys, vals, mask, causal = k, v, None, True
        else:
            keys = self._gather(k_cache, p.block_table, p.context_len).to(q.dtype)
            vals = self._gather(v_cache, p.block_table, p.context_len).to(q.dtype)
            offset = p.context_len - p.query_len
            qi = torch.arange(p.query_len, device=q.device)[:, None] + offset
            mask = torch.arange(p.context_len, device=q.device)[None, :] <= qi
            causal = False
        o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
                                           vals.transpose(0, 1).unsqueeze(0), attn_mask=mask, is_causal=causal,
                                           scale=self.scale, enable_gqa=gqa)
        return o.squeeze(0).transpose(0, 1)
