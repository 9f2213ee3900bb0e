"""Lossless verification of draft tokens against the target model's distributions.

For a sequence with drafts d_1..d_k the target scores k + 1 positions in one pass; row i is the
target's next-token distribution after the context plus d_1..d_i. Each row is processed exactly as
the sampler would process it at that point (min_tokens masking and penalties with d_1..d_i counted as
output, then temperature, min-p, top-k, top-p), so that:

- greedy: d_i is accepted while it equals the argmax of row i-1; the first mismatch is replaced by
  that argmax (or, when all k match, row k's argmax is the bonus token). Token for token the same
  output as decoding one token at a time.
- sampling: the standard rejection rule (Leviathan et al. 2023; Chen et al. 2023). Accept d_i with
  probability min(1, p(d_i) / q(d_i)); on rejection draw from norm(max(0, p - q)) and stop. For a
  deterministic proposer (n-gram) q is a point mass: accept with probability p(d_i), and on rejection
  draw from p with d_i removed. If all k are accepted, the bonus is drawn from row k. Every emitted
  token is then distributed exactly as the target's.
"""
from __future__ import annotations

import torch

from tokenfab.engine.sampler import greedy_ids
from tokenfab.sampling import SamplingParams


def target_probs(x: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Rows of processed logits (penalties and masks applied) -> the probabilities the sampler draws
    from: temperature, then min-p, then top-k, then top-p over what top-k left (as sampler._draw)."""
    x = x.float() / params.temperature
    vocab = x.shape[-1]
    if params.min_p > 0:
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < params.min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    k = params.top_k if 0 < params.top_k < vocab else vocab
    if k == vocab and params.top_p >= 1.0:
        return torch.softmax(x, dim=-1)
    vals, idx = torch.topk(x, k, dim=-1, sorted=True)
    probs = torch.softmax(vals, dim=-1)
    if params.top_p < 1.0:
        # Keep a token while the mass strictly before it is below top_p; the best token always stays.
        mass_before = torch.cumsum(probs, dim=-1) - probs
        pos = torch.arange(k, device=x.device)[None, :]
        probs = probs.masked_fill((mass_before >= params.top_p) & (pos > 0), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(x).scatter_(-1, idx, probs)


def draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One index drawn with probability proportional to `weights` (1-D, >= 0, not all zero)."""
    cdf = weights.double().cumsum(0)
    u = torch.rand((1,), generator=generator, dtype=torch.float64, device=cdf.device) * cdf[-1]
    i = int(torch.searchsorted(cdf, u, right=True))
    last = int(torch.searchsorted(cdf, cdf[-1:], right=False))   # u rounding up to the total
    return min(i, last)


def uniform(generator: torch.Generator | None, device) -> float:
    return float(torch.rand((1,), generator=generator, dtype=torch.float64, device=device))


def accept_greedy(processed: torch.Tensor, drafts: list[int]) -> tuple[list[int], int]:
    """(accepted drafts, the target's own next token). `processed`: [k + 1, vocab] logits."""
    best = greedy_ids(processed)
    n = 0
    while n < len(drafts) and drafts[n] == best[n]:
        n += 1
    return drafts[:n], best[n]


def accept_sampled(probs: torch.Tensor, drafts: list[int], generator: torch.Generator | None,
                   draft_probs: torch.Tensor | None = None) -> tuple[list[int], int]:
    """Rejection sampling. `probs`: [k + 1, vocab] target probabilities; `draft_probs`: [k, vocab] the
    proposer's distributions, or None for a deterministic proposer (point masses on the drafts)."""
    for i, d in enumerate(drafts):
        p = probs[i]
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        p_d = float(p[d])
        if q_d > 0 and uniform(generator, p.device) < min(1.0, p_d / q_d):
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[d] = 0.0
        else:
            residual = (p - draft_probs[i]).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:   # p equals q: cannot happen after a rejection, but never divide by 0
            residual = p
        return drafts[:i], draw(residual, generator)
    return list(drafts), draw(probs[len(drafts)], generator)
