"""Scheduler tests' stand-in for the model: run a scheduled step without one."""
from __future__ import annotations

from tokenfab.engine.update import ModelOutput

TOKEN = 7          # what the stand-in model always samples


def run_step(s) -> dict[str, int]:
    """Schedule one step and pretend it ran, through the scheduler's own update (prefill progress, one
    sampled token per finished prefill, finishes); returns the tokens each request ran in it."""
    batch = s.schedule()
    s.update_from_output(batch, ModelOutput.stand_in(batch, TOKEN))
    return {q.request_id: n for q, n in zip(batch.seqs, batch.num_new_tokens)}
