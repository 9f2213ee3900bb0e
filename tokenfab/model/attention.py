"""Paged attention behind one interface.

The runner builds an `AttentionMetadata` per step and passes it down the model explicitly (no global
context). The flat batch is ordered decodes first (one query token each), then prefill chunks.

KV cache layout per layer: `[num_blocks, block_size, num_kv_heads, head_dim]` for K and for V, so a
token's slot is `block_id * block_size + offset` and writes are one `index_copy_` over the flat view.

The portable torch backend gathers each sequence's blocks and calls `scaled_dot_product_attention`.
It runs on CPU and CUDA; faster backends must agree with it in tests. A sliding-window layer (Gemma 3)
passes `window`: its queries attend to the last `window` positions only, themselves included (as HF's
sliding mask). Its pool may hold only the window (engine/sliding_kv.py: `AttentionMetadata.sliding`);
positions before it read as zeros or stale copies, which the window mask never weighs. This path is
pure torch; the cpu backend (model/backends.py: CpuPagedAttention) subclasses it to read the pools in
place through tokenfab's C kernels.

Attention sinks (gpt-oss): a layer may pass `sinks`, one learned logit per head that joins each query's
softmax denominator and weighs no value: softmax over [scores, sink], the sink's column dropped
(`sink_attention`, transformers' eager arithmetic step for step). SDPA has no such term, so those layers
attend through `sink_attention` on every path of this class, decodes and prefills, windows and int8 pools.

int8 KV cache (`kv_cache_dtype="int8"`): a layer's K and V pools are `Int8KVCache`s, int8 values plus
a float32 scale per token and head (symmetric, scale = max|x| / 127 over the head's dims). Writes
quantize, gathers dequantize to the compute dtype, and a prefill attends to its own new tokens as
stored (quantized too), so a token reads the same K/V whatever the chunking or prefix-cache hits.
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
    positions: torch.Tensor | None = None      # [num_tokens] int64, for kernels that apply RoPE themselves
    # the sliding-window layers' view when they have their own pool (engine/sliding_kv.py), else None
    sliding: AttentionMetadata | None = None
    token_rows: tuple[torch.Tensor, torch.Tensor] | None = None   # token_rows(): built on first use


def token_rows(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query token of the step as one row of the paged decode-attention kernel: its sequence's
    block table ([T, max_blocks] int64, zero-padded) and its causal context, the tokens up to and
    including itself ([T] int64). A prefill chunk's tokens share their sequence's table; each attends to
    one more position than the token before it. Built once per step and view, on first use."""
    if meta.token_rows is None:
        nd, prefills = meta.num_decode_tokens, meta.prefills
        T = nd + sum(p.query_len for p in prefills)
        dbt = meta.decode_block_tables if nd else None
        width = max([dbt.shape[1] if nd else 1] + [p.block_table.numel() for p in prefills])
        bt = torch.zeros(T, width, dtype=torch.int64)
        ctx = torch.empty(T, dtype=torch.int64)
        if nd:
            bt[:nd, :dbt.shape[1]] = dbt
            ctx[:nd] = meta.decode_context_lens
        for p in prefills:
            s, e = p.query_start, p.query_start + p.query_len
            bt[s:e, :p.block_table.numel()] = p.block_table
            torch.arange(p.context_len - p.query_len + 1, p.context_len + 1, out=ctx[s:e])
        meta.token_rows = (bt, ctx)
    return meta.token_rows


KV_SCALE_BYTES = 4        # one float32 scale per token and head, for K and for V (int8 cache)


@dataclass(slots=True)
class Int8KVCache:
    """One layer's K (or V) pool stored as int8, with a float32 scale per token and head."""
    data: torch.Tensor        # [num_blocks, block_size, num_kv_heads, head_dim] int8
    scale: torch.Tensor       # [num_blocks, block_size, num_kv_heads] float32
    dtype: torch.dtype        # the compute dtype gathered values come back in


