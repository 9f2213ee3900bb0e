"""Building blocks of the decoder: RMSNorm, rotary embeddings and the float linear.

Both follow the Hugging Face reference arithmetic step for step (norms in float32, RoPE tables in
float32), because greedy output must match `transformers` token for token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenfab import kernels
from tokenfab.kernels.linear import KernelLinear, onednn_linear, onednn_pack, onednn_supported  # noqa: F401
from tokenfab.model.rope import inverse_frequencies


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.c_kernel = False          # set once at load by the cpu attention backend (model/backends.py)
        self.feeds = None              # the KernelLinear reading this norm's output, where the cpu backend
                                       # lets it take bfloat16 rows (its "bf16" kernel's rounding, done here)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.c_kernel:               # one C call (tokenfab/kernels); differs from torch in the last bit
            return kernels.rms_norm(x, self.weight, self.eps, self._c_out_dtype(x))
        if x.dtype == torch.float32:   # one fused op, bit-identical to the reference below in float32
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def _c_out_dtype(self, x: torch.Tensor) -> torch.dtype:
        """bfloat16 where the linear this norm feeds takes bf16 rows at this row count, else float32."""
        bf16 = self.feeds is not None and self.feeds.takes_bf16(x.numel() // x.shape[-1])
        return torch.bfloat16 if bf16 else torch.float32

    def add_forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(x + y), x + y): a residual add and this norm, one C pass where the kernels run (y may be
        a bf16 GEMM's bfloat16 result; the sum is x's dtype, as torch's type promotion gives)."""
        if self.c_kernel:
            return kernels.add_rms_norm(x, y, self.weight, self.eps, self._c_out_dtype(x))
        total = x + y
        return self(total), total


