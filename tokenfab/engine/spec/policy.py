"""When to speculate and how far: the adaptive policy (docs/speculative.md has the measurements).

Per sequence: an exponentially weighted moving average `rate` of the share of its drafted tokens
the target accepted. Its next k is the one that maximises expected tokens per unit of step cost,

    gain(k) = (1 + a + a^2 + ... + a^k) / (1 + (ROW_COST + draft_cost) * k)

with a the sequence's rate: k drafts emit 1 + a + ... + a^k tokens on average, and the step costs
one plain decode plus ROW_COST per extra verification row plus the proposer's own cost per draft
token (`draft_cost`: 0 for ngram, L / num_layers for layerskip, the draft model's share of the
target's weights for draft). When no k gains at least MIN_GAIN, the sequence stops proposing for
`backoff` steps (BACKOFF_MIN, doubling up to BACKOFF_MAX each time it fails again), then probes
afresh at START_RATE. With ROW_COST 0.42 (tf_qgemm), a sequence needs a > 0.49 to draft even one token, so
open-ended text (ngram acceptance ~0.2) is switched off after its first rejected round; with the AMX
tile kernel's 0.06 (qtile) it needs a > 0.12, and drafts k_max tokens from a > 0.5.

Per step: no speculation when more than `max_batch_size` sequences decode: at large batches every
extra row costs about as much as the token it may save.
"""
from __future__ import annotations

from dataclasses import dataclass

EWMA = 0.5            # weight of the newest round: one rejected round is enough to switch off
START_RATE = 0.7      # a new (or probing) sequence's assumed acceptance: k = 2 with ngram
# A verification row's cost relative to a plain one-row decode step on the one-call C decode stack:
# 5 rows took 37.5 ms against 14.1 ms for 1 (bundled model, 1 thread, quiet machine: (37.5 / 14.1 - 1) / 4).
# tf_qgemm is compute-bound per activation row (the weights are unpacked once, each row adds its own
# dot products), so rows are not free as they would be on a bandwidth-bound kernel.
ROW_COST = 0.42
# A kernel whose extra rows cost less declares its own `row_cost` (tokenfab/quant/kernels.py: qtile, the AMX
# tile kernel, 0.06); the engine's policy takes the value of the kernel its decoder runs (`row_cost_of`).
MIN_GAIN = 1.05       # expected speedup a round must promise
BACKOFF_MIN, BACKOFF_MAX = 16, 256


@dataclass(slots=True)
class SeqSpecState:
    rate: float = START_RATE
    paused_until: int = 0        # engine step before which this sequence does not propose
    backoff: int = BACKOFF_MIN
    draft_computed: int = 0      # draft method: tokens whose K/V the draft model holds (draft.py)
    draft_epoch: int = 0         # ... as of this many preemptions of the sequence


def expected_gain(a: float, k: int, cost_per_draft: float) -> float:
    return sum(a ** i for i in range(k + 1)) / (1 + cost_per_draft * k)


def row_cost_of(model, rows: int) -> float:
    """A verification row's cost for this model's quantized linears at `rows` rows: the largest `row_cost`
    their kernels declare, ROW_COST for a kernel that declares none (or a model without plans)."""
    from tokenfab.kernels.linear import plan_linears
    costs = [getattr(m.plan.kernel_at(rows).kernel, "row_cost", ROW_COST)
             for m in plan_linears(model) if m.plan is not None and m.weight_format != "float"]
    return max(costs) if costs else ROW_COST


class AdaptivePolicy:
    def __init__(self, k_max: int, max_batch_size: int, adaptive: bool = True, draft_cost: float = 0.0,
                 row_cost: float = ROW_COST) -> None:
        self.k_max, self.max_batch_size, self.adaptive = k_max, max_batch_size, adaptive
        self.cost = row_cost + draft_cost
        # k for each rate bucket of 0.01, computed once: the per-step decision is a table lookup
        self._k_table = [self._best_k(i / 100) for i in range(96)]

    def _best_k(self, a: float) -> int:
        best_k, best = 0, MIN_GAIN
        for k in range(1, self.k_max + 1):
            g = expected_gain(a, k, self.cost)
            if g > best:
                best_k, best = k, g
        return best_k

    def step_allows(self, num_decoding: int) -> bool:
        return num_decoding <= self.max_batch_size

    def k_for(self, st: SeqSpecState, step: int) -> int:
        if not self.adaptive:
            return self.k_max
        if step < st.paused_until:
            return 0
        k = self._k_table[min(int(st.rate * 100), 95)]
        if k == 0:                   # not worth it at this rate: back off, then probe afresh
            st.paused_until = step + st.backoff
            st.backoff = min(2 * st.backoff, BACKOFF_MAX)
            st.rate = START_RATE
        return k

    def observe(self, st: SeqSpecState, num_drafts: int, num_accepted: int, step: int) -> None:
        if not self.adaptive or num_drafts == 0:
            return
        # Per-token acceptance: the drafts after the first rejected one were never tested.
        tested = num_accepted + (num_accepted < num_drafts)
        st.rate = (1 - EWMA) * st.rate + EWMA * (num_accepted / tested)
        if num_accepted == num_drafts:
            st.backoff = BACKOFF_MIN     # it pays again: a later back-off starts short
