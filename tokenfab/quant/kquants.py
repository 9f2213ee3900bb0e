"""GGUF's K-quant blocks (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) as layers that run them as stored.

A K-quant row is a run of super-blocks of 256 weights, each a fixed number of bytes holding fp16
super-scales, 4-8 bit sub-block scales and the packed quants (the layouts are written out in
tokenfab/kernels/csrc/kquant.c beside the decoder, and in the gguf package's numpy dequantizers, which the
tests check the C decoder against block by block). `KQuantLinear` keeps the file's bytes, uint8
[out, in / 256 * block bytes], and nothing else: no float copy. Its kernels (chosen at load by the
measured table, tokenfab/kernels/tuning.py):
- **qgemm**: `tf_qgemm` with ggml's type id as its `bits` (csrc/kquant.c): Q4_K and Q6_K in integers
  against int16 activation blocks on AVX2 builds (tf_kint), the other types with each super-block
  expanded into 256 floats once per weight row and dotted with up to 8 float32 activation rows (tf_kgemm).
  Also what the one-call decode stack runs.
- **qmadd** (Q4_K): big batches and prefill, each sub-block expanded as an int4 block (csrc/qmadd.c).
- **qdot** (opt-in, `int8_activations`): Q4_K and Q6_K blocks times llama.cpp's int8 activation blocks of
  256 in integer dot products (tf_kint8, csrc/kquant.c): 1.1-1.7x faster than qgemm's tf_kint at 1-8 rows on
  an AVX2 EPYC, at a measured cost in quality (Gemma 3 270M: KL 0.014, docs/quant.md).
- **float**: expanded once into a float32 oneDNN copy, where the table says it pays and the memory
  budget allows (counted as a float copy).
- **dequant**: expanded per call (tf_kdequant), then F.linear.

A GGUF file's Q4_K tensors load as `Q4_KLinear` on AVX2 CPUs without AMX int8 tiles, and as int4 blocks
elsewhere (`q4_k_as_int4_blocks` below, `Int4BlockLinear` in tokenfab/quant/linear.py: lossless, 6 bits per
weight, run by the int4 kernels): `blocks_as_stored` below.

`quantize_q4_k` / `quantize_q6_k` write float weights into Q4_K / Q6_K blocks (round to nearest in the
block layout; gguf's Python package has no K-quant quantizer): the `q4_k` and `q6_k` schemes of
`tokenfab quant`.
"""
from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from tokenfab import kernels as cpu_kernels
from tokenfab.quant import gguf_blocks as _gguf_blocks
from tokenfab.quant.linear import QuantLinear

QK = 256                                   # weights per super-block
BLOCK_BYTES = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
TYPE_IDS = cpu_kernels.KQUANT_TYPES        # ggml's type ids: what tf_qgemm dispatches on


def bits_per_weight(type_name: str) -> float:
    """Stored bits per weight, scales included (Q4_K 4.5, Q6_K 6.5625)."""
    return BLOCK_BYTES[type_name] * 8 / QK


def check_blocks(data, type_name: str, out_features: int, in_features: int) -> np.ndarray:
    """`data` as uint8 [out, in / 256 * block bytes]; ValueError (one line) when the size is wrong."""
    if in_features % QK:
        raise ValueError(f"{type_name} needs an input width divisible by {QK}, got {in_features}")
    arr = np.ascontiguousarray(np.asarray(data)).view(np.uint8)
    row = in_features // QK * BLOCK_BYTES[type_name]
    if arr.size != out_features * row:
        raise ValueError(f"{type_name} data for [{out_features}, {in_features}] should be {out_features * row} "
                         f"bytes, got {arr.size} (truncated or corrupt)")
    return arr.reshape(out_features, row)


def reference_dequantize(blocks: np.ndarray, type_name: str, out_features: int, in_features: int) -> np.ndarray:
    """gguf's numpy dequantizer: the reference (and the path without the C kernels)."""
    import gguf
    w = gguf.quants.dequantize(np.ascontiguousarray(blocks), gguf.GGMLQuantizationType[type_name])
    return np.asarray(w, dtype=np.float32).reshape(out_features, in_features)


