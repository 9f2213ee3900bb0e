"""When to speculate and how far: the adaptive policy (docs/speculative.md; measured runs in
benchmarks/results/speculative.md).

The rule, per sequence and step: draft the k in 1..k_max that maximises the expected tokens per unit
of step cost,

    gain(k) = (1 + a + a^2 + ... + a^k) / (1 + c * k)

and draft nothing when no k reaches MIN_GAIN (1.05), where
- a is the sequence's recent per-token acceptance (an EWMA of accepted over tested drafts). A new
  sequence starts at the engine's recent acceptance over all sequences (`AdaptivePolicy.rate`), not at
  a fixed optimistic guess: after a run of rejecting text a new sequence starts pessimistic.
- c is what one draft row adds to the step, in units of this sequence's share of a plain decode step
  with the same number of sequences (`StepCosts.row_cost`): measured from the engine's own decode steps
  (the step's wall time, so the proposer, verification and commit are in it), n x (extra seconds per
  draft row) / (plain step seconds at n sequences). Until a verification step has been measured, the
  kernel's declared row cost plus the proposer's (`row_cost_of`, `draft_cost`) stands in. With n
  sequences a row costs n times more of a sequence's share than alone, which is what switches
  speculation off in the tail of a batch where it does not pay.

Sequences that are not drafting still measure their acceptance where that is free: with a proposer
that costs nothing per draft (ngram), a sequence whose k is 0 gets a shadow draft of one token each
eligible step, checked against the token the step emits; its rate follows the text, and it drafts
again as soon as gain(k) says so. A proposer with a cost (a draft model, layerskip) cannot shadow:
there, a sequence whose k is 0 stops proposing for `backoff` steps (BACKOFF_MIN, doubling up to
BACKOFF_MAX each time it fails again), then probes afresh at START_RATE.

Per step: no speculation when more than `max_batch_size` sequences decode: at large batches every
extra row costs about as much as the token it may save.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

EWMA = 0.5            # weight of a sequence's newest round: one rejected round is enough to switch off
RATE_EWMA = 0.1       # weight of each round (any sequence) in the engine-wide rate that new sequences start at
START_RATE = 0.7      # the engine-wide rate before any round, and a probing sequence's assumed acceptance
MAX_RATE = 0.95       # the most acceptance the rule assumes: a run of accepted rounds says little about the next
# A verification row's cost relative to a plain one-row decode step on the one-call C decode stack:
# 5 rows took 37.5 ms against 14.1 ms for 1 (bundled model, 1 thread, quiet machine: (37.5 / 14.1 - 1) / 4).
# tf_qgemm is compute-bound per activation row (the weights are unpacked once, each row adds its own
# dot products), so rows are not free as they would be on a bandwidth-bound kernel.
ROW_COST = 0.42
# A kernel whose extra rows cost less declares its own `row_cost` (tokenfab/quant/kernels.py: qtile, the AMX
# tile kernel, 0.13); the engine's policy takes the value of the kernel its decoder runs (`row_cost_of`).
# Both are priors: the measured cost (StepCosts) replaces them once the engine has timed a verification.
MIN_GAIN = 1.05       # expected speedup a round must promise
BACKOFF_MIN, BACKOFF_MAX = 16, 256
WINDOW = 16           # step times kept per kind; the medians of the newest WINDOW are used


@dataclass(slots=True)
class SeqSpecState:
    rate: float = START_RATE
    paused_until: int = 0        # engine step before which this sequence does not propose
    backoff: int = BACKOFF_MIN
    shadow: int | None = None    # this step's shadow draft (one token, not verified): checked at commit
    draft_computed: int = 0      # draft method: tokens whose K/V the draft model holds (draft.py)
    draft_epoch: int = 0         # ... as of this many preemptions of the sequence


def expected_gain(a: float, k: int, cost_per_draft: float) -> float:
    return sum(a ** i for i in range(k + 1)) / (1 + cost_per_draft * k)


def best_k(a: float, cost: float, k_max: int) -> int:
    """The k in 1..k_max with the largest gain(k), or 0 when none reaches MIN_GAIN."""
    k_best, best = 0, MIN_GAIN
    for k in range(1, k_max + 1):
        g = expected_gain(a, k, cost)
        if g > best:
            k_best, best = k, g
    return k_best


def row_cost_of(model, rows: int) -> float:
    """A verification row's cost for this model's quantized linears at `rows` rows: the largest `row_cost`
    their kernels declare, ROW_COST for a kernel that declares none (or a model without plans)."""
    from tokenfab.kernels.linear import plan_linears
    costs = [getattr(m.plan.kernel_at(rows).kernel, "row_cost", ROW_COST)
             for m in plan_linears(model) if m.plan is not None and m.weight_format != "float"]
    return max(costs) if costs else ROW_COST


def _median(xs) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


class StepCosts:
    """Decode-step times as the engine measured them: plain steps (one row per sequence) by the number
    of sequences, and for steps that verified drafts, the seconds each draft row added over a plain
    step with as many sequences. Medians over the newest WINDOW of each, so one slow step (another
    process on the core) moves nothing."""

    def __init__(self) -> None:
        self.plain: dict[int, deque[float]] = {}
        self.per_row: deque[float] = deque(maxlen=WINDOW)

    def observe(self, num_seqs: int, draft_rows: int, seconds: float) -> None:
        if draft_rows == 0:
            self.plain.setdefault(num_seqs, deque(maxlen=WINDOW)).append(seconds)
            return
        base = self.plain_seconds(num_seqs)
        if base is not None:
            self.per_row.append((seconds - base) / draft_rows)

    def plain_seconds(self, num_seqs: int) -> float | None:
        """A plain step's time at num_seqs sequences: measured there, else interpolated linearly
        between the nearest sizes measured on either side, else the nearest size measured."""
        if num_seqs in self.plain:
            return _median(self.plain[num_seqs])
        below = max((n for n in self.plain if n < num_seqs), default=None)
        above = min((n for n in self.plain if n > num_seqs), default=None)
        if below is None and above is None:
            return None
        if below is None or above is None:
            return _median(self.plain[above if below is None else below])
        lo, hi = _median(self.plain[below]), _median(self.plain[above])
        return lo + (hi - lo) * (num_seqs - below) / (above - below)

    def row_cost(self, num_seqs: int) -> float | None:
        """One draft row's added time over one sequence's share of a plain step at num_seqs sequences;
        None until a verification step has been measured."""
        base = self.plain_seconds(num_seqs)
        if not self.per_row or base is None:
            return None
        return max(0.0, _median(self.per_row)) * num_seqs / base


class AdaptivePolicy:
    def __init__(self, k_max: int, max_batch_size: int, adaptive: bool = True, draft_cost: float = 0.0,
                 row_cost: float = ROW_COST) -> None:
        self.k_max, self.max_batch_size, self.adaptive = k_max, max_batch_size, adaptive
        self.prior_cost = row_cost + draft_cost      # until StepCosts has measured a verification
        self.shadows = adaptive and draft_cost == 0  # a free proposer: non-drafting sequences shadow-draft
        self.costs = StepCosts()
        self.rate = START_RATE                       # recent acceptance over all sequences: where new ones start

    def step_allows(self, num_decoding: int) -> bool:
        return num_decoding <= self.max_batch_size

    def cost(self, num_decoding: int) -> float:
        """c of the rule for a step with this many decoding sequences: measured, else the prior."""
        measured = self.costs.row_cost(num_decoding)
        return self.prior_cost if measured is None else measured

    def new_state(self) -> SeqSpecState:
        return SeqSpecState(rate=self.rate)

    def k_for(self, st: SeqSpecState, step: int, cost: float) -> int:
        if not self.adaptive:
            return self.k_max
        if step < st.paused_until:
            return 0
        k = best_k(min(st.rate, MAX_RATE), cost, self.k_max)
        if k == 0 and not self.shadows:   # not worth it at this rate, and no free way to watch: back off, then probe
            st.paused_until = step + st.backoff
            st.backoff = min(2 * st.backoff, BACKOFF_MAX)
            st.rate = START_RATE
        return k

    def observe(self, st: SeqSpecState, num_drafts: int, num_accepted: int, step: int) -> None:
        """A verified round (or a shadow draft: num_drafts 1) of this sequence."""
        if not self.adaptive or num_drafts == 0:
            return
        # Per-token acceptance: the drafts after the first rejected one were never tested.
        tested = num_accepted + (num_accepted < num_drafts)
        a = num_accepted / tested
        st.rate = (1 - EWMA) * st.rate + EWMA * a
        self.rate = (1 - RATE_EWMA) * self.rate + RATE_EWMA * a
        if num_accepted == num_drafts:
            st.backoff = BACKOFF_MIN     # it pays again: a later back-off starts short

    def observe_step(self, num_seqs: int, draft_rows: int, seconds: float) -> None:
        """A decode-only step of the engine (every sequence one row plus its drafts), its wall time."""
        self.costs.observe(num_seqs, draft_rows, seconds)