def kv_int8_bytes_per_token(cfg) -> int:
    """int8 K/V plus one float32 scale per token and head, for K and V, in every layer."""
    return cfg.kv_bytes_per_token(1) + 2 * cfg.num_layers * cfg.num_kv_heads * KV_SCALE_BYTES


def kv_cache_torch_dtype(setting: str, compute: torch.dtype, c_float16: bool = False) -> torch.dtype:
    """EngineConfig.kv_cache_dtype -> the pools' element type: "int8" the int8 cache, "float16" half-size
    pools (the C kernels read them on CPU: half the bytes decode attention reads; values rounded to
    nearest float16, relative error 2^-11), "float32" float32 pools; "auto" float16 where the compute
    dtype is float32 and `c_float16` (the cpu backend's kernels read float16 pools for this model here:
    backends.c_float16_pools), else the compute dtype."""
    if setting == "auto":
        return torch.float16 if c_float16 and compute == torch.float32 else compute
    return {"int8": torch.int8, "float16": torch.float16, "float32": torch.float32}[setting]


def kv_bytes_per_token(cfg, kv_dtype: torch.dtype) -> int:
    """What one token costs in the KV pool for a pool element type (torch.int8: the int8 cache)."""
    if kv_dtype == torch.int8:
        return kv_int8_bytes_per_token(cfg)
    return cfg.kv_bytes_per_token(torch.tensor([], dtype=kv_dtype).element_size())


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] -> (int8 [..., D], float32 scale [...]): symmetric, max|x| maps to 127."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1).clamp_min(1e-30) / 127    # an all-zero head stores zeros
    return torch.round(xf / scale[..., None]).clamp_(-127, 127).to(torch.int8), scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale[..., None]).to(dtype)


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                   sinks: torch.Tensor) -> torch.Tensor:
    """Attention with a sink logit per head: q [B, H, Tq, D], k / v [B, KVH, L, D], `mask` boolean
    (broadcastable to [B, H, Tq, L], True: attend) or None, `sinks` [H]. The sink enters each row's softmax
    denominator only: scores and the sink's column are shifted by their maximum, softmaxed together, and the
    sink's probability dropped, as transformers' GptOssAttention does. Returns [B, H, Tq, D]."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


def _attend(q, k, v, mask, causal: bool, scale: float, gqa: bool, sinks: torch.Tensor | None) -> torch.Tensor:
    """SDPA, or sink_attention where the layer has sinks (the causal flag as an explicit mask)."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    return sink_attention(q, k, v, mask, scale, sinks)


