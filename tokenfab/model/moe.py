"""The mixture-of-experts layer: a router picks k of E expert MLPs per token, and the layer's output is their
outputs weighted by the router's probabilities (Qwen3-MoE, Mixtral, OLMoE; model/families/).

Routing is softmax over the router logits in float32, the top k, and (where the family says so,
`ModelConfig.norm_topk_prob`) those k renormalised to sum to 1, as transformers and llama.cpp do; gpt-oss
(`ModelConfig.moe_topk_then_softmax`) takes the top k logits first and softmaxes those k, and its router
has a bias. The router
stays a float32 matrix on every path (never quantized, never behind the kernel seam): the top-k choice is
discrete, and a rounding error that reorders two probabilities sends a token to another expert.

Experts run grouped per step (`MoE.forward`): the step's (token, choice) pairs are sorted by expert, so each
expert picked by any token runs once, on all of its tokens as one matrix, and its weights are read once per
step; an expert no token picked costs nothing. Each expert is the decoder's own `MLP` (model/llama.py), so its
two projections are ordinary linears: the kernel seam (tokenfab/kernels/linear.py), GGUF blocks run as stored
(quant/load.py: Q8_0, Q4_K, ...) and load-time quantization all take them with no code of their own. The
outputs are summed per token in ascending expert order, as transformers' loop does.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tokenfab.model.config import ModelConfig


def route(logits: torch.Tensor, k: int, normalize: bool,
          topk_then_softmax: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]) from router logits [T, E]: softmax, top k, and the k
    renormalised to sum to 1 when `normalize`; `topk_then_softmax`: the top k logits, softmaxed (gpt-oss)."""
    if topk_then_softmax:
        top, experts = torch.topk(logits.float(), k, dim=-1)
        return torch.softmax(top, dim=-1), experts
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def group_by_expert(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """The flat (token, choice) indices of `experts` [T, k] sorted by expert (stable: tokens in order within
    an expert), and how many each expert got; pair i is token i // k's choice i % k."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return order, counts


class MoE(nn.Module):
    """Router plus `num_experts` SwiGLU / GeGLU MLPs of width `moe_intermediate_size`, k of them per token."""

    def __init__(self, cfg: ModelConfig, make_expert: Callable[[], nn.Module]):
        """`make_expert`: one expert MLP (the decoder's `MLP` at the experts' width)."""
        super().__init__()
        self.num_experts, self.top_k, self.normalize = cfg.num_experts, cfg.experts_per_token, cfg.norm_topk_prob
        self.topk_then_softmax = cfg.moe_topk_then_softmax
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be between 1 and num_experts={self.num_experts}")
        self.router = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, dtype=torch.float32),
                                   requires_grad=False)
        self.router_bias = (nn.Parameter(torch.zeros(cfg.num_experts), requires_grad=False) if cfg.router_bias
                            else None)
        self.experts = nn.ModuleList(make_expert() for _ in range(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(F.linear(x.to(self.router.dtype), self.router, self.router_bias), self.top_k,
                                 self.normalize, self.topk_then_softmax)
        order, counts = group_by_expert(experts, self.num_experts)
        tokens = order // self.top_k
        rows = x[tokens]                     # the step's (token, choice) rows, grouped by expert
        outs, start = [], 0
        for e, n in enumerate(counts):      # each picked expert once, on all of its rows; the others not at all
            if n:
                outs.append(self.experts[e](rows[start:start + n]))
                start += n
        y = torch.cat(outs) if len(outs) > 1 else outs[0]
        y = y * weights.reshape(-1)[order, None].to(y.dtype)
        # summed per token in pair order, i.e. ascending expert, as transformers' loop adds them
        return torch.zeros_like(x).index_add_(0, tokens, y.to(x.dtype))