class RotaryEmbedding(nn.Module):
    """Non-interleaved RoPE ("rotate half"), with cos/sin tables precomputed for every position.

    `tables(positions)` is looked up once per step and shared by every layer. rotate_half(x) * sin
    equals roll(x, half) * [-sin | sin] exactly (only signs move), which is one op instead of four.
    """

    def __init__(self, head_dim: int, theta: float, max_positions: int, scaling: dict | None = None,
                 rotary_dim: int | None = None):
        super().__init__()
        rot = rotary_dim or head_dim
        # the tables hold one position past the longest sequence (the builders pass max_model_len + 1)
        inv_freq, attn = inverse_frequencies(rot, theta, scaling, max_positions - 1)      # model/rope.py
        # a partial rotary head (rot < head_dim): its rotated pairs are (j, j + head_dim / 2) for j < rot / 2,
        # once the loader has moved its q / k rows there (loader.partial_rotary_rows); the other pairs get
        # frequency 0 and no attention factor, so cos 1 and sin 0 pass them through every RoPE path unchanged
        pad = head_dim // 2 - inv_freq.numel()
        scale = torch.cat((torch.full((inv_freq.numel(),), attn), torch.ones(pad)))
        inv_freq = torch.cat((inv_freq, torch.zeros(pad)))
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.half = head_dim // 2
        cos, sin = torch.cat((freqs, freqs), dim=-1).cos(), freqs.sin()
        if attn != 1.0:                      # YaRN / longrope scale cos and sin (so q . k by attn ** 2)
            cos, sin = cos * torch.cat((scale, scale)), sin * scale
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin_signed", torch.cat((-sin, sin), dim=-1), persistent=False)

    @classmethod
    def identity(cls, head_dim: int, max_positions: int) -> "RotaryEmbedding":
        """Tables that rotate nothing (cos 1, sin 0): a NoPE layer (SmolLM3) runs every RoPE path unchanged."""
        rope = cls(head_dim, 10000.0, 1)
        rope.cos = torch.ones(max_positions, head_dim)
        rope.sin_signed = torch.zeros(max_positions, head_dim)
        return rope

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, D] cos and signed sin for these positions, broadcastable over heads."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin_signed[positions].unsqueeze(1).to(dtype)

    def apply(self, x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: [T, heads, D]."""
        cos, sin_signed = tables
        return x * cos + torch.roll(x, self.half, dims=-1) * sin_signed


class FloatLinear(KernelLinear):
    """A float `nn.Linear` behind the kernel seam (weight format "float"): oneDNN's prepacked GEMM on
    CPU float32 (tokenfab/kernels/linear.py), F.linear elsewhere, chosen once at load.

    `weight` stays readable until a plan that doesn't need it is installed; `release_float_weights`
    then drops the plain copy of weights no other module shares (tied embeddings keep theirs)."""
    weight_format = "float"

    def __init__(self, linear: nn.Linear):
        super().__init__(linear.in_features, linear.out_features)
        self.weight = linear.weight
        self.bias = linear.bias
        self.compute_dtype = linear.weight.dtype

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.weight.to(dtype)

    def shape_key(self) -> str:
        return f"float-{str(self.compute_dtype).removeprefix('torch.')}:{self.out_features}x{self.in_features}"

    def _apply(self, fn, recurse=True):
        # the plan holds a packed copy of the weight: rebuild it only when the weight is still here
        return nn.Module._apply(self, fn, recurse) if self.weight is None else super()._apply(fn, recurse)


PackedLinear = FloatLinear          # the name before the kernel seam


class HeadRowsEmbedding(nn.Module):
    """The token embedding served from a tied, quantized LM head: a lookup dequantizes just the rows it
    reads (`source.embedding(ids, dtype)`), so no float copy of the [vocab, hidden] matrix is kept
    (SmolLM2's Q8_0 head: 108 MiB saved; Gemma 3 270M's 262k x 640: 640 MiB). A gather of a few rows
    costs nothing next to the step's GEMMs, so this pays at every batch size.

    `weight` is an empty tensor that only carries the compute dtype and device (callers ask
    `embed_tokens.weight.dtype`); the head is referenced, not registered, so it is moved, counted and
    saved once, as `lm_head`."""

    def __init__(self, source: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.__dict__["source"] = source
        self.num_embeddings, self.embedding_dim = source.out_features, source.in_features
        self.register_buffer("weight", torch.empty(0, dtype=dtype, device=_device_of(source)), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # float32 first, then the compute dtype: the same rounding as the float copy it replaces
        return self.source.embedding(ids, torch.float32).to(self.weight.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows of the tied {type(self.source).__name__}"


def _device_of(module: nn.Module) -> torch.device:
    for t in list(module.buffers()) + list(module.parameters()):
        return t.device
    return torch.device("cpu")


def pack_linears(model: nn.Module) -> int:
    """Swap every `nn.Linear` of a model for a `FloatLinear`, in place; returns how many.

    For the engine's forward only: offline tools (quantization, evaluation) look for `nn.Linear`s."""
    n = 0
    for name, mod in list(model.named_modules()):
        if type(mod) is not nn.Linear:
            continue
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, leaf, FloatLinear(mod))
        n += 1
    return n


def float_weight_releaser(model: nn.Module):
    """A function that drops one module's plain weight where `release_float_weights` would (bytes freed,
    else 0): given to `select_kernels`, each layer's copy goes as soon as its plan holds oneDNN's, so a
    float model's load never holds both forms of every weight (the bundled model in float32 peaked
    510 MiB higher)."""
    shared = {id(p) for m in model.modules() if not isinstance(m, FloatLinear) for p in m.parameters(recurse=False)}

    def release(m: nn.Module) -> int:
        if (isinstance(m, FloatLinear) and m.weight is not None and m.plan is not None
                and id(m.weight) not in shared and all(c.kernel.name == "onednn" for c in m.plan.choices)):
            freed = m.weight.numel() * m.weight.element_size()
            m.weight = None
            return freed
        return 0

    return release


def release_float_weights(model: nn.Module) -> int:
    """Drop the plain weight of FloatLinears whose plan keeps its own copy (oneDNN's layout) and
    whose weight no other module shares; returns the bytes freed. Call after the plans are in."""
    release = float_weight_releaser(model)
    return sum(release(m) for m in list(model.modules()))


def packed_linear_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    return onednn_supported(device, dtype)