class TorchPagedAttention:
    """Portable backend: gather the context's blocks, then SDPA with the causal offset."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size = block_size
        self.scale = head_dim ** -0.5

    def write_kv(self, k_cache: torch.Tensor | Int8KVCache, v_cache: torch.Tensor | Int8KVCache,
                 k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' K/V; returns them as the cache will give them back."""
        kvh, hd = self.num_kv_heads, self.head_dim
        if isinstance(k_cache, Int8KVCache):
            return self._write_int8(k_cache, k, meta), self._write_int8(v_cache, v, meta)
        ks, vs = k.to(k_cache.dtype), v.to(v_cache.dtype)
        k_cache.view(-1, kvh, hd).index_copy_(0, meta.slot_mapping, ks)
        v_cache.view(-1, kvh, hd).index_copy_(0, meta.slot_mapping, vs)
        if k_cache.dtype != k.dtype:    # a narrower pool (kv_cache_dtype="float16"): attend to what it holds
            return ks.to(k.dtype), vs.to(v.dtype)
        return k, v

    def _write_int8(self, cache: Int8KVCache, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, scale = quantize_kv(x)
        cache.data.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, q)
        cache.scale.view(-1, self.num_kv_heads).index_copy_(0, meta.slot_mapping, scale)
        return dequantize_kv(q, scale, x.dtype)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] for the new tokens; `sinks`: [H] sink logits or None. Returns
        [T, H, D]."""
        k, v = self.write_kv(k_cache, v_cache, k, v, meta)
        return self.attend(q, k, v, k_cache, v_cache, meta, window, sinks)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache, v_cache,
               meta: AttentionMetadata, window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention for tokens whose K/V are already in the cache (and given as k, v too)."""
        nd = meta.num_decode_tokens
        if not meta.prefills:                      # all decodes: the common step, no scatter
            return self._decode_any(q, k_cache, v_cache, meta, window, sinks)
        if nd == 0 and len(meta.prefills) == 1:    # one prefill chunk alone
            return self._prefill(q, k, v, k_cache, v_cache, meta.prefills[0], window, sinks)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode_any(q[:nd], k_cache, v_cache, meta, window, sinks)
        for p in meta.prefills:
            s, e = p.query_start, p.query_start + p.query_len
            out[s:e] = self._prefill(q[s:e], k[s:e], v[s:e], k_cache, v_cache, p, window, sinks)
        return out

    def _decode_any(self, q, k_cache, v_cache, meta: AttentionMetadata, window: int | None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
        if sinks is not None:                      # one gather + masked path for every window
            return TorchPagedAttention._decode_window(self, q, k_cache, v_cache, meta, window, sinks)
        if window is None or meta.decode_max_context <= window:      # the window covers every context
            return self._decode(q, k_cache, v_cache, meta)
        return self._decode_window(q, k_cache, v_cache, meta, window)

    def _decode_window(self, q, k_cache, v_cache, meta: AttentionMetadata, window: int | None,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Decode attention over each sequence's last `window` positions: gather + masked SDPA."""
        L = meta.decode_max_context
        keys = self._gather(k_cache, meta.decode_block_tables, L).transpose(1, 2)    # [B, KVH, L, D]
        vals = self._gather(v_cache, meta.decode_block_tables, L).transpose(1, 2)
        lens = meta.decode_context_lens
        j = torch.arange(L, device=q.device)[None, :]
        mask = j < lens[:, None]
        if window is not None:
            mask &= j >= lens[:, None] - window
        o = _attend(q.unsqueeze(2), keys.to(q.dtype), vals.to(q.dtype), mask[:, None, None, :], False, self.scale,
                    self.num_heads != self.num_kv_heads, sinks)
        return o.squeeze(2)

    def _gather(self, cache: torch.Tensor | Int8KVCache, block_table: torch.Tensor, length: int) -> torch.Tensor:
        # [..., nblocks] -> [..., nblocks * block_size, KVH, D], cut to length
        if isinstance(cache, Int8KVCache):
            lead = block_table.shape[:-1]
            q = cache.data[block_table].reshape(*lead, -1, self.num_kv_heads, self.head_dim)[..., :length, :, :]
            s = cache.scale[block_table].reshape(*lead, -1, self.num_kv_heads)[..., :length, :]
            return dequantize_kv(q, s, cache.dtype)
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

    def _prefill(self, q, k, v, k_cache, v_cache, p: PrefillChunk, window: int | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
        gqa = self.num_heads != self.num_kv_heads
        slides = window is not None and p.context_len > window
        if p.context_len == p.query_len and not slides:   # nothing cached before: the fresh K/V directly
            keys, vals, mask, causal = k, v, None, True
        else:
            if p.context_len == p.query_len:
                keys, vals = k, v
            else:
                keys = self._gather(k_cache, p.block_table, p.context_len).to(q.dtype)
                vals = self._gather(v_cache, p.block_table, p.context_len).to(q.dtype)
            offset = p.context_len - p.query_len
            qi = torch.arange(p.query_len, device=q.device)[:, None] + offset
            j = torch.arange(p.context_len, device=q.device)[None, :]
            mask = j <= qi
            if slides:
                mask &= j > qi - window
            causal = False
        o = _attend(q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
                    vals.transpose(0, 1).unsqueeze(0), mask, causal, self.scale, gqa, sinks)
        return o.squeeze(0).transpose(0, 1)
