"""Step-time budget: how much batch work and long-prompt prefill a step may carry beside interactive work.

On a CPU a step's time grows with its rows (on the 2-core VM: 17 ms for one decode row, 53 ms for eight),
so every batch row or long-prefill token in a step slows every interactive decode in it, and every
interactive request that arrives during the step waits for it to end. Token caps cannot bound that (a
smaller cap spreads a long prompt over more steps, each of them slower), so the scheduler caps this
"fill" work in time:
- interactive work goes into the step first (decodes, then short prompts' prefills): it is "firm";
- fill work (batch-class rows, then prefill chunks of prompts in the long-prompt lane) is then admitted
  only while the step model (costmodel/online.py) predicts the whole step within the step's limit; a
  prefill chunk shrinks to the most tokens that fit, a decode row fits or waits.

The limit, by the kind of step (t1: the predicted time of the shortest interactive step, one decode row):
- **TTFT-critical** (an interactive prompt prefills in the step, or one still waits): the firm work's
  own time. Fill only rides where the model says it is free, so it never adds to a time to first token.
- **Interactive decodes**: `step_time_budget_ms` when set (`tokenfab serve --slo-tpot-ms` sets it: the
  TPOT target), else the firm work's time + `step_time_slack` x t1, plus a credit: the allowance earlier
  steps left unused (up to t1), so a batch row that costs more than one step's allowance still goes in
  every few steps. A lone interactive stream's TPOT (a mean over its steps) is then at most
  `step_time_slack` slower; with more streams the share falls, and it must: near capacity (a burst)
  each millisecond added to a step delays every queued request, and a slack in proportion to the
  interactive work (1.2 x its time) made P99 TPOT 1.27x in bursts in the simulation of the benchmark.
- **No interactive work** while interactive traffic is about (a request arrived within the last
  max(IDLE_HORIZON_MIN_S, IDLE_HORIZON_GAPS x the mean gap between arrivals), at most
  IDLE_HORIZON_MAX_S): (1 + `step_time_slack`) x the 90th percentile of the recent interactive steps'
  predicted times (at least t1), and at most `step_time_budget_ms`. An arrival then waits behind batch
  work no longer than it could have waited behind interactive work alone, plus the slack. With no
  interactive traffic about (an offline job, `tokenfab batch run`) there is no limit, and fill takes the
  token budget: batch soaks up every idle cycle at full speed.
- Before the model has seen enough steps (MIN_ROWS): no limit.

Progress: fill gets at least `step_budget_min_tokens` tokens a step over the limit in a step with no
interactive work, and under an absolute target in a step that is not TTFT-critical (the target may be
below the interactive work's own time); under the relative limit the credit brings a row in instead,
and when even a full credit is short of one row, the row goes in and the credit goes negative (repaid
by later steps' allowance). So batch never starves while interactive work is idle or only decoding.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from tokenfab.costmodel.shape import StepShape

# Interactive traffic counts as "about" for this long after an arrival: 10 mean gaps (a Poisson stream
# is silent that long with probability e^-10), at least 5 s (a client's think time between turns), at
# most 2 minutes (after that an isolated request no longer slows a running batch job).
IDLE_HORIZON_GAPS = 10
IDLE_HORIZON_MIN_S = 5.0
IDLE_HORIZON_MAX_S = 120.0
GAP_EWMA = 0.1                  # weight of the newest gap between interactive arrivals
RECENT_STEPS = 64               # interactive steps behind the idle limit's reference ...
RECENT_QUANTILE = 0.9           # ... their 90th percentile: nearly the longest, but not one rare huge prefill


@dataclass(slots=True)
class StepBudget:
    model: object                # has `.cost`: a step-cost model (step_time(StepShape) -> s), or None
    target_s: float | None       # absolute per-step limit; None: relative to the step's firm work
    slack: float = 0.05          # without a target: fill may add this share of t1 to an interactive step
    min_tokens: int = 1          # fill tokens a step takes over the limit (see the module docstring)
    clock: Callable[[], float] = time.monotonic     # the arrivals' clock (Sequence.arrival_time)
    credit: float = 0.0          # seconds of slack earlier decode steps left unused (negative: overdrawn)
    last_arrival: float | None = None
    mean_gap_s: float | None = None
    recent_firm: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))  # firm work's predicted s
    _base: float | None = field(default=None, repr=False)   # this step's limit without credit, to settle

    # -- interactive arrivals ------------------------------------------------------------------------
    def note_arrival(self, t: float) -> None:
        """An interactive request arrived at `t` (its sequences share one time: counted once)."""
        if self.last_arrival is not None:
            if t <= self.last_arrival:
                return
            gap = t - self.last_arrival
            self.mean_gap_s = gap if self.mean_gap_s is None else (1 - GAP_EWMA) * self.mean_gap_s + GAP_EWMA * gap
        self.last_arrival = t

    def interactive_about(self) -> bool:
        if self.last_arrival is None:
            return False
        horizon = min(IDLE_HORIZON_MAX_S, max(IDLE_HORIZON_MIN_S, IDLE_HORIZON_GAPS * (self.mean_gap_s or 0.0)))
        return self.clock() - self.last_arrival <= horizon

    # -- one step ------------------------------------------------------------------------------------
    def one_decode_s(self, cost) -> float:
        """The shortest interactive step: one decode row."""
        s = StepShape()
        s.add(0, 1)
        return cost.step_time(s)

    def idle_limit(self, cost) -> float | None:
        """Seconds a step with no interactive work may take (None: no limit)."""
        if not self.interactive_about():
            return None
        ref = self.one_decode_s(cost)
        if self.recent_firm:
            v = sorted(self.recent_firm)
            ref = max(ref, v[int(RECENT_QUANTILE * (len(v) - 1))])
        limit = (1 + self.slack) * ref
        return limit if self.target_s is None else min(limit, self.target_s)

    def limit(self, firm: StepShape, critical: bool = False) -> float | None:
        """Seconds a step may take, given its firm (interactive) part; None: no limit this step.
        `critical`: an interactive prompt prefills in the step or waits for one."""
        self._base = None
        cost = self.model.cost
        if cost is None:
            return None
        if firm.num_seqs == 0:
            return self.idle_limit(cost)
        t_firm = cost.step_time(firm)
        self.recent_firm.append(t_firm)
        if critical:
            return t_firm
        if self.target_s is not None:
            return self.target_s
        self._base = t_firm + self.slack * self.one_decode_s(cost)
        return self._base + max(0.0, self.credit)

    def floor(self, firm: StepShape, critical: bool) -> int:
        """Fill tokens this step takes even over its limit (the progress floor)."""
        cost = self.model.cost
        if critical or cost is None:
            return 0
        if firm.num_seqs == 0 or self.target_s is not None:
            return self.min_tokens
        return self.min_tokens if self.credit >= self.one_decode_s(cost) else 0

    def settle(self, shape: StepShape) -> None:
        """Book the step as scheduled (firm and fill) against the credit of the relative limit."""
        if self._base is None:
            return
        cost = self.model.cost
        self.credit = min(self.one_decode_s(cost), self.credit + self._base - cost.step_time(shape))
        self._base = None

    # -- what the predictions use --------------------------------------------------------------------
    def bounded_time(self, cost, firm: StepShape, fill: StepShape, critical: bool = False) -> float:
        """The predicted time of a step with `firm` work and as much of `fill` as the budget lets in
        (without credit: its long-run mean). SLO admission (server/slo.py) predicts with it."""
        t_firm = cost.step_time(firm)
        if fill.num_seqs == 0:
            return t_firm
        both = replace(firm)
        for f in ("num_tokens", "num_seqs", "attn_pairs", "kv_tokens"):
            setattr(both, f, getattr(firm, f) + getattr(fill, f))
        t_all = cost.step_time(both)
        if firm.num_seqs == 0:
            limit = self.idle_limit(cost)
        elif critical:
            limit = t_firm
        else:
            limit = self.target_s if self.target_s is not None else t_firm + self.slack * self.one_decode_s(cost)
        if limit is None:
            return t_all
        return min(t_all, max(limit, t_firm))

    def fit(self, shape: StepShape, computed: int, n: int, limit: float) -> int:
        """The most of `n` new tokens (after `computed` cached ones) one sequence can add to `shape`
        with the step's predicted time within `limit` (0 when not even one fits)."""
        cost = self.model.cost

        def time_with(k: int) -> float:
            s = replace(shape)
            s.add(computed, k)
            return cost.step_time(s)

        if n <= 0 or time_with(n) <= limit:
            return max(n, 0)
        if time_with(1) > limit:
            return 0
        lo, hi = 1, n                # time_with(lo) fits, time_with(hi) does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if time_with(mid) <= limit:
                lo = mid
            else:
                hi = mid
        return lo
