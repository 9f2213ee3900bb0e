"""StepShape: what one engine step computes, the one description every step-cost model reads.

The scheduler builds one per step (engine/scheduler.py), the step-time budget sizes fill work with it
(engine/step_budget.py), the online fit and the measured tables are fitted on its fields
(costmodel/online.py, costmodel/measured.py), and the planner's roofline and simulator cost it
(plan/roofline.py, plan/simulate.py).
"""
from __future__ import annotations

from dataclasses import dataclass


def _sum_min(a: int, b: int, w: int) -> float:
    """sum(min(k, w) for k in a..b), in closed form."""
    if b < a:
        return 0.0
    if b <= w:
        return (a + b) * (b - a + 1) / 2
    if a > w:
        return float(w * (b - a + 1))
    return (a + w) * (w - a + 1) / 2 + w * (b - w)


@dataclass(slots=True)
class StepShape:
    """What a step computes, summed over its sequences. Attention terms are layer-averaged, so a
    sliding-window layer counts only the keys inside its window."""
    window: int | None = None
    global_frac: float = 1.0
    num_tokens: int = 0
    num_seqs: int = 0
    attn_pairs: float = 0.0      # (query, key) pairs
    kv_tokens: float = 0.0       # KV entries read

    def add(self, computed: int, n: int, count: int = 1) -> None:
        """`count` sequences with `computed` tokens cached each run `n` new ones (n=1: a decode)."""
        self.num_tokens += n * count
        self.num_seqs += count
        pairs = n * computed + n * (n + 1) / 2
        kv = computed + n
        if self.window:
            g = self.global_frac
            pairs = g * pairs + (1 - g) * _sum_min(computed + 1, computed + n, self.window)
            kv = g * kv + (1 - g) * min(kv, self.window)
        self.attn_pairs += pairs * count
        self.kv_tokens += kv * count
