"""The linear-kernel seam: one interface, a registry, and the per-layer plan chosen once at load.

A *linear* is any module that computes x @ W.T + b from some stored form of W (its *weight format*:
"float", "int8", "int4", "q8_0", "w8a8"). A *kernel* is one way to run a format on some machine for
some row counts: oneDNN's prepacked float GEMM, torch's packed int4/int8 kernels, tokenfab's C
`tf_qgemm`, a float copy of a quantized weight, expand-then-F.linear. Each is registered here once:

    register(MyKernel())                    # name, formats, supports(), prepare(), run()

At load every linear gets a `LinearPlan`: a short list of (largest row count, kernel, prepared state),
from the measured table (tokenfab/kernels/tuning.py) or a forced kernel. The forward pass runs the
plan's kernel for its row count and nothing else: no checks per call, no cascade.

This module sits below both tokenfab.model and tokenfab.quant and imports neither: the float kernels
are registered here, the quantized formats' kernels by tokenfab/quant/kernels.py, which every
quantized layer's module imports (so they are registered before any quantized layer exists).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from tokenfab import registry


@runtime_checkable
class LinearKernel(Protocol):
    """One registered implementation: a weight format x instruction set x batch regime."""
    name: str                       # unique, e.g. "qgemm"; what EngineConfig.linear_kernel names
    formats: tuple[str, ...]        # weight formats it runs
    tune_max_rows: int | None       # above this row count it is a known loser: not timed, not chosen
    float_copy: bool                # its state is a float copy of the weight (counts in the memory budget;
                                    # such kernels also say copy_bytes, bytes per weight)
    rank: int                       # preference when measured times tie (lower first)
    lossy: bool                     # rounds activations below the compute dtype (chosen only when much faster)
    # optional: layout: str         # kernels naming the same layout share one prepared state in a plan

    def supports(self, layer: "KernelLinear") -> str | None:
        """None when it can run `layer` on this machine, else why not (said to a user who forced it)."""

    def prepare(self, layer: "KernelLinear") -> Any:
        """Whatever run() needs (a packed layout), built once at load."""

    def run(self, state: Any, x: torch.Tensor, layer: "KernelLinear") -> torch.Tensor:
        """x [T, in] (contiguous rows, already input-scaled) -> [T, out], bias not added."""


# GGUF's K-quant blocks run as stored (tokenfab/quant/kquants.py): one format per block type.
KQUANT_FORMATS = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k")
STORED_FORMATS = ("q4_0",) + KQUANT_FORMATS       # every GGUF block type held as the file stores it

_REGISTRY: dict[str, LinearKernel] = {}
registry.register("linear_kernel", "auto")      # EngineConfig.linear_kernel: auto, or a kernel forced


def register(kernel: LinearKernel) -> LinearKernel:
    """Add a kernel (replacing one of the same name)."""
    _REGISTRY[kernel.name] = kernel
    registry.register("linear_kernel", kernel.name)
    return kernel


def registered(fmt: str | None = None) -> list[LinearKernel]:
    return [k for k in _REGISTRY.values() if fmt is None or fmt in k.formats]


def get(name: str) -> LinearKernel:
    if name not in _REGISTRY:
        raise ValueError(f"unknown linear kernel {name!r}; registered: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def candidates(layer: "KernelLinear") -> list[LinearKernel]:
    """The registered kernels that can run this layer here, in preference order."""
    return [k for k in registered(layer.weight_format) if k.supports(layer) is None]


@dataclass(slots=True)
class Choice:
    max_rows: int | None            # this kernel runs calls of up to max_rows rows (None: any)
    kernel: LinearKernel
    state: Any


class LinearPlan:
    """The kernels one linear runs, by row count; built once, then only called."""
    __slots__ = ("choices",)

    def __init__(self, choices: list[Choice]):
        assert choices and choices[-1].max_rows is None, "the last choice must take any row count"
        self.choices = choices

    def __call__(self, x: torch.Tensor, layer: "KernelLinear") -> torch.Tensor:
        T = x.shape[0]
        for c in self.choices:
            if c.max_rows is None or T <= c.max_rows:
                return c.kernel.run(c.state, x, layer)
        raise AssertionError("unreachable: the last choice takes any row count")

    def kernel_at(self, rows: int) -> Choice:
        for c in self.choices:
            if c.max_rows is None or rows <= c.max_rows:
                return c
        raise AssertionError("unreachable")

    def state_of(self, name: str) -> Any:
        """The prepared state of kernel `name` in this plan, or None."""
        for c in self.choices:
            if c.kernel.name == name:
                return c.state
        return None

    def names(self) -> list[tuple[int | None, str]]:
        return [(c.max_rows, c.kernel.name) for c in self.choices]

    def float_copy_bytes(self) -> int:
        return sum(c.state.numel() * c.state.element_size() for c in self.choices
                   if c.kernel.float_copy and isinstance(c.state, torch.Tensor))


def merge_ranges(ranges: list[tuple[int | None, str]]) -> list[tuple[int | None, str]]:
    """[(max_rows, kernel name)], ascending, with neighbours that name the same kernel merged."""
    merged: list[tuple[int | None, str]] = []
    for rows, name in ranges:
        if merged and merged[-1][1] == name:
            merged[-1] = (rows, name)
        else:
            merged.append((rows, name))
    return merged


def build_plan(layer: "KernelLinear", ranges: list[tuple[int | None, str]]) -> LinearPlan:
    """A plan from [(max_rows, kernel name)], ascending, last None; merges neighbours that agree."""
    merged = merge_ranges(ranges)
    states: dict[str, Any] = {}
    choices = []
    for rows, name in merged:
        k = get(name)
        why = k.supports(layer)
        if why is not None:
            raise ValueError(f"linear kernel {name!r} cannot run this {layer.weight_format} layer "
                             f"({layer.out_features}x{layer.in_features}): {why}")
        key = getattr(k, "layout", name)      # kernels that read one layout share its prepared state
        if key not in states:
            states[key] = k.prepare(layer)
        choices.append(Choice(rows, k, states[key]))
    return LinearPlan(choices)


def forced_plan(layer: "KernelLinear", name: str) -> LinearPlan:
    """`name` for every row count (ValueError, saying why, when it cannot run this layer)."""
    return build_plan(layer, [(None, name)])


class KernelLinear(nn.Module):
    """Base of every linear the engine runs: `forward(x[..., in]) -> [..., out]` through `self.plan`.

    Subclasses hold the weight in their format and implement `dequantize`. Without an installed
    plan (offline tools that build a model by hand) the first call installs the default rules'
    plan (tuning.default_plan: no measurement)."""
    weight_format: ClassVar[str]
    compute_dtype: torch.dtype = torch.float32     # the activations' dtype; set at load (select_kernels)

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.plan: LinearPlan | None = None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight this layer computes with, [out, in], as `nn.Linear.weight` would hold it."""
        raise NotImplementedError

    def dequantize_bf16(self) -> torch.Tensor:
        """The weight rounded to bfloat16 from its float32 expansion (the `bf16` copy's weights); a format
        with a one-pass kernel for it overrides this."""
        return self.dequantize(torch.float32).to(torch.bfloat16)

    def shape_key(self) -> str:
        """What the measured table is keyed by: format and shape (layers alike in these time alike)."""
        return f"{self.weight_format}:{self.out_features}x{self.in_features}"

    def takes_bf16(self, rows: int) -> bool:
        """Whether a call of `rows` rows runs the "bf16" kernel, which rounds activations to bfloat16 on the
        way in: a producer may then hand it bfloat16 rows (the same bits, one conversion fewer), and gets
        bfloat16 back. Only where no bias or input scale would be applied to them first or after."""
        plan = self.plan
        return (plan is not None and plan.kernel_at(rows).kernel.name == "bf16" and self.bias is None
                and self.input_scale_tensor is None)

    @property
    def input_scale_tensor(self) -> torch.Tensor | None:
        """A per-input-channel factor applied to x before the kernel (AWQ), or None."""
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        s = self.input_scale_tensor
        if s is not None:
            x2 = x2 * s.to(x2.dtype)
        plan = self.plan
        if plan is None:
            from tokenfab.kernels.tuning import default_plan
            plan = self.plan = default_plan(self)
        y = plan(x2, self)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    # a plan's prepared layouts depend on the buffers and the device: rebuild after either changes
    def _apply(self, fn, recurse=True):
        self.plan = None
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs):
        self.plan = None
        return super()._load_from_state_dict(*args, **kwargs)


