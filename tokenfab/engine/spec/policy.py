"""When to speculate and how far: the adaptive policy (docs/speculative.md has the measurements).

Per sequence: an exponentially weighted moving average `rate` of the share of its drafted tokens
the target accepted. Its next k is the expected accepted run plus one, clamped to [1, k_max]: with a
per-token acceptance a, a run has length a / (1 - a) on average. A sequence whose rate falls below
`OFF_RATE`, or whose average accepted tokens per round falls below `MIN_ACCEPTED`, stops proposing
for `backoff` steps (16, doubling up to 256 each time it fails again), then tries again afresh. A
verification step measured about 2-2.4x a plain decode step (benchmarks/speculative.py, single
stream, shared cores), so a round must keep about one draft token to pay for itself.

Per step: no speculation when more than `max_batch_size` sequences decode. A verification step
leaves the one-call C decode stack for the per-layer path and scores k + 1 rows per sequence; at
large batches decode is compute-bound and the extra rows cost what they save.
"""
from __future__ import annotations

from dataclasses import dataclass

EWMA = 0.3            # weight of the newest round
START_RATE = 0.6      # a new sequence's assumed acceptance
OFF_RATE = 0.15       # below this, back off
START_ACCEPTED = 2.0  # a new sequence's assumed accepted tokens per round
MIN_ACCEPTED = 1.0    # below this average per round, back off
MIN_ROUNDS = 2        # rounds before a sequence may be switched off
BACKOFF_MIN, BACKOFF_MAX = 16, 256


@dataclass(slots=True)
class SeqSpecState:
    rate: float = START_RATE
    accepted: float = START_ACCEPTED
    rounds: int = 0
    paused_until: int = 0        # engine step before which this sequence does not propose
    backoff: int = BACKOFF_MIN
    draft_computed: int = 0      # draft method: tokens whose K/V the draft model holds (draft.py)
    draft_epoch: int = 0         # ... as of this many preemptions of the sequence


class AdaptivePolicy:
    def __init__(self, k_max: int, max_batch_size: int, adaptive: bool = True) -> None:
        self.k_max, self.max_batch_size, self.adaptive = k_max, max_batch_size, adaptive

    def step_allows(self, num_decoding: int) -> bool:
        return num_decoding <= self.max_batch_size

    def k_for(self, st: SeqSpecState, step: int) -> int:
        if not self.adaptive:
            return self.k_max
        if step < st.paused_until:
            return 0
        a = min(st.rate, 0.95)
        return max(1, min(self.k_max, round(a / (1 - a)) + 1))

    def observe(self, st: SeqSpecState, num_drafts: int, num_accepted: int, step: int) -> None:
        if not self.adaptive or num_drafts == 0:
            return
        st.rate = (1 - EWMA) * st.rate + EWMA * (num_accepted / num_drafts)
        st.accepted = (1 - EWMA) * st.accepted + EWMA * num_accepted
        st.rounds += 1
        if st.rounds >= MIN_ROUNDS and (st.rate < OFF_RATE or st.accepted < MIN_ACCEPTED):
            st.paused_until = step + st.backoff
            st.backoff = min(2 * st.backoff, BACKOFF_MAX)
            st.rate, st.accepted, st.rounds = START_RATE, START_ACCEPTED, 0
