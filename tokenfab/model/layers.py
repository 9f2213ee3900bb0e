"""Building blocks of the decoder: RMSNorm and rotary embeddings.

Both follow the Hugging Face reference arithmetic step for step (norms in float32, RoPE tables in
float32), because greedy output must match `transformers` token for token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenfab import kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.usable(x):           # one C call (tokenfab/kernels); differs from torch in the last bit
            return kernels.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:   # one fused op, bit-identical to the reference below in float32
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class RotaryEmbedding(nn.Module):
    """Non-interleaved RoPE ("rotate half"), with cos/sin tables precomputed for every position.

    `tables(positions)` is looked up once per step and shared by every layer. rotate_half(x) * sin
    equals roll(x, half) * [-sin | sin] exactly (only signs move), which is one op instead of four.
    """

    def __init__(self, head_dim: int, theta: float, max_positions: int):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.half = head_dim // 2
        self.register_buffer("cos", torch.cat((freqs, freqs), dim=-1).cos(), persistent=False)
        self.register_buffer("sin_signed", torch.cat((-freqs.sin(), freqs.sin()), dim=-1), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, D] cos and signed sin for these positions, broadcastable over heads."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin_signed[positions].unsqueeze(1).to(dtype)

    def apply(self, x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: [T, heads, D]."""
        cos, sin_signed = tables
        return x * cos + torch.roll(x, self.half, dims=-1) * sin_signed


class PackedLinear(nn.Module):
    """A float32 `nn.Linear` whose weight is kept in oneDNN's blocked layout (CPU only).

    torch's default CPU GEMM (MKL) is slow on skinny and very wide matrices on non-Intel CPUs; oneDNN's
    prepacked fp32 GEMM was 1.2-2.3x faster on the decoder's shapes and the LM head on the 2-core AVX2
    dev machine (benchmarks/offline_throughput.py). Same float32 arithmetic, another summation order.
    `weight` stays readable (tied embeddings share it); the packed copy is what forward uses.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.packed = onednn_pack(linear.weight.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        return onednn_linear(x.reshape(-1, self.in_features), self.packed, self.bias).reshape(*lead, self.out_features)


def onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    """A float [out, in] weight in oneDNN's blocked layout (machine-specific: never saved)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.float().contiguous(), None)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, in] float32 @ a weight from `onednn_pack`, plus bias: [T, out]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def packed_linear_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    return (torch.device(device).type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack_linears(model: nn.Module) -> int:
    """Swap every float32 `nn.Linear` of a CPU model for a `PackedLinear`, in place; returns how many.

    For the engine's forward only: offline tools (quantization, evaluation) look for `nn.Linear`s. A
    linear whose weight no other module shares gives its plain copy up (the packed one replaces it).
    """
    shared = {id(p) for m in model.modules() if not isinstance(m, nn.Linear) for p in m.parameters(recurse=False)}
    n = 0
    for name, mod in list(model.named_modules()):
        if type(mod) is not nn.Linear or not packed_linear_supported(mod.weight.device, mod.weight.dtype):
            continue
        packed = PackedLinear(mod)
        if id(mod.weight) not in shared:
            packed.weight = None
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, leaf, packed)
        n += 1
    return n
