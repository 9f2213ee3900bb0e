"""The matmuls behind quantized linears, and the rule that picks one per call.

Two paths compute the same thing:
- **packed**: torch's CPU weight-only kernels, `_weight_int8pack_mm` (int8, one scale per output
  channel) and `_weight_int4pack_mm_for_cpu` (int4 in groups, w = (q - 8) * scale + zero). They read
  the quantized bytes directly, so they win when decode is bound by weight bandwidth (few tokens).
  On this AVX2 machine they are only fast with bfloat16 activations and scales (float32 inputs were
  5-10x slower than F.linear), so activations are rounded to bf16 on the way in.
- **dequant**: expand the weight to the activation dtype, then one F.linear. Expanding costs a pass
  over the weight per call, which a GEMM over many tokens amortizes; it is also the path for CUDA and
  for shapes the packed kernels reject, and the exact reference in tests.

`auto` takes the packed path up to `packed_max_tokens(kind, weight size)` tokens and dequant above.
The numbers come from benchmarks/quant_kernels.py (table in docs/quant.md).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

KERNELS = ("auto", "packed", "dequant")

# Largest token count (rows of x) at which the packed kernel still beat dequantize + F.linear, per
# weight layout. Measured by benchmarks/quant_kernels.py on the 2-core AVX2 dev machine (1 thread,
# weights streamed from memory; table in docs/quant.md):
# - int4: packed won at 1, 8 and 32 tokens on every shape (dequant's nibble unpacking is costly);
# - int8: packed won at 1 and 8 tokens, dequant at 32 on most shapes;
# - q8_0: packed (two int4 halves) won at 1 token; dequant from 8 on, except on large matrices.
PACKED_MAX_TOKENS: dict[str, int] = {"int8": 8, "int4": 32, "q8_0": 1}
# Large matrices (the 49152x576 LM head) favoured packed at every measured count for all layouts:
# expanding 28M weights per call costs more than the GEMM it feeds.
LARGE_WEIGHT_NUMEL = 8 << 20
LARGE_PACKED_MAX_TOKENS = 32


def _has_op(name: str) -> bool:
    return hasattr(torch.ops.aten, name)


def int8pack_supported(out_features: int, in_features: int) -> bool:
    # _weight_int8pack_mm crashed (SIGSEGV, torch 2.13 CPU) for in_features 7 and 33; multiples of 8
    # worked. Multiples of 32 keep a margin.
    return _has_op("_weight_int8pack_mm") and in_features % 32 == 0


def int4pack_supported(out_features: int, padded_in: int, group_size: int) -> bool:
    # The packing op requires N % 16 == 0; the matmul requires these group sizes and K % group == 0.
    return (_has_op("_weight_int4pack_mm_for_cpu") and out_features % 16 == 0
            and group_size in (32, 64, 128, 256) and padded_in % group_size == 0)


def packed_max_tokens(kind: str, weight_numel: int) -> int:
    limit = PACKED_MAX_TOKENS[kind]
    return max(limit, LARGE_PACKED_MAX_TOKENS) if weight_numel >= LARGE_WEIGHT_NUMEL else limit


def use_packed(kind: str, kernel: str, x: torch.Tensor, supported: bool, weight_numel: int = 0) -> bool:
    """Decide the path for one call; `kernel` is the module's setting (auto | packed | dequant)."""
    if kernel == "dequant":
        return False
    if kernel == "packed":
        if not supported or x.device.type != "cpu":
            raise ValueError(f"kernel='packed' is not available for this {kind} layer on {x.device.type} "
                             "(packed kernels are CPU-only and shape-restricted); use 'auto' or 'dequant'")
        return True
    return supported and x.device.type == "cpu" and x.shape[0] <= packed_max_tokens(kind, weight_numel)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Unpacked int4 values [out, in_padded] (0..15) → the CPU kernel's packed layout.

    The layout is machine-specific (it tiles by the CPU's vector width), so it is never saved.
    """
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)


def int4_scales_and_zeros(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """[out, groups] scales and zeros → the kernel's [groups, out, 2] bfloat16 tensor."""
    return torch.stack([scales.t(), zeros.t()], dim=-1).to(torch.bfloat16).contiguous()


def int4pack_linear(x: torch.Tensor, packed: torch.Tensor, group_size: int,
                    scales_and_zeros: torch.Tensor, padded_in: int) -> torch.Tensor:
    """x [T, in] → [T, out] in x's dtype; pads x with zeros when `in` was padded to whole groups."""
    xb = x.to(torch.bfloat16)
    if padded_in > xb.shape[1]:
        xb = F.pad(xb, (0, padded_in - xb.shape[1]))
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb.contiguous(), packed, group_size, scales_and_zeros)
    return y.to(x.dtype)


def int8pack_linear(x: torch.Tensor, q: torch.Tensor, scales_bf16: torch.Tensor) -> torch.Tensor:
    y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), q, scales_bf16)
    return y.to(x.dtype)