# ------------------------------------------------------------------------------------ quantizers
def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """float [out, in] (in % 256 == 0) -> Q4_K bytes [out, in / 256 * 144]: per sub-block of 32,
    w ~ d * sc * q - dmin * m with q 0..15, sc and m 6-bit, d and dmin fp16 per super-block."""
    n, k = w.shape
    x = w.astype(np.float32).reshape(-1, 8, 32)                       # [blocks, sub, 32]
    lo = np.minimum(x.min(axis=2), 0.0)                               # the sub-block's offset (<= 0)
    scale = (x.max(axis=2) - lo) / 15.0
    d = _f16(scale.max(axis=1) / 63.0)                                # super-scales, fp16 as stored
    dmin = _f16(-lo.min(axis=1) / 63.0)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.where(df > 0, np.rint(scale / df), 0), 0, 63).astype(np.uint8)
        mn = np.clip(np.where(dminf > 0, np.rint(-lo / dminf), 0), 0, 63).astype(np.uint8)
        a = (df * sc)[..., None]
        q = np.where(a > 0, np.rint((x + (dminf * mn)[..., None]) / a), 0)
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(-1, 4, 2, 32)     # [blocks, chunk of 64, half, 32]
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    s = np.empty((x.shape[0], 12), np.uint8)
    s[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    s[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    s[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    out = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), s, qs], axis=1)
    return out.reshape(n, k // QK * 144)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """float [out, in] -> Q6_K bytes [out, in / 256 * 210]: per sub-block of 16, w ~ d * sc * (q - 32)
    with q 0..63, sc int8, d fp16 per super-block."""
    n, k = w.shape
    x = w.astype(np.float32).reshape(-1, 16, 16)
    scale = np.abs(x).max(axis=2) / 31.0
    d = _f16(scale.max(axis=1) / 127.0)
    df = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.where(df > 0, np.rint(scale / df), 0), 0, 127).astype(np.int8)
        a = (df * sc)[..., None]
        q = np.where(a > 0, np.rint(x / a), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)          # [blocks, half, 128]
    lo, hi = q & 15, q >> 4
    ql = (lo[:, :, :64] | (lo[:, :, 64:] << 4)).reshape(-1, 128)
    h4 = hi.reshape(-1, 2, 4, 32)
    qh = (h4[:, :, 0] | (h4[:, :, 1] << 2) | (h4[:, :, 2] << 4) | (h4[:, :, 3] << 6)).reshape(-1, 64)
    out = np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)], axis=1)
    return out.reshape(n, k // QK * 210)


QUANTIZERS = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}


# ---------------------------------------------------------------------------------------- layers
def q4_k_as_int4_blocks(data, out_features: int, in_features: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks -> int4 blocks of 32 in tf_qgemm's layout: (nibbles uint8 [out, in / 2] in GGUF's
    Q4_0 order, d float32 [out, in / 32], m float32 [out, in / 32]) with d * q + m equal, bit for bit, to
    gguf's dequantization (d * sc) * q - dmin * mn. A super-block's 128 code bytes hold sub-blocks 2c (low
    nibbles) and 2c + 1 (high nibbles) in 32-byte chunks c; each sub-block is re-packed with weight j
    in the low nibble of byte j and weight j + 16 in the high one."""
    import gguf
    arr = check_blocks(data, "Q4_K", out_features, in_features)
    b = arr.reshape(-1, BLOCK_BYTES["Q4_K"])                                  # one super-block a row
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)                  # [S, 1]
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))   # [S, 8] each, 6-bit
    chunks = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    w = (chunks & 0x0F).reshape(-1, 32)                                       # one sub-block of codes a row
    qs = w[:, :16] | (w[:, 16:] << 4)
    nb = in_features // 32
    return (qs.reshape(out_features, in_features // 2),
            (d * sc.astype(np.float32)).reshape(out_features, nb),
            -(dmin * mn.astype(np.float32)).reshape(out_features, nb))


class KQuantLinear(QuantLinear):
    """A K-quant weight as stored in the GGUF file (see the module docstring)."""
    ggml_type: ClassVar[str]

    def __init__(self, blocks: torch.Tensor, in_features: int, bias: torch.Tensor | None = None):
        super().__init__(in_features, blocks.shape[0], bias)
        assert blocks.dtype == torch.uint8 and blocks.shape[1] == in_features // QK * BLOCK_BYTES[self.ggml_type]
        self.register_buffer("blocks", blocks.contiguous())
        self._no_scales = torch.empty(1)        # tf_qlin's d slot: unused by K-quant layouts

    @classmethod
    def from_gguf(cls, data, out_features: int, in_features: int, bias: torch.Tensor | None = None):
        arr = check_blocks(data, cls.ggml_type, out_features, in_features)
        return cls(torch.from_numpy(arr.copy()), in_features, bias)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None):
        if cls.ggml_type not in QUANTIZERS:
            raise ValueError(f"no quantizer for {cls.ggml_type}; {', '.join(QUANTIZERS)} can be written")
        if weight.shape[1] % QK:
            raise ValueError(f"{cls.ggml_type} needs an input width divisible by {QK}, got {weight.shape[1]}")
        blocks = QUANTIZERS[cls.ggml_type](weight.detach().float().cpu().numpy())
        return cls(torch.from_numpy(blocks), weight.shape[1], bias)

    @classmethod
    def empty(cls, cfg: dict):
        n, k = cfg["out_features"], cfg["in_features"]
        return cls(torch.zeros(n, k // QK * BLOCK_BYTES[cls.ggml_type], dtype=torch.uint8), k,
                   torch.zeros(n) if cfg["bias"] else None)

    @property
    def type_id(self) -> int:
        return TYPE_IDS[self.ggml_type]

    def dequantize(self, dtype=torch.float32):
        if self.blocks.is_cpu and cpu_kernels.enabled():
            w = cpu_kernels.kdequant(self.blocks, self.type_id, self.out_features, self.in_features)
        else:
            w = torch.from_numpy(reference_dequantize(self.blocks.cpu().numpy(), self.ggml_type,
                                                      self.out_features, self.in_features)).to(self.blocks.device)
        return w.to(dtype)

    def dequantize_bf16(self):
        if self.blocks.is_cpu and cpu_kernels.enabled():       # one pass, no float32 [out, in] in between
            return cpu_kernels.kdequant(self.blocks, self.type_id, self.out_features, self.in_features, torch.bfloat16)
        return super().dequantize_bf16()

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `ids` expanded (a tied K-quant token embedding serves lookups without a float copy)."""
        flat = ids.reshape(-1)
        rows = self.blocks[flat].contiguous()
        if cpu_kernels.enabled() and rows.is_cpu:
            w = cpu_kernels.kdequant(rows, self.type_id, rows.shape[0], self.in_features)
        else:
            w = torch.from_numpy(reference_dequantize(rows.cpu().numpy(), self.ggml_type, rows.shape[0],
                                                      self.in_features))
        return w.to(dtype).reshape(*ids.shape, self.in_features)

    def cpu_layout(self):
        return self.blocks, self._no_scales, None, QK, self.type_id

    def extra_repr(self):
        return super().extra_repr() + f", gguf={self.ggml_type}"


def _layer_class(type_name: str) -> type[KQuantLinear]:
    return type(f"{type_name}Linear", (KQuantLinear,), {
        "ggml_type": type_name, "weight_format": type_name.lower(),
        "__doc__": f"GGUF {type_name} blocks as stored ({bits_per_weight(type_name):g} bits per weight)."})


KQUANT_LINEAR_TYPES: dict[str, type[KQuantLinear]] = {t: _layer_class(t) for t in BLOCK_BYTES}


def blocks_as_stored(device: str | torch.device) -> bool:
    """Whether a GGUF file's Q4_K and Q4_0 tensors load as stored (Q4_KLinear, Q4_0BlocksLinear: 4.5 bits
    per weight) rather than as int4 blocks (Int4BlockLinear, Q4_0Linear: 6 bits, a float32 scale and offset
    per 32). As stored on the CPU, where the AVX2 kernels read the blocks in integers (tf_kint for decode
    rows, tf_qmadd for big batches) and a decode step streams a quarter fewer bytes; as int4 blocks where AMX
    int8 tiles are available (their qtile / qbf16 layouts are built from int4 blocks) and on other devices
    (torch ops dequantize int4 blocks; the K-quant layers dequantize through numpy there)."""
    from tokenfab import kernels as cpu_kernels
    if torch.device(device).type != "cpu" or not cpu_kernels.enabled():
        return False
    return "avx2" in cpu_kernels.compiled_features() and not cpu_kernels.amx_available()


class Q4_0BlocksLinear(QuantLinear):
    """GGUF Q4_0 blocks exactly as the file stores them, uint8 [out, in / 32 * 18] (fp16 d, then 16 nibble
    bytes; w = d * (q - 8)): 4.5 bits per weight, where `Q4_0Linear` holds 6 (float32 d and offset). The
    AVX2 kernels read them as they are (tf_kint for decode rows, tf_qmadd for big batches; ggml's type id
    2 as tf_qgemm's `bits`); `dequantize` and `embedding` decode them in torch."""
    weight_format = "q4_0"
    group_size = 32
    type_id: ClassVar[int] = 2

    def __init__(self, blocks: torch.Tensor, in_features: int, bias: torch.Tensor | None = None):
        super().__init__(in_features, blocks.shape[0], bias)
        assert blocks.dtype == torch.uint8 and blocks.shape[1] == in_features // 32 * 18
        self.register_buffer("blocks", blocks.contiguous())
        self._no_scales = torch.empty(1)        # tf_qgemm's d slot: unused by blocks read as stored

    @classmethod
    def from_gguf(cls, data, out_features: int, in_features: int, bias: torch.Tensor | None = None):
        b = _gguf_blocks._blocks(data, out_features, in_features, "Q4_0")
        return cls(torch.from_numpy(b.reshape(out_features, -1).copy()), in_features, bias)

    @classmethod
    def empty(cls, cfg: dict) -> "Q4_0BlocksLinear":
        n, k = cfg["out_features"], cfg["in_features"]
        return cls(torch.zeros(n, k // 32 * 18, dtype=torch.uint8), k, torch.zeros(n) if cfg["bias"] else None)

    def _rows(self, blocks: torch.Tensor, dtype) -> torch.Tensor:
        n = blocks.shape[0]
        b = blocks.view(n, -1, 18)
        d = b[..., :2].contiguous().view(torch.float16).float()                  # [n, nb, 1]
        qs = b[..., 2:]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=2).float() - 8                   # weights 0..15, 16..31
        return (q * d).view(n, self.in_features).to(dtype)

    def dequantize(self, dtype=torch.float32):
        return self._rows(self.blocks, dtype)

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `ids` decoded: a tied token embedding served from these blocks keeps no float copy."""
        return self._rows(self.blocks[ids.reshape(-1)], dtype).reshape(*ids.shape, self.in_features)

    def cpu_layout(self):
        return self.blocks, self._no_scales, None, self.group_size, self.type_id

    def extra_repr(self):
        return super().extra_repr() + ", gguf=Q4_0"
