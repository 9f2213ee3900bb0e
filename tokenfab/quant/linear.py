"""Drop-in replacements for `nn.Linear` that hold quantized weights: `forward(x[..., in]) -> [..., out]`.

- `Int8Linear`: int8 per output channel (scheme "int8").
- `W8A8Linear`: the same weights, and activations quantized to int8 per token (scheme "w8a8").
- `Int4Linear`: int4 in groups along `in`, asymmetric, optionally with an AWQ input scale
  (schemes "int4-g*", "awq-int4-g*").
- `Int4BlockLinear`: int4 blocks of 32 in the C kernels' own layout (w = d * q + m). `Q4_0Linear` and
  `Q4_1Linear` are GGUF's blocks as shipped in it; GGUF's Q4_K loads into it losslessly where
  its super-blocks are not read as stored (`blocks_as_stored`); `Q4_0BlocksLinear` (kquants.py) keeps Q4_0's
  bytes as they are.
- `Q8_0Linear`: GGUF int8 blocks of 32 with one scale each. torch has no int8 kernel with group
  scales, so the packed path splits each int8 q into two nibbles, q = 16 * hi + lo, and runs both
  halves through the int4 kernel at once (scale 16 d for hi, scale d for lo): exact, and 1 byte/weight.

Each module keeps its weights in a portable form (buffers, saved in checkpoints). Which kernel runs
them is not decided here: the engine installs a plan per layer at load (tokenfab/kernels/linear.py,
the measured table in tokenfab/kernels/tuning.py); `kernel = "dequant"` (or any registered name)
forces one, and a layer built by hand gets the default rules on its first call.
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn as nn

from tokenfab.kernels.linear import KernelLinear, forced_plan
from tokenfab.kernels.tuning import default_plan
from tokenfab.quant import gguf_blocks, kernels
from tokenfab.quant.kernels import KERNEL_ALIASES
from tokenfab.quant.schemes import (dequantize_int4, dequantize_int8, pack_nibbles, padded_in_features,
                                    quantize_int4, quantize_int8, unpack_nibbles)


class QuantLinear(KernelLinear):
    """Base class: bias and the portable weight form; the kernels that run it are chosen at load
    (tokenfab/kernels/linear.py, tuning.py). Subclasses implement `dequantize` and, where a kernel
    can read their bytes directly, `cpu_layout` (tf_qgemm) and `packed_supported` / `build_packed` /
    `packed_matmul` (torch's packed kernels)."""
    weight_format: ClassVar[str]          # "int8" | "int4" | "q8_0" | "w8a8": the registry's format key

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None = None):
        super().__init__(in_features, out_features)
        if bias is not None:
            self.bias = nn.Parameter(bias.detach().float().clone(), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    @property
    def kind(self) -> str:
        return self.weight_format

    @property
    def kernel(self) -> str:
        """The kernel(s) this layer runs, e.g. "qgemm 1-16, float 17+"; "auto" before a plan exists."""
        return "auto" if self.plan is None else ", ".join(n for _, n in self.plan.names())

    @kernel.setter
    def kernel(self, name: str) -> None:
        """Force one kernel for every row count ("auto": back to the default rules). The old path names
        are accepted: "cpu" is tf_qgemm ("qgemm"). ValueError when it cannot run this layer."""
        name = KERNEL_ALIASES.get(name, name)
        self.plan = default_plan(self) if name == "auto" else forced_plan(self, name)

    def packed_supported(self) -> bool:
        return False

    def build_packed(self):
        raise NotImplementedError

    def packed_matmul(self, state, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    # tokenfab's C kernel (tokenfab/kernels): reads the quantized weight directly, activations as int16
    # blocks. Subclasses that support it return its layout here.
    def cpu_layout(self) -> tuple | None:
        """(q, d, m, group_size, bits) for kernels.qgemm, or None."""
        return None

    def qgemm_layout(self) -> tuple | None:
        """The tf_qgemm layout this layer's plan prepared, when its plan runs qgemm for every row
        count up to `rows`, there is no bias and no input scale: what the one-call decode stack needs."""
        return None if self.plan is None else self.plan.state_of("qgemm")

    def config(self) -> dict[str, Any]:
        """What a checkpoint needs to rebuild this module before loading its tensors."""
        return {"type": type(self).__name__, "in_features": self.in_features,
                "out_features": self.out_features, "bias": self.bias is not None}

    def weight_bytes(self) -> int:
        """Bytes of the saved weight representation (buffers, bias excluded)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, kernel={self.kernel}")


class Int8Linear(QuantLinear):
    """int8 weights with one symmetric scale per output channel: w = q * scale[row]."""
    weight_format = "int8"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(qweight.shape[1], qweight.shape[0], bias)
        self.register_buffer("qweight", qweight.to(torch.int8).contiguous())
        self.register_buffer("scales", scales.float().contiguous())

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Int8Linear":
        return cls(*quantize_int8(weight.detach()), bias)

    @classmethod
    def empty(cls, cfg: dict) -> "Int8Linear":
        n, k = cfg["out_features"], cfg["in_features"]
        return cls(torch.zeros(n, k, dtype=torch.int8), torch.ones(n), torch.zeros(n) if cfg["bias"] else None)

    def dequantize(self, dtype=torch.float32):
        return dequantize_int8(self.qweight, self.scales, dtype)

    def packed_supported(self):
        return kernels.int8pack_supported(self.out_features, self.in_features)

    def cpu_layout(self):
        # one group spanning the row: the per-channel scale
        return (self.qweight.contiguous(), self.scales[:, None].contiguous(), None, self.in_features, 8) \
            if self.in_features % 32 == 0 else None

    def build_packed(self):
        # _weight_int8pack_mm's AVX-512 path faults on int8 weights that do not start on 64 bytes, which
        # tensors read from a safetensors file (mapped at the header's offsets) often do: an aligned copy
        # replaces them (torch's CPU allocator aligns to 64)
        if self.qweight.data_ptr() % 64:
            self.qweight = self.qweight.clone()
        return self.scales.to(torch.bfloat16)

    def packed_matmul(self, state, x):
        return kernels.int8pack_linear(x, self.qweight, state)


class W8A8Linear(Int8Linear):
    """int8 weights per output channel (as `Int8Linear`) and int8 activations per token, quantized on
    the fly: the matmul runs in integers through FBGEMM (`kernels.w8a8_linear`), several times faster
    than a float GEMM on CPUs without bf16 units. Where FBGEMM is missing (CUDA, other CPUs) it runs
    as `Int8Linear`, weights-only."""
    weight_format = "w8a8"


class Int4Linear(QuantLinear):
    """int4 weights in groups along `in`: w = (q - 8) * scale[row, g] + zero[row, g].

    `input_scale` (AWQ) multiplies x per input channel before the matmul; the stored weight was
    scaled by its inverse before quantization, so the float product is unchanged.
    """
    weight_format = "int4"

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 in_features: int, bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None):
        super().__init__(in_features, q.shape[0], bias)
        self.group_size = group_size
        self.padded_in = q.shape[1]
        assert self.padded_in == padded_in_features(in_features, group_size), (q.shape, in_features, group_size)
        self.register_buffer("qweight", pack_nibbles(q).contiguous())          # [out, padded_in / 2]
        self.register_buffer("scales", scales.float().contiguous())            # [out, groups]
        self.register_buffer("zeros", zeros.float().contiguous())              # [out, groups]
        self.register_buffer("input_scale", None if input_scale is None else input_scale.float().contiguous())

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, group_size: int = 32,
                   input_scale: torch.Tensor | None = None) -> "Int4Linear":
        """Quantize `weight`; with `input_scale` s, quantizes weight / s (columns) and computes (x * s) @ that."""
        w = weight.detach().float()
        if input_scale is not None:
            w = w / input_scale.float()[None, :]
        q, s, z = quantize_int4(w, group_size)
        return cls(q, s, z, group_size, weight.shape[1], bias, input_scale)

    @classmethod
    def empty(cls, cfg: dict) -> "Int4Linear":
        n, k, g = cfg["out_features"], cfg["in_features"], cfg["group_size"]
        kp = padded_in_features(k, g)
        return cls(torch.zeros(n, kp, dtype=torch.uint8), torch.ones(n, kp // g), torch.zeros(n, kp // g), g, k,
                   torch.zeros(n) if cfg["bias"] else None, torch.ones(k) if cfg.get("input_scale") else None)

    def config(self):
        return {**super().config(), "group_size": self.group_size, "input_scale": self.input_scale is not None}

    def unpacked_q(self) -> torch.Tensor:
        return unpack_nibbles(self.qweight)

    def dequantize(self, dtype=torch.float32):
        """The weight applied to the *scaled* input (x * input_scale), [out, in]."""
        return dequantize_int4(self.unpacked_q(), self.scales, self.zeros, self.group_size, self.in_features, dtype)

    @property
    def input_scale_tensor(self):
        return self.input_scale

    def packed_supported(self):
        return kernels.int4pack_supported(self.out_features, self.padded_in, self.group_size)

    def cpu_layout(self):
        if self.group_size % 32:
            return None
        q = self.unpacked_q()
        n, kp = q.shape
        blocks = q.view(n, kp // 32, 2, 16)        # GGUF's nibble order: byte j = weight j | weight j + 16
        packed = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).contiguous().view(n, kp // 2)
        return packed, self.scales.contiguous(), (self.zeros - 8 * self.scales).contiguous(), self.group_size, 4

    def build_packed(self):
        return kernels.pack_int4(self.unpacked_q()), kernels.int4_scales_and_zeros(self.scales, self.zeros)

    def packed_matmul(self, state, x):
        packed, sz = state
        return kernels.int4pack_linear(x, packed, self.group_size, sz, self.padded_in)

    def extra_repr(self):
        return super().extra_repr() + f", group_size={self.group_size}, awq={self.input_scale is not None}"


class Int4BlockLinear(QuantLinear):
    """int4 blocks of 32 along `in`, stored exactly as the C kernels read them (tf_qgemm's int4 layout): GGUF's
    nibble order (byte j of a block holds weight j low, weight j + 16 high) and a float32 scale d and
    offset m per block, w = d * q + m with q 0..15. `cpu_layout` hands these buffers over as they are, so
    the kernels keep no second copy of the weights.

    GGUF's Q4_0 and Q4_1 blocks hold exactly this (the subclasses below keep the file's nibble bytes).
    GGUF's Q4_K is built this way at load (`from_q4_k`): a Q4_K sub-block of 32 is 4-bit codes with the
    scale d * sc and the minimum dmin * mn (fp16 super-block scales times 6-bit ones, each product exact
    in float32), so the blocks decode to the same floats, bit for bit, as gguf's dequantizer computes,
    and every int4 kernel runs them: 6 bits per weight in memory instead of the file's 4.5."""
    weight_format = "int4"
    group_size = gguf_blocks.BLOCK
    source: ClassVar[str] = "int4"      # what the blocks came from (a GGUF type), for repr and checkpoints

    def __init__(self, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor, in_features: int,
                 bias: torch.Tensor | None = None, source: str | None = None):
        super().__init__(in_features, qs.shape[0], bias)
        assert qs.dtype == torch.uint8 and qs.shape[1] * 2 == in_features and in_features % self.group_size == 0
        if source is not None:
            self.source = source
        self.register_buffer("qweight", qs.contiguous())                       # [out, in / 2]
        self.register_buffer("scales", d.float().contiguous())                 # [out, in / 32]
        self.register_buffer("offsets", m.float().contiguous())                # [out, in / 32]

    @classmethod
    def from_codes(cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None = None):
        """From codes 0..15 in weight order, uint8 [out, in], and d, m float [out, in / 32]."""
        n, k = q.shape
        b = q.to(torch.uint8).view(n, k // 32, 2, 16)
        return cls((b[:, :, 0] | (b[:, :, 1] << 4)).reshape(n, k // 2), d, m, k, bias)

    @classmethod
    def from_q4_k(cls, blocks, out_features: int, in_features: int, bias: torch.Tensor | None = None):
        from tokenfab.quant.kquants import q4_k_as_int4_blocks
        qs, d, m = q4_k_as_int4_blocks(blocks, out_features, in_features)
        return cls(torch.from_numpy(qs), torch.from_numpy(d), torch.from_numpy(m), in_features, bias, "Q4_K")

    @classmethod
    def empty(cls, cfg: dict) -> "Int4BlockLinear":
        n, k = cfg["out_features"], cfg["in_features"]
        g = k // cls.group_size
        return cls(torch.zeros(n, k // 2, dtype=torch.uint8), torch.ones(n, g), torch.zeros(n, g), k,
                   torch.zeros(n) if cfg["bias"] else None, cfg.get("source"))

    def config(self):
        return {**super().config(), "source": self.source}

    def unpacked_q(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Codes 0..15 as uint8 [rows, in], in weight order."""
        qs = self.qweight if rows is None else self.qweight[rows]
        b = qs.view(qs.shape[0], -1, 16)
        return torch.cat([b & 0x0F, b >> 4], dim=2).view(qs.shape[0], self.in_features)

    def _rows(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, dtype) -> torch.Tensor:
        n = q.shape[0]
        w = q.view(n, -1, self.group_size).float() * d[..., None] + m[..., None]     # d * q + m, in float32
        return w.view(n, self.in_features).to(dtype)

    def dequantize(self, dtype=torch.float32):
        return self._rows(self.unpacked_q(), self.scales, self.offsets, dtype)

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `ids` decoded: a tied token embedding served from these blocks keeps no float copy."""
        flat = ids.reshape(-1)
        w = self._rows(self.unpacked_q(flat), self.scales[flat], self.offsets[flat], dtype)
        return w.reshape(*ids.shape, self.in_features)

    @property
    def zeros(self) -> torch.Tensor:
        """Int4Linear's zero for the same weights: w = (q - 8) * scale + zero, so zero = m + 8 d."""
        return self.offsets + 8 * self.scales

    def packed_supported(self):
        return kernels.int4pack_supported(self.out_features, self.in_features, self.group_size)

    def cpu_layout(self):
        return self.qweight, self.scales, self.offsets, self.group_size, 4

    def build_packed(self):       # torch's int4 packing
        return kernels.pack_int4(self.unpacked_q()), kernels.int4_scales_and_zeros(self.scales, self.zeros)

    def packed_matmul(self, state, x):
        packed, sz = state
        return kernels.int4pack_linear(x, packed, self.group_size, sz, self.in_features)

    def extra_repr(self):
        return super().extra_repr() + f", gguf={self.source}" * (self.source != "int4")


class Q4_0Linear(Int4BlockLinear):
    """GGUF Q4_0 as shipped, w = d * (q - 8) in blocks of 32: the file's nibble bytes as they are, scale d and
    offset -8 d (both exact in float32, and d * q - 8 d == d * (q - 8) exactly)."""
    source = "Q4_0"

    @classmethod
    def from_gguf(cls, data, out_features: int, in_features: int, bias: torch.Tensor | None = None) -> "Q4_0Linear":
        qs, d = gguf_blocks.decode_q4_0(data, out_features, in_features)
        return cls(qs, d, -8 * d, in_features, bias)


class Q4_1Linear(Int4BlockLinear):
    """GGUF Q4_1 as shipped, w = d * q + m in blocks of 32: the file's nibble bytes, scale d and offset m."""
    source = "Q4_1"

    @classmethod
    def from_gguf(cls, data, out_features: int, in_features: int, bias: torch.Tensor | None = None) -> "Q4_1Linear":
        return cls(*gguf_blocks.decode_q4_1(data, out_features, in_features), in_features, bias)


class Q8_0Linear(QuantLinear):
    """GGUF Q8_0 as shipped: w = d[row, g] * q in blocks of 32 (q int8)."""
    weight_format = "q8_0"
    group_size = gguf_blocks.BLOCK

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(qweight.shape[1], qweight.shape[0], bias)
        self.register_buffer("qweight", qweight.to(torch.int8).contiguous())   # [out, in]
        self.register_buffer("scales", scales.float().contiguous())            # [out, in / 32]

    @classmethod
    def from_gguf(cls, data, out_features: int, in_features: int, bias: torch.Tensor | None = None) -> "Q8_0Linear":
        return cls(*gguf_blocks.decode_q8_0(data, out_features, in_features), bias)

    @classmethod
    def empty(cls, cfg: dict) -> "Q8_0Linear":
        n, k = cfg["out_features"], cfg["in_features"]
        return cls(torch.zeros(n, k, dtype=torch.int8), torch.ones(n, k // cls.group_size),
                   torch.zeros(n) if cfg["bias"] else None)

    def dequantize(self, dtype=torch.float32):
        n, k = self.qweight.shape
        w = self.qweight.view(n, -1, self.group_size).to(dtype) * self.scales.to(dtype)[..., None]
        return w.view(n, k)

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `ids` dequantized: lets a tied Q8_0 token embedding serve lookups without a float copy."""
        q = self.qweight[ids.reshape(-1)]
        rows = q.view(q.shape[0], -1, self.group_size).to(dtype) * self.scales[ids.reshape(-1)].to(dtype)[..., None]
        return rows.reshape(*ids.shape, self.in_features)

    def packed_supported(self):
        return kernels.int4pack_supported(self.out_features, 2 * self.in_features, self.group_size)

    def cpu_layout(self):
        return self.qweight.contiguous(), self.scales.contiguous(), None, self.group_size, 8

    def build_packed(self):
        q = self.qweight.to(torch.int16)
        hi, lo = (q >> 4) + 8, q & 0x0F                    # q = 16 * (hi - 8) + lo, both 0..15
        d = self.scales
        scales = torch.cat([16 * d, d], dim=1)
        zeros = torch.cat([torch.zeros_like(d), 8 * d], dim=1)   # lo half: (lo - 8) * d + 8 d = lo * d
        return kernels.pack_int4(torch.cat([hi, lo], dim=1)), kernels.int4_scales_and_zeros(scales, zeros)

    def packed_matmul(self, state, x):
        packed, sz = state
        return kernels.int4pack_linear(torch.cat([x, x], dim=1), packed, self.group_size, sz, 2 * self.in_features)

    def extra_repr(self):
        return super().extra_repr() + ", gguf=Q8_0"


class Q5_0Linear(Q8_0Linear):
    """GGUF Q5_0, w = d * (q - 16) in blocks of 32: widened losslessly into Q8_0's int8 form (q - 16 fits
    an int8), so every Q8_0 kernel runs it; 9 bits per weight in memory instead of the file's 5.5.
    llama.cpp's Q4_K_M files use it for tensors whose width is not a multiple of 256 (Gemma 3's 640)."""

    @classmethod
    def from_gguf(cls, data, out_features: int, in_features: int, bias: torch.Tensor | None = None) -> "Q5_0Linear":
        return cls(*gguf_blocks.decode_q5_0(data, out_features, in_features), bias)

    def extra_repr(self):
        return super().extra_repr().replace("gguf=Q8_0", "gguf=Q5_0")


LINEAR_TYPES: dict[str, type[QuantLinear]] = {
    c.__name__: c for c in (Int8Linear, W8A8Linear, Int4Linear, Int4BlockLinear, Q4_0Linear, Q4_1Linear, Q8_0Linear,
                            Q5_0Linear)}


GGUF_LINEAR_TYPES: dict[str, type[QuantLinear]] = {"Q4_0": Q4_0Linear, "Q4_1": Q4_1Linear, "Q8_0": Q8_0Linear,
                                                   "Q5_0": Q5_0Linear}


def gguf_linear(data, type_name: str, out_features: int, in_features: int,
                bias: torch.Tensor | None = None, as_stored: bool = False) -> QuantLinear | None:
    """A native layer for a GGUF tensor of type Q4_0 / Q4_1 / Q8_0 / Q2_K..Q6_K, or None for types that must be
    dequantized. `data` is `GGUFReader`'s uint8 [rows, bytes]; rows can be permuted or concatenated
    (e.g. q, k and v into one fused projection) before the call, since each row's blocks stand alone.
    Q4_K and Q4_0 load as int4 blocks unless `as_stored` (see `blocks_as_stored` in kquants.py)."""
    from tokenfab.quant.kquants import KQUANT_LINEAR_TYPES, Q4_0BlocksLinear     # blocks as stored
    if type_name == "Q4_K" and not as_stored:                  # the int4 kernels' layout, lossless
        return Int4BlockLinear.from_q4_k(data, out_features, in_features, bias)
    if type_name == "Q4_0" and as_stored:
        return Q4_0BlocksLinear.from_gguf(data, out_features, in_features, bias)
    cls = GGUF_LINEAR_TYPES.get(type_name) or KQUANT_LINEAR_TYPES.get(type_name)
    return None if cls is None else cls.from_gguf(data, out_features, in_features, bias)


def empty_from_config(cfg: dict) -> QuantLinear:
    """A module of the right type and shapes, ready for `load_state_dict` (used by checkpoint loading)."""
    from tokenfab.quant.kquants import KQUANT_LINEAR_TYPES, Q4_0BlocksLinear
    types = {**LINEAR_TYPES, **{c.__name__: c for c in (*KQUANT_LINEAR_TYPES.values(), Q4_0BlocksLinear)}}
    cls = types.get(cfg.get("type", ""))
    if cls is None:
        raise ValueError(f"unknown quantized linear type {cfg.get('type')!r}; known: {sorted(types)}")
    return cls.empty(cfg)


def set_kernel(model: nn.Module, kernel: str) -> int:
    """Force one linear kernel on every quantized linear ("auto": the default rules; "cpu" is an alias
    of "qgemm"); returns how many. ValueError naming the kernels when the name is unknown or a layer
    cannot run it."""
    name = KERNEL_ALIASES.get(kernel, kernel)
    if name != "auto":
        from tokenfab.kernels.linear import get
        get(name)
    mods = [m for m in model.modules() if isinstance(m, QuantLinear)]
    for m in mods:
        m.kernel = name
    return len(mods)