def plan_linears(model: nn.Module) -> list[KernelLinear]:
    return [m for m in model.modules() if isinstance(m, KernelLinear)]


# ------------------------------------------------------------------------------ float kernels
def onednn_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    return (torch.device(device).type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    """A float [out, in] weight in oneDNN's blocked layout (machine-specific: never saved)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.float().contiguous(), None)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, in] float32 @ a weight from `onednn_pack`, plus bias: [T, out]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _layer_device(layer: KernelLinear) -> torch.device:
    for t in layer.buffers():
        return t.device
    for t in layer.parameters():
        return t.device
    return torch.device("cpu")


class OneDNNFloat:
    """float32 weights in oneDNN's prepacked layout (torch.ops.mkldnn). MKL's default GEMM was 1.2-2.3x
    slower on the decoder's skinny shapes and the wide LM head on the AVX2 dev machine."""
    name, formats, tune_max_rows, float_copy = "onednn", ("float",), None, False
    rank, lossy = 0, False

    def supports(self, layer):
        if layer.weight is None or not onednn_supported(layer.weight.device, layer.weight.dtype):
            return "needs float32 weights on a CPU with oneDNN"
        return None

    def prepare(self, layer):
        return onednn_pack(layer.weight.detach())

    def run(self, state, x, layer):
        return onednn_linear(x, state, None)


class TorchFloat:
    """F.linear: the portable reference (CUDA, bfloat16, any shape)."""
    name, formats, tune_max_rows, float_copy = "torch", ("float",), None, False
    rank, lossy = 1, False

    def supports(self, layer):
        return None if layer.weight is not None else "the float weight was given up for a packed copy"

    def prepare(self, layer):
        return None

    def run(self, state, x, layer):
        return F.linear(x, layer.weight.to(x.dtype))


class FloatCopy:
    """A quantized weight dequantized once into a float32 oneDNN copy: the fastest path for big batches
    where the memory budget allows (4 bytes per weight, counted by the engine)."""
    name, formats, tune_max_rows, float_copy = "float", ("int8", "int4", "q8_0") + STORED_FORMATS, None, True
    rank, lossy, copy_bytes = 1, False, 4

    def supports(self, layer):
        return None if onednn_supported(_layer_device(layer), torch.float32) else "needs a CPU with oneDNN"

    def prepare(self, layer):
        return onednn_pack(layer.dequantize(torch.float32))

    def run(self, state, x, layer):
        return onednn_linear(x.float(), state, None).to(x.dtype)


class BF16Copy:
    """A quantized weight dequantized once into a bfloat16 oneDNN copy, activations rounded to bf16 on the
    way in: where the CPU has bf16 units (AMX, AVX512-BF16) oneDNN runs it 2.4x (32 rows) to 4x (512 rows)
    faster than the float32 copy at half its memory (Sapphire Rapids, one thread,
    benchmarks/quant_kernels.py). Lossy (bf16 activations), so the table picks it only where it is
    LOSSY_MARGIN faster: prefill chunks and big batches, never the decode rows of the one-call stack."""
    name, formats, tune_max_rows, float_copy = "bf16", ("int8", "int4", "q8_0") + STORED_FORMATS, None, True
    rank, lossy, copy_bytes = 2, True, 2

    def supports(self, layer):
        if not onednn_supported(_layer_device(layer), torch.float32):
            return "needs a CPU with oneDNN"
        from tokenfab.kernels import cpu_flags
        if not cpu_flags() & {"amx_bf16", "avx512_bf16"}:
            return "needs bf16 units (amx_bf16 or avx512_bf16); without them oneDNN emulates bf16, slower than float32"
        return None

    def prepare(self, layer):
        return torch.ops.mkldnn._reorder_linear_weight(layer.dequantize_bf16().contiguous(), None)

    def run(self, state, x, layer):
        # bfloat16 x (KernelLinear.takes_bf16: a norm or SiLU kernel wrote it) gets its bfloat16 result back
        y = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16).contiguous(), state, None, "none", [], "")
        return y.to(x.dtype)


