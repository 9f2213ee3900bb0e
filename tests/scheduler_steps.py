"""Scheduler tests' stand-in for the model: run a scheduled step without one."""
from __future__ import annotations


def run_step(s) -> dict[str, int]:
    """Schedule one step and pretend it ran (prefill progress, and one sampled token per finished prefill);
    returns the tokens each request got in it."""
    batch = s.schedule()
    for q, n in zip(batch.seqs, batch.num_new_tokens):
        q.num_computed_tokens += n
        s.bm.cache_full_blocks(q)
        if q.num_computed_tokens == q.num_tokens:
            q.token_ids.append(7)
    return {q.request_id: n for q, n in zip(batch.seqs, batch.num_new_tokens)}
