"""Quantize → dequantize stays within each scheme's bound; torch's packed kernels use the conventions we assume."""
import pytest
import torch

from tokenfab.quant.schemes import (dequantize_int4, dequantize_int8, int4_error_bound, int8_error_bound,
                                    pack_nibbles, parse_scheme, quantize_int4, quantize_int8, round_up_to_bf16,
                                    unpack_nibbles)


def _weights(out=96, inp=576, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * 0.05
    w[3, 7] = 0.9                       # an outlier weight
    w[5] = 0.0                          # an all-zero row
    w[6, :64] = 0.25                    # constant groups
    return w


def _is_bf16_exact(t):
    return torch.equal(t.bfloat16().float(), t)


def test_round_up_to_bf16_is_smallest_bf16_not_below():
    t = torch.tensor([1.0, 1.001, 0.3, 1e-5, 0.0, 123.456])
    r = round_up_to_bf16(t)
    assert _is_bf16_exact(r) and bool((r >= t).all())
    below = (r.view(torch.int32) - 0x10000).view(torch.float32)      # the next bf16 value down
    assert bool(((below < t) | (r == 0)).all())


def test_int8_roundtrip_error_within_half_step():
    w = _weights()
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    err = (dequantize_int8(q, s) - w).abs()
    assert bool((err <= int8_error_bound(s) + 1e-7).all())
    assert _is_bf16_exact(s)
    assert bool((dequantize_int8(q, s)[5] == 0).all())


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_roundtrip_error_within_bound(group):
    w = _weights()
    q, s, z = quantize_int4(w, group)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    assert q.shape[1] % group == 0 and q.shape[1] >= w.shape[1]
    deq = dequantize_int4(q, s, z, group, w.shape[1])
    assert deq.shape == w.shape
    bound = int4_error_bound(w, s, z, group)                          # [out, groups]
    per_elem = bound.repeat_interleave(group, dim=1)[:, : w.shape[1]]
    assert bool(((deq - w).abs() <= per_elem + 1e-7).all())
    # the bound is tight for random weights: about half a step, the zero's bf16 rounding adds little
    assert float((bound - s / 2).max()) < 0.1 * float(s.max())
    assert _is_bf16_exact(s) and _is_bf16_exact(z)


def test_int4_constant_group_is_reproduced_within_bf16_rounding():
    w = _weights()
    q, s, z = quantize_int4(w, 32)
    deq = dequantize_int4(q, s, z, 32, w.shape[1])
    assert torch.allclose(deq[6, :64], w[6, :64], atol=0.25 * 2 ** -8)


def test_int4_group_128_pads_576_inputs_and_keeps_real_columns_within_bound():
    w = _weights(out=16, inp=576)
    q, s, z = quantize_int4(w, 128)                                   # 576 → 640: 4.5 groups → 5
    assert q.shape == (16, 640) and s.shape == (16, 5)
    deq = dequantize_int4(q, s, z, 128, 576)
    bound = int4_error_bound(w, s, z, 128).repeat_interleave(128, dim=1)[:, :576]
    assert bool(((deq - w).abs() <= bound + 1e-7).all())
    # the padded half-group repeats the last column, so its range is that of the real 64 columns
    last = w[:, 512:]
    assert torch.allclose(s[:, 4], round_up_to_bf16((last.amax(1) - last.amin(1)) / 15).clamp_min(1e-30)
                          .where(last.amax(1) > last.amin(1), torch.ones(16)))


def test_nibble_pack_roundtrip():
    q = torch.randint(0, 16, (7, 40), dtype=torch.uint8)
    p = pack_nibbles(q)
    assert p.shape == (7, 20)
    assert torch.equal(unpack_nibbles(p), q)


def test_parse_scheme_names_and_errors():
    assert parse_scheme("int4").group_size == 32
    assert parse_scheme("awq-int4-g128").awq
    assert parse_scheme("int8").bits == 8
    with pytest.raises(ValueError, match="known"):
        parse_scheme("int3")


def test_torch_int4pack_kernel_dequantizes_as_q_minus_8_times_scale_plus_zero():
    """The convention everything here rests on: w = (q - 8) * scale + zero, scale/zero [groups, out, 2]."""
    g = torch.Generator().manual_seed(1)
    n, k, group = 32, 128, 32
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    scale = (torch.rand(k // group, n, generator=g) + 0.1).bfloat16()
    zero = torch.randn(k // group, n, generator=g).bfloat16()
    x = torch.randn(3, k, generator=g).bfloat16()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, torch.stack([scale, zero], -1).contiguous())
    s_full = scale.float().t().repeat_interleave(group, dim=1)
    z_full = zero.float().t().repeat_interleave(group, dim=1)
    ref = x.float() @ ((q - 8) * s_full + z_full).t()
    torch.testing.assert_close(y.float(), ref, rtol=2 ** -7, atol=1e-2)
    wrong = x.float() @ (q * s_full + z_full).t()                     # without the -8 it is far off
    assert float((y.float() - wrong).abs().max()) > 1.0


def test_torch_int8pack_kernel_is_q_times_row_scale():
    g = torch.Generator().manual_seed(2)
    q = torch.randint(-127, 128, (24, 64), generator=g, dtype=torch.int8)
    s = (torch.rand(24, generator=g) * 0.01).bfloat16()
    x = torch.randn(2, 64, generator=g).bfloat16()
    y = torch.ops.aten._weight_int8pack_mm(x, q, s)
    ref = x.float() @ (q.float() * s.float()[:, None]).t()
    torch.testing.assert_close(y.float(), ref, rtol=2 ** -7, atol=1e-3)