class Dequant:
    """Expand the weight to the activation dtype on every call, then F.linear: no extra memory, any
    device; the exact reference in tests."""
    name, formats, tune_max_rows, float_copy = "dequant", ("int8", "int4", "q8_0", "w8a8") + STORED_FORMATS, None, False
    rank, lossy = 3, False

    def supports(self, layer):
        return None

    def prepare(self, layer):
        return None

    def run(self, state, x, layer):
        return F.linear(x, layer.dequantize(x.dtype))


for _k in (OneDNNFloat(), TorchFloat(), FloatCopy(), BF16Copy(), Dequant()):
    register(_k)


# The row counts the measured table times. A step of T rows runs the choice of the smallest bucket at
# or above T (LinearPlan: "up to max_rows"), and the biggest bucket's choice runs every bigger step.
# Up to 64 rows the skinny GEMMs are bandwidth-bound and the kernels rank differently per bucket;
# above it they are compute-bound, so only kernels without a tune_max_rows (the float and bf16 copies,
# w8a8, dequant) are timed there: on the Sapphire Rapids VM the bf16 copy (AMX) ran 512-row prefill
# chunks 4-5x faster than the float32 copy; at 64 rows its lead is 2.5-3x, near the 2x a lossy kernel
# needs, so on a noisy machine the inherited 64-row choice could be the float copy (docs/quant.md).
ROW_BUCKETS = (1, 4, 8, 16, 32, 64, 128, 256, 512)
SMALL_ROWS = 64           # float layers run one kernel at every row count (tuning.KernelTable.ranges),
                          # chosen from the buckets up to here: they are not timed above it


def row_buckets(max_rows: int, limit: int | None = None) -> list[int]:
    """Buckets the table measures for a layer that sees up to max_rows rows: up to (and including one
    at or past) max_rows, and none past `limit`."""
    out = []
    for b in ROW_BUCKETS:
        if limit is not None and b > limit:
            break
        out.append(b)
        if b >= max_rows:
            break
    return out
