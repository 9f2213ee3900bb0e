"""Step-time budget: how much batch work and long-prompt prefill a step may carry beside interactive work.

On a CPU a step's time grows with its rows (on the 2-core VM: 17 ms for one decode row, 53 ms for eight),
so every batch row or long-prefill token in a step slows every interactive decode in it. Token caps
cannot bound that (a smaller cap spreads a long prompt over more steps, each of them slower), so the
scheduler caps this "fill" work in time:
- interactive work goes into the step first (decodes, then short prompts' prefills): it is "firm";
- fill work (batch-class rows, then prefill chunks of prompts in the long-prompt lane) is then admitted
  only while the step model (engine/step_cost.py) predicts the whole step within the limit; a prefill
  chunk shrinks to the most tokens that fit, a decode row fits or waits;
- the limit is `step_time_budget_ms` when set (`tokenfab serve --slo-tpot-ms` sets it: the interactive
  TPOT target), else (1 + `step_time_slack`) x the predicted time of the step's firm work alone, i.e.
  fill may make an interactive step at most that much slower than it would be without fill;
- a step with no interactive work, or before the model is calibrated, has no limit (fill takes the
  token budget, as before), so batch work soaks up every idle cycle;
- progress: when no interactive request is waiting, fill gets at least `step_budget_min_tokens` tokens
  a step even over the limit, so it never starves behind a steady interactive load.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from tokenfab.plan.roofline import StepShape


@dataclass(slots=True)
class StepBudget:
    model: object                # has `.cost`: a step-cost model (step_time(StepShape) -> s), or None
    target_s: float | None       # absolute per-step limit; None: relative to the step's firm work
    slack: float = 0.2           # without a target: fill may add this share to the firm work's time
    min_tokens: int = 1          # fill tokens a step takes over the limit when no interactive request waits

    def limit(self, firm: StepShape) -> float | None:
        """Seconds a step may take, given its firm (interactive) part; None: no limit this step."""
        cost = self.model.cost
        if cost is None or firm.num_seqs == 0:
            return None
        if self.target_s is not None:
            return self.target_s
        return (1 + self.slack) * cost.step_time(firm)

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
