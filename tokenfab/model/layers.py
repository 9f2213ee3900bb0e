"""Building blocks of the decoder: RMSNorm and rotary embeddings.

Both follow the Hugging Face reference arithmetic step for step (norms in float32, RoPE tables in
float32), because greedy output must match `transformers` token for token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
