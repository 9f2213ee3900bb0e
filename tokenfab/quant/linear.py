"""Drop-in replacements for `nn.Linear` that hold quantized weights: `forward(x[..., in]) -> [..., out]`.

- `Int8Linear`: int8 per output channel (scheme "int8").
- `W8A8Linear`: the same weights, and activations quantized to int8 per token (scheme "w8a8").
- `Int4Linear`: int4 in groups along `in`, asymmetric, optionally with an AWQ input scale
  (schemes "int4-g*", "awq-int4-g*").
- `Q4_0Linear`, `Q4_1Linear`: GGUF blocks as shipped, run by the int4 kernels without requantizing.
- `Q8_0Linear`: GGUF int8 blocks of 32 with one scale each. torch has no int8 kernel with group
  scales, so the packed path splits each int8 q into two nibbles, q = 16 * hi + lo, and runs both
  halves through the int4 kernel at once (scale 16 d for hi, scale d for lo): exact, and 1 byte/weight.

Each module keeps its weights in a portable form (buffers, saved in checkpoints) and builds the
packed layout of the CPU kernels lazily, on first use. `kernel` picks the path: "auto" (by
measurement, see kernels.py), "packed" or "dequant" (expand, then F.linear; exact reference).
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from tokenfab import kernels as cpu_kernels
from tokenfab.model.layers import onednn_linear, onednn_pack
from tokenfab.quant import gguf_blocks, kernels
from tokenfab.quant.schemes import (dequantize_int4, dequantize_int8, pack_nibbles, padded_in_features,
                                    quantize_int4, quantize_int8, unpack_nibbles)


class QuantLinear(nn.Module):
    """Base class: bias handling, shape handling, kernel choice and the packed-weight cache."""
    kind: ClassVar[str]          # key into kernels.PACKED_MAX_TOKENS

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.kernel = "auto"
        self._packed: tuple | None = None
        # float_cache: keep the dequantized weight (float32, oneDNN layout) for calls above the packed
        # kernels' token limit, instead of expanding the weight on every call. Costs the float weight's
        # memory; the engine turns it on when that fits its budget (engine.py).
        self.float_cache = False
        self._float: torch.Tensor | None = None
        self._cpu: tuple | None = None          # the layout of tokenfab's C kernel (cpu_layout)
        if bias is not None:
            self.bias = nn.Parameter(bias.detach().float().clone(), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    # subclasses implement these three
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight this layer computes with, [out, in], as `nn.Linear.weight` would hold it."""
        raise NotImplementedError

    def packed_supported(self) -> bool:
        raise NotImplementedError

    def _packed_matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def _float_weight(self) -> torch.Tensor:
        """The float_cache copy, built on first use."""
        if self._float is None:
            self._float = onednn_pack(self.dequantize(torch.float32))
        return self._float

    # tokenfab's C kernel (tokenfab/kernels): reads the quantized weight directly, activations as int16
    # blocks, for up to QGEMM_MAX_ROWS rows. Subclasses that support it return its layout here.
    def cpu_layout(self) -> tuple | None:
        """(q, d, m, group_size, bits) for kernels.qgemm, or None."""
        return None

    def qgemm_layout(self) -> tuple | None:
        """cpu_layout(), built once; None when this layer has none or its input is not in 32-blocks."""
        if self._cpu is None:
            self._cpu = (self.cpu_layout() if self.in_features % 32 == 0 else None) or ()
        return self._cpu or None

    def _cpu_matmul(self, x: torch.Tensor) -> torch.Tensor | None:
        if x.shape[0] > cpu_kernels.QGEMM_MAX_ROWS or not cpu_kernels.usable(x) or self.qgemm_layout() is None:
            return None
        q, d, m, gs, bits = self._cpu
        if x.shape[1] != q.shape[1] * (2 if bits == 4 else 1):          # int4 rows padded to whole groups
            x = F.pad(x, (0, q.shape[1] * 2 - x.shape[1]))
        return cpu_kernels.qgemm(x, q, d, m, gs, bits, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = self._prepare_input(x.reshape(-1, self.in_features))
        y = None
        if self.kernel == "cpu" or (self.kernel == "auto" and kernels.use_cpu_kernel(x2)):
            y = self._cpu_matmul(x2)
            if y is None and self.kernel == "cpu":
                raise ValueError(f"kernel='cpu' is not available for this {self.kind} layer with {x2.shape[0]} rows "
                                 f"on {x2.device.type} (tokenfab's C kernel: CPU, float32, up to "
                                 f"{cpu_kernels.QGEMM_MAX_ROWS} rows); use 'auto'")
        cached = y is None and self.float_cache and kernels.float_cache_usable(x2)
        if y is not None:
            if self.bias is not None:
                y = y + self.bias
        elif kernels.use_packed(self.kind, self.kernel, x2, self.packed_supported(),
                                self.in_features * self.out_features, cached):
            y = self._packed_matmul(x2)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
        elif cached:
            y = onednn_linear(x2, self._float_weight(), self.bias)
        else:
            bias = None if self.bias is None else self.bias.to(x2.dtype)
            y = F.linear(x2, self.dequantize(x2.dtype), bias)
        return y.reshape(*lead, self.out_features)

    def config(self) -> dict[str, Any]:
        """What a checkpoint needs to rebuild this module before loading its tensors."""
        return {"type": type(self).__name__, "in_features": self.in_features,
                "out_features": self.out_features, "bias": self.bias is not None}

    def weight_bytes(self) -> int:
        """Bytes of the saved weight representation (buffers, bias excluded)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    # the packed layout depends on the buffers and the device: rebuild after either changes
    def _apply(self, fn, recurse=True):
        self._packed = self._float = self._cpu = None
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs):
        self._packed = self._float = self._cpu = None
        return super()._load_from_state_dict(*args, **kwargs)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, kernel={self.kernel}")


class Int8Linear(QuantLinear):
    """int8 weights with one symmetric scale per output channel: w = q * scale[row]."""
    kind = "int8"

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

    def _packed_matmul(self, x):
        if self._packed is None:
            self._packed = (self.scales.to(torch.bfloat16),)
        return kernels.int8pack_linear(x, self.qweight, self._packed[0])


class W8A8Linear(Int8Linear):
    """int8 weights per output channel (as `Int8Linear`) and int8 activations per token, quantized on
    the fly: the matmul runs in integers through FBGEMM (`kernels.w8a8_linear`), several times faster
    than a float GEMM on CPUs without bf16 units. Where FBGEMM is missing (CUDA, other CPUs) it runs
    as `Int8Linear`, weights-only."""
    kind = "w8a8"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "dequant" or not kernels.w8a8_supported(x):
            return super().forward(x)
        if self._packed is None:
            self._packed = (kernels.w8a8_pack(self.qweight, self.scales),)
        lead = x.shape[:-1]
        y = kernels.w8a8_linear(x.reshape(-1, self.in_features), self._packed[0])
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*lead, self.out_features)


class Int4Linear(QuantLinear):
    """int4 weights in groups along `in`: w = (q - 8) * scale[row, g] + zero[row, g].

    `input_scale` (AWQ) multiplies x per input channel before the matmul; the stored weight was
    scaled by its inverse before quantization, so the float product is unchanged.
    """
    kind = "int4"

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

    def _prepare_input(self, x):
        return x if self.input_scale is None else x * self.input_scale.to(x.dtype)

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

    def _packed_matmul(self, x):
        if self._packed is None:
            self._packed = (kernels.pack_int4(self.unpacked_q()), kernels.int4_scales_and_zeros(self.scales, self.zeros))
        packed, sz = self._packed
        return kernels.int4pack_linear(x, packed, self.group_size, sz, self.padded_in)

    def extra_repr(self):
        return super().extra_repr() + f", group_size={self.group_size}, awq={self.input_scale is not None}"


class Q4_0Linear(Int4Linear):
    """GGUF Q4_0 as shipped: w = d * (q - 8) in blocks of 32, i.e. scale d and zero 0."""

    @classmethod
    def from_gguf(cls, data, out_features: int, in_features: int, bias: torch.Tensor | None = None) -> "Q4_0Linear":
        q, d = gguf_blocks.decode_q4_0(data, out_features, in_features)
        return cls(q, d, torch.zeros_like(d), gguf_blocks.BLOCK, in_features, bias)


class Q4_1Linear(Int4Linear):
    """GGUF Q4_1 as shipped: w = d * q + m in blocks of 32, i.e. scale d and zero m + 8 d."""

    @classmethod
    def from_gguf(cls, data, out_features: int, in_features: int, bias: torch.Tensor | None = None) -> "Q4_1Linear":
        q, d, m = gguf_blocks.decode_q4_1(data, out_features, in_features)
        return cls(q, d, m + 8 * d, gguf_blocks.BLOCK, in_features, bias)


class Q8_0Linear(QuantLinear):
    """GGUF Q8_0 as shipped: w = d[row, g] * q in blocks of 32 (q int8)."""
    kind = "q8_0"
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

    def _build_packed(self):
        q = self.qweight.to(torch.int16)
        hi, lo = (q >> 4) + 8, q & 0x0F                    # q = 16 * (hi - 8) + lo, both 0..15
        d = self.scales
        scales = torch.cat([16 * d, d], dim=1)
        zeros = torch.cat([torch.zeros_like(d), 8 * d], dim=1)   # lo half: (lo - 8) * d + 8 d = lo * d
        return kernels.pack_int4(torch.cat([hi, lo], dim=1)), kernels.int4_scales_and_zeros(scales, zeros)

    def _packed_matmul(self, x):
        if self._packed is None:
            self._packed = self._build_packed()
        packed, sz = self._packed
        return kernels.int4pack_linear(torch.cat([x, x], dim=1), packed, self.group_size, sz, 2 * self.in_features)

    def extra_repr(self):
        return super().extra_repr() + ", gguf=Q8_0"


LINEAR_TYPES: dict[str, type[QuantLinear]] = {
    c.__name__: c for c in (Int8Linear, W8A8Linear, Int4Linear, Q4_0Linear, Q4_1Linear, Q8_0Linear)}


GGUF_LINEAR_TYPES: dict[str, type[QuantLinear]] = {"Q4_0": Q4_0Linear, "Q4_1": Q4_1Linear, "Q8_0": Q8_0Linear}


def gguf_linear(data, type_name: str, out_features: int, in_features: int,
                bias: torch.Tensor | None = None) -> QuantLinear | None:
    """A native layer for a GGUF tensor of type Q4_0 / Q4_1 / Q8_0, or None for types that must be
    dequantized. `data` is `GGUFReader`'s uint8 [rows, bytes]; rows can be permuted or concatenated
    (e.g. q, k and v into one fused projection) before the call, since each row's blocks stand alone."""
    cls = GGUF_LINEAR_TYPES.get(type_name)
    return None if cls is None else cls.from_gguf(data, out_features, in_features, bias)


def empty_from_config(cfg: dict) -> QuantLinear:
    """A module of the right type and shapes, ready for `load_state_dict` (used by checkpoint loading)."""
    cls = LINEAR_TYPES.get(cfg.get("type", ""))
    if cls is None:
        raise ValueError(f"unknown quantized linear type {cfg.get('type')!r}; known: {sorted(LINEAR_TYPES)}")
    return cls.empty(cfg)


def enable_float_cache(model: nn.Module, max_bytes: int) -> int:
    """Turn on `float_cache` in every quantized linear if their float32 weights fit in `max_bytes`
    together (all or none), and build the copies now. Returns the bytes they take (0: off)."""
    mods = [m for m in model.modules() if isinstance(m, QuantLinear) and not isinstance(m, W8A8Linear)]
    need = sum(4 * m.in_features * m.out_features for m in mods)
    on = 0 < need <= max_bytes
    for m in mods:
        m.float_cache = on
        m._float = m._float_weight() if on else None      # built now, not on a first big batch
    return need if on else 0


def set_kernel(model: nn.Module, kernel: str) -> int:
    """Set the kernel path ("auto" | "cpu" | "packed" | "dequant") on every quantized linear; returns how many."""
    if kernel not in kernels.KERNELS:
        raise ValueError(f"kernel must be one of {kernels.KERNELS}, got {kernel!r}")
    mods = [m for m in model.modules() if isinstance(m, QuantLinear)]
    for m in mods:
        m.kernel = kernel
    return len(mods)
