"""Number formats and how many bytes one element costs, group-wise scales included.

A quantized weight costs its own bits plus its share of the group's scale (and zero point): int4
with one fp16 scale per 128 weights is 4 + 16/128 = 4.125 bits. GGUF block formats are written the
same way (Q4_1: 4 bits + an fp16 scale and an fp16 minimum per 32 = 5 bits). `bpw:5.03` states the
bits per weight directly, which is how a GGUF file's measured size is carried.
"""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DType:
    name: str
    bits: float                  # bits of one element
    group_size: int = 0          # elements sharing one scale; 0: no per-group scale
    group_bits: int = 0          # bits of per-group metadata (scale, plus zero point if asymmetric)

    @property
    def bits_per_element(self) -> float:
        return self.bits + (self.group_bits / self.group_size if self.group_size else 0.0)

    @property
    def bytes_per_element(self) -> float:
        return self.bits_per_element / 8

    def nbytes(self, num_elements: float) -> float:
        return num_elements * self.bytes_per_element

    def __str__(self) -> str:
        return self.name


# Plain formats; as activations their names are also the catalog's peak-FLOPS keys.
_BASE = {
    "fp32": DType("fp32", 32),
    "bf16": DType("bf16", 16),
    "fp16": DType("fp16", 16),
    "fp8": DType("fp8", 8),          # per-tensor scale: negligible overhead
    "int8": DType("int8", 8),       # per-channel scale: negligible overhead
    # Weight-only int4 default: symmetric, one fp16 scale per 128 weights (GPTQ/AWQ's usual group).
    "int4": DType("int4", 4, group_size=128, group_bits=16),
    # GGUF block formats (ggml's block layouts: bits of data + fp16 scale [+ fp16 min] per block).
    "q8_0": DType("q8_0", 8, group_size=32, group_bits=16),
    "q4_0": DType("q4_0", 4, group_size=32, group_bits=16),
    "q4_1": DType("q4_1", 4, group_size=32, group_bits=32),
    "q5_0": DType("q5_0", 5, group_size=32, group_bits=16),
    "q5_1": DType("q5_1", 5, group_size=32, group_bits=32),
    # k-quants: 256-element super-blocks; ggml's own bits-per-weight figures.
    "q2_k": DType("q2_k", 2.625),
    "q3_k": DType("q3_k", 3.4375),
    "q4_k": DType("q4_k", 4.5),
    "q5_k": DType("q5_k", 5.5),
    "q6_k": DType("q6_k", 6.5625),
}
_ALIASES = {"float32": "fp32", "f32": "fp32", "bfloat16": "bf16", "float16": "fp16", "f16": "fp16",
            "half": "fp16", "float8": "fp8", "fp8_e4m3": "fp8", "q4_k_m": "q4_k", "q5_k_m": "q5_k"}
_GROUPED = re.compile(r"^(int4|int8)-g(\d+)(-asym)?$")
_BPW = re.compile(r"^bpw:(\d+(\.\d+)?)$")

DTYPE_NAMES = sorted(_BASE) + ["int4-gN", "int4-gN-asym", "int8-gN", "bpw:X"]


def parse_dtype(spec: str | DType) -> DType:
    """'fp16', 'int4', 'int4-g32', 'int4-g64-asym', 'q4_1', 'bpw:5.03' → DType."""
    if isinstance(spec, DType):
        return spec
    s = spec.strip().lower()
    s = _ALIASES.get(s, s)
    if s in _BASE:
        return _BASE[s]
    if m := _GROUPED.match(s):
        bits, group = int(m.group(1)[3:]), int(m.group(2))
        if group < 1:
            raise ValueError(f"group size in {spec!r} must be positive")
        # Asymmetric groups carry an fp16 zero point next to the fp16 scale.
        return DType(s, bits, group_size=group, group_bits=32 if m.group(3) else 16)
    if m := _BPW.match(s):
        bits = float(m.group(1))
        if not 0 < bits <= 32:
            raise ValueError(f"bits per weight in {spec!r} must be in (0, 32]")
        return DType(s, bits)
    raise ValueError(f"unknown dtype {spec!r}; known: {', '.join(DTYPE_NAMES)}")
