"""Weight quantization schemes as pure tensor functions: quantize, dequantize, and the error bound.

Two formats cover every scheme tokenfab runs (weights are `[out, in]`, as `nn.Linear` holds them):

- **int8, per output channel, symmetric**: `w ≈ q * scale[row]`, `q` in [-127, 127].
- **int4, group-wise along `in`, asymmetric**: `w ≈ (q - 8) * scale[row, g] + zero[row, g]`, `q` in [0, 15].
  This is exactly the convention of torch's packed int4 CPU kernel (verified in tests), and GGUF's
  Q4_1 (`d * q + m`) maps onto it with `scale = d`, `zero = m + 8 d`; Q4_0 (`d * (q - 8)`) with `zero = 0`.

Scales and zeros chosen here are exactly representable in bfloat16, because torch's packed CPU
kernels read them in bfloat16 (they are only fast with bf16 activations on this machine): the packed
and the dequantize-then-GEMM paths then see bit-identical weights. Scales are rounded *up* to
bfloat16, so nothing clips and the error bound stays `scale / 2`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

INT4_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True, slots=True)
class QuantScheme:
    """A scheme by name: weight-only `int8`, `int4-g32`, `int4-g64`, `int4-g128`, `awq-int4-g128`;
    `w8a8` (int8 weights per channel, int8 activations per token)."""
    name: str
    bits: int                  # 8 or 4
    group_size: int | None     # None: one scale per output channel (int8)
    awq: bool = False          # activation-aware per-input-channel scaling from calibration data
    act8: bool = False         # activations quantized to int8 per token on the fly (W8A8): integer GEMM
    kquant: str | None = None  # GGUF K-quant block type written (tokenfab/quant/kquants.py), e.g. "Q4_K"


SCHEMES: dict[str, QuantScheme] = {
    "int8": QuantScheme("int8", 8, None),
    "w8a8": QuantScheme("w8a8", 8, None, act8=True),
    **{f"int4-g{g}": QuantScheme(f"int4-g{g}", 4, g) for g in INT4_GROUP_SIZES},
    **{f"awq-int4-g{g}": QuantScheme(f"awq-int4-g{g}", 4, g, awq=True) for g in INT4_GROUP_SIZES},
    # GGUF K-quant blocks (round to nearest in the block layout), run as stored by tf_qgemm's K-quant path
    "q4_k": QuantScheme("q4_k", 4, 256, kquant="Q4_K"),
    "q6_k": QuantScheme("q6_k", 6, 256, kquant="Q6_K"),
}
# K-quants need input widths divisible by 256; other layers take these (as llama.cpp falls back to
# Q5_0 / Q8_0 there): int4 in groups of 32 for q4_k, int8 for q6_k
KQUANT_FALLBACK = {"q4_k": "int4-g32", "q6_k": "int8"}
# "int4" alone means groups of 32: the layout of the bundled model's Q4_1 weights.
ALIASES = {"int4": "int4-g32", "awq-int4": "awq-int4-g128", "awq": "awq-int4-g128"}


def parse_scheme(name: str) -> QuantScheme:
    key = ALIASES.get(name, name)
    if key not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {name!r}; known: {sorted(SCHEMES) + sorted(ALIASES)}")
    return SCHEMES[key]


def round_up_to_bf16(t: torch.Tensor) -> torch.Tensor:
    """Smallest bfloat16-representable float32 >= t, for finite t >= 0 (bf16 is float32's top 16 bits)."""
    bits = t.float().contiguous().view(torch.int32)
    up = (bits + 0xFFFF) & ~0xFFFF
    return up.view(torch.float32)


def round_to_bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


# ---------------------------------------------------------------------------------------------- int8

def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: returns (q int8 [out, in], scales float32 [out])."""
    w = w.float()
    amax = w.abs().amax(dim=1)
    scales = round_up_to_bf16(amax / 127)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))   # all-zero row: any scale works
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.to(dtype) * scales.to(dtype)[:, None])


def int8_error_bound(scales: torch.Tensor) -> torch.Tensor:
    """Max |w - dequantize(quantize(w))| per row: half a step, since scales round up and nothing clips."""
    return scales.float()[:, None] / 2


# ---------------------------------------------------------------------------------------------- int4

def padded_in_features(in_features: int, group_size: int) -> int:
    return -(-in_features // group_size) * group_size


def pad_columns(w: torch.Tensor, multiple: int) -> torch.Tensor:
    """Pad `in` up to a multiple by repeating the last column: it cannot widen any group's min/max."""
    k = w.shape[1]
    kp = padded_in_features(k, multiple)
    if kp == k:
        return w
    return torch.cat([w, w[:, -1:].expand(-1, kp - k)], dim=1)


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-wise asymmetric int4 along `in`.

    Returns (q uint8 [out, in_padded] with values 0..15, scales [out, groups], zeros [out, groups]),
    float32 and bfloat16-exact, such that w ≈ (q - 8) * scale + zero. `in` is padded up to a
    multiple of the group size (e.g. 576 → 640 for groups of 128); the padding is cut off again
    by `dequantize_int4(..., in_features=...)`.
    """
    if group_size not in (32, 64, 128, 256):
        raise ValueError(f"int4 group size must be 32, 64, 128 or 256, got {group_size}")
    w = pad_columns(w.float(), group_size)
    n, kp = w.shape
    g = w.view(n, kp // group_size, group_size)
    mn, mx = g.amin(dim=2), g.amax(dim=2)
    scales = round_up_to_bf16((mx - mn) / 15)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))   # constant group
    zeros = round_to_bf16(mn + 8 * scales)
    q = torch.round((g - zeros[..., None]) / scales[..., None]) + 8
    q = q.clamp_(0, 15).to(torch.uint8).view(n, kp)
    return q, scales, zeros


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                    in_features: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_int4` for unpacked q [out, in_padded]; returns [out, in_features]."""
    n, kp = q.shape
    s = scales.to(dtype)[..., None]
    # q * s + (zero - 8 s): one fused pass over the weight, the form the AVX2 packed kernel uses too
    w = torch.addcmul(zeros.to(dtype)[..., None] - 8 * s, q.view(n, kp // group_size, group_size).to(dtype), s)
    w = w.view(n, kp)
    return w if in_features is None or in_features == kp else w[:, :in_features]


def int4_error_bound(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """Max error per group [out, groups]: half a step, plus what rounding the zero to bf16 moved the range."""
    g = pad_columns(w.float(), group_size)
    g = g.view(g.shape[0], -1, group_size)
    ideal_zero = g.amin(dim=2) + 8 * scales
    return scales / 2 + (zeros - ideal_zero).abs()


# ---------------------------------------------------------------------------------------- nibbles

def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[rows, 2k] values 0..15 → [rows, k] uint8: column 2j in the low nibble, 2j+1 in the high one."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_nibbles`: [rows, k] uint8 → [rows, 2k] uint8 values 0..15."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=2).view(packed.shape[0], -1)
