"""The matmuls behind quantized linears, and the rule that picks one per call.

Four paths compute the same thing:
- **cpu**: tokenfab's C kernel (tokenfab/kernels/cpu.c, `tf_qgemm`): reads int4 / int8 / Q8_0 blocks
  directly, activations as int16 per block of 32 (relative error ~2^-16: KL 3e-7 against float on the
  bundled model, where bf16 activations give 1e-3), for up to QGEMM_MAX_ROWS (16) rows: decode steps of small batches.
- **float cache**: a dequantized float32 copy of the weight in oneDNN's layout, kept when the engine's
  memory budget allows (`QuantLinear.float_cache`): the fastest path for big batches and prefill.
- **packed**: torch's CPU weight-only kernels, `_weight_int8pack_mm` (int8, one scale per output
  channel) and `_weight_int4pack_mm_for_cpu` (int4 in groups, w = (q - 8) * scale + zero). They read
  the quantized bytes directly, so they win when decode is bound by weight bandwidth (few tokens).
  On this AVX2 machine they are only fast with bfloat16 activations and scales (float32 inputs were
  5-10x slower than F.linear), so activations are rounded to bf16 on the way in.
- **dequant**: expand the weight to the activation dtype, then one F.linear. Expanding costs a pass
  over the weight per call, which a GEMM over many tokens amortizes; it is also the path for CUDA and
  for shapes the packed kernels reject, and the exact reference in tests.

`auto` takes the cpu path up to `QGEMM_MAX_ROWS` rows, else the packed path up to
`packed_max_tokens(kind, weight size)` tokens, else the float cache or dequant. The numbers come from
benchmarks/quant_kernels.py (table in docs/quant.md) and engine runs (docs/architecture.md).
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from tokenfab import kernels as cpu_kernels
from tokenfab.model.layers import packed_linear_supported

KERNELS = ("auto", "cpu", "packed", "dequant")

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


# With a cached float weight (QuantLinear.float_cache) the alternative is oneDNN's prepacked float32
# GEMM, not expand-then-GEMM, so the packed kernels stop paying off sooner: on the dev machine the int4
# kernel lost to it from 8 rows on the decoder's shapes and from 16 rows on the LM head.
CACHED_PACKED_MAX_TOKENS = 4
CACHED_LARGE_PACKED_MAX_TOKENS = 8


def packed_max_tokens(kind: str, weight_numel: int, float_cached: bool = False) -> int:
    if float_cached:
        return CACHED_LARGE_PACKED_MAX_TOKENS if weight_numel >= LARGE_WEIGHT_NUMEL else CACHED_PACKED_MAX_TOKENS
    limit = PACKED_MAX_TOKENS[kind]
    return max(limit, LARGE_PACKED_MAX_TOKENS) if weight_numel >= LARGE_WEIGHT_NUMEL else limit


def use_packed(kind: str, kernel: str, x: torch.Tensor, supported: bool, weight_numel: int = 0,
               float_cached: bool = False) -> bool:
    """Packed or not for one call the cpu path declined; `kernel` is the module's setting."""
    if kernel == "dequant":
        return False
    if kernel == "packed":
        if not supported or x.device.type != "cpu":
            raise ValueError(f"kernel='packed' is not available for this {kind} layer on {x.device.type} "
                             "(packed kernels are CPU-only and shape-restricted); use 'auto' or 'dequant'")
        return True
    return supported and x.device.type == "cpu" and x.shape[0] <= packed_max_tokens(kind, weight_numel, float_cached)


def use_cpu_kernel(x: torch.Tensor) -> bool:
    """tokenfab's C kernel takes every call it can (up to QGEMM_MAX_ROWS rows): on the dev machine it
    beat torch's packed kernels at 1 row and the cached float GEMM up to 8 rows, in the engine."""
    return x.shape[0] <= cpu_kernels.QGEMM_MAX_ROWS


def float_cache_usable(x: torch.Tensor) -> bool:
    """A cached float weight serves float32 CPU inputs (the oneDNN prepacked GEMM of model/layers.py)."""
    return packed_linear_supported(x.device, x.dtype)


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


# ------------------------------------------------------------------------------------------- w8a8
# FBGEMM's dynamic int8 linear (`quantized::linear_dynamic`) quantizes its whole input with one
# asymmetric uint8 scale (7 bits with reduce_range, which its AVX2 kernels need to avoid overflow) and
# runs an integer GEMM against per-channel int8 weights. One scale for a whole batch would let one
# token's outliers cost every other token precision, and make a token's result depend on its batch.
# So each row is divided by its own max|x| first and one extra row [1, -1, 0, ...] pins the batch's
# range to exactly [-1, 1]: the quantization parameters are then the same for every batch, each row is
# effectively quantized with its own scale, the integer GEMM is exact, and the output row is multiplied
# back by that max. A token's result is the same alone or in any batch.

def w8a8_supported(x: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and "fbgemm" in torch.backends.quantized.supported_engines
            and hasattr(torch.ops.quantized, "linear_dynamic"))


def w8a8_pack(qweight: torch.Tensor, scales: torch.Tensor):
    """int8 [out, in] and float scales [out] -> FBGEMM's packed weight (machine-specific, never saved)."""
    zeros = torch.zeros(qweight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():     # torch marks quantized tensors deprecated; the op is what we need
        warnings.simplefilter("ignore", UserWarning)
        q = torch._make_per_channel_quantized_tensor(qweight.cpu(), scales.double().cpu(), zeros, 0)
        return torch.ops.quantized.linear_prepack(q, None)


_RANGE_ROWS: dict[int, torch.Tensor] = {}


def _range_row(k: int) -> torch.Tensor:
    row = _RANGE_ROWS.get(k)
    if row is None:
        row = torch.zeros(1, k)
        row[0, 0], row[0, -1] = 1.0, -1.0
        _RANGE_ROWS[k] = row
    return row


def w8a8_linear(x: torch.Tensor, packed) -> torch.Tensor:
    """x [T, in] (any float dtype) @ the packed int8 weight, activations int8 per row; float32 [T, out]."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True).clamp_min_(1e-30)
    xn = torch.cat([xf / amax, _range_row(x.shape[1])])
    return torch.ops.quantized.linear_dynamic(xn, packed, True)[:-1] * amax   # True: reduce_range
