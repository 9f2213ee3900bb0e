"""Prompt logprobs: log P(prompt token i | tokens before it), computed in the prefill.

The logits at position p predict token p + 1, so a prefill chunk covering positions [start, end) of a
P-token prompt scores prompt tokens start + 1 .. min(end, P - 1). The runner asks the model for a
logits row at each of those positions (`worker/model_runner.rows_for_chunk`), besides the usual last-position row, and
the engine turns them into entries here (`entries`), appended to the sequence in order, chunk after
chunk. A sequence asking for prompt logprobs takes no prefix-cache blocks until they are all computed
(`Sequence.needs_prompt_logprobs`): the cached K/V would skip exactly the positions whose logits are
needed, so they are recomputed, as vLLM does. Its own blocks are still registered for others.
Preemption by recompute does not score a token twice: rows start after what was already recorded.

Only a request's first sample (index 0) scores the prompt; its n samples share the prompt.
"""
from __future__ import annotations

import torch

from tokenfab.outputs import Logprob


def entries(logits: torch.Tensor, targets: list[int], top_n: int, vocab_size: int) -> list[dict[int, Logprob]]:
    """One {token_id: Logprob} per row: the target (the actual prompt token) and the top `top_n`,
    as vLLM shapes them (the target first; ranks are 1-based over the whole vocabulary)."""
    lp = torch.log_softmax(logits[:, :vocab_size].float(), dim=-1)
    tgt = torch.tensor(targets, dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, tgt[:, None])
    ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
    chosen = chosen[:, 0].tolist()
    if top_n > 0:
        top_v, top_i = lp.topk(top_n, dim=-1)
        top_v, top_i = top_v.tolist(), top_i.tolist()
    out = []
    for r, t in enumerate(targets):
        entry = {t: Logprob(chosen[r], rank=ranks[r])}
        for m in range(top_n):
            entry.setdefault(top_i[r][m], Logprob(top_v[r][m], rank=m + 1))
        out.append(entry)
    return out
