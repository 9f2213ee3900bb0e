"""int8 KV cache, without a model: the quantizer's bound, the paged attention over int8 pools, sizes."""
import torch

from tokenfab.model.attention import (AttentionMetadata, Int8KVCache, PrefillChunk, TorchPagedAttention,
                                      dequantize_kv, kv_bytes_per_token, kv_int8_bytes_per_token, quantize_kv)
from tokenfab.model.config import ModelConfig

H, KVH, D, BS = 4, 2, 32, 4
G = torch.Generator().manual_seed(0)


def test_kv_quantization_error_is_within_half_a_step_per_token_and_head():
    x = torch.randn(50, KVH, D, generator=G) * torch.rand(50, KVH, 1, generator=G) * 10
    x[3, 1] = 0                                                   # an all-zero head stays exactly zero
    q, scale = quantize_kv(x)
    assert q.dtype == torch.int8 and scale.shape == (50, KVH) and scale.dtype == torch.float32
    err = (dequantize_kv(q, scale, torch.float32) - x).abs()
    assert (err <= scale[..., None] / 2 * (1 + 1e-5)).all()
    assert (q.abs() <= 127).all() and (q.abs().amax(-1)[scale > 1e-20] == 127).all()   # full range used
    assert torch.equal(dequantize_kv(q, scale, torch.float32)[3, 1], torch.zeros(D))


def _pools(num_blocks, int8):
    if int8:
        return [Int8KVCache(torch.zeros(num_blocks, BS, KVH, D, dtype=torch.int8),
                            torch.zeros(num_blocks, BS, KVH), torch.float32) for _ in range(2)]
    return [torch.zeros(num_blocks, BS, KVH, D) for _ in range(2)]


def _prefill_meta(start, n, table):
    return AttentionMetadata(torch.arange(start, start + n), 0, None, None, 0,
                             [PrefillChunk(0, n, start + n, table)])


def _run(q, k, v, chunks, int8):
    """One sequence of len(q) tokens, prefilled in the given chunk sizes, then one decode step."""
    attn = TorchPagedAttention(H, KVH, D, BS)
    T = q.shape[0]
    nblocks = -(-(T + 1) // BS)
    kc, vc = _pools(nblocks, int8)
    table = torch.arange(nblocks)
    outs, s = [], 0
    for n in chunks:
        outs.append(attn(q[s:s + n], k[s:s + n], v[s:s + n], kc, vc, _prefill_meta(s, n, table)))
        s += n
    dec = AttentionMetadata(torch.tensor([T]), 1, table[None], torch.tensor([T + 1]), T + 1, [])
    qd, kd, vd = (torch.randn(1, h, D, generator=torch.Generator().manual_seed(1)) for h in (H, KVH, KVH))
    outs.append(attn(qd, kd, vd, kc, vc, dec))
    return torch.cat(outs)


def test_int8_pool_attention_stays_close_to_the_float_pool():
    q, k, v = (torch.randn(13, h, D, generator=G) for h in (H, KVH, KVH))
    ref = _run(q, k, v, [13], int8=False)
    got = _run(q, k, v, [13], int8=True)
    torch.testing.assert_close(got, ref, rtol=0, atol=0.03)      # 127 steps per head: ~1 % of |v|
    assert (got - ref).abs().max() > 1e-5                        # and the int8 path really ran


def test_int8_pool_gives_the_same_attention_whatever_the_prefill_chunking():
    # a prefill attends to its own new tokens as stored (quantized), so one chunk or three read
    # the same K/V; only float summation order differs
    q, k, v = (torch.randn(13, h, D, generator=G) for h in (H, KVH, KVH))
    whole = _run(q, k, v, [13], int8=True)
    chunked = _run(q, k, v, [5, 3, 5], int8=True)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)


def test_int8_kv_bytes_count_values_and_one_float32_scale_per_token_and_head():
    cfg = ModelConfig(arch="llama", vocab_size=10, hidden_size=64, intermediate_size=128, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=16)
    assert kv_int8_bytes_per_token(cfg) == 2 * 3 * 2 * 16 * 1 + 2 * 3 * 2 * 4
    assert kv_bytes_per_token(cfg, torch.int8) == kv_int8_bytes_per_token(cfg)
    assert kv_bytes_per_token(cfg, torch.float32) == 2 * 3 * 2 * 16 * 4
