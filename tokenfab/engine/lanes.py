"""Service classes and prefill lanes: which work a step serves first, and how much of a step a lane may take.

- Service class: `interactive` (the default) or `batch` (OpenAI's `service_tier: "flex"`, and every
  Batch API line). Interactive sequences are queued, scheduled and kept ahead of batch ones; batch work
  fills what budget is left, and batch sequences are the first preempted when the pool or the sequence
  cap is short.
- Lanes cap prefill tokens per step: batch prefills to `batch_prefill_share` of the step's budget, and
  prompts of at least `long_prompt_threshold` tokens to `max_long_prefill_tokens`, so neither a batch
  job nor one 8k-token prompt makes a short interactive prompt wait behind a whole prefill. The caps
  apply only with chunked prefill (without it a capped prompt could never start).
"""
from __future__ import annotations

from dataclasses import dataclass

INTERACTIVE = "interactive"
BATCH = "batch"
SERVICE_CLASSES = (INTERACTIVE, BATCH)
# OpenAI's service_tier values and the class each maps to ("flex": cheaper, slower, may wait).
SERVICE_TIERS = {None: INTERACTIVE, "auto": INTERACTIVE, "default": INTERACTIVE, "flex": BATCH}
DEFAULT_BATCH_PRIORITY = 1     # vLLM's priority: lower runs first, 0 the default; at or above this: batch


def service_class_of(service_tier: str | None, priority: int, batch_priority: int | None = DEFAULT_BATCH_PRIORITY) -> str:
    """The class of an HTTP request. An explicit service_tier ("default" or "flex") decides; with none
    or "auto" (OpenAI's "let the server choose"), a `priority` at or above `batch_priority` (vLLM's
    convention: a larger value is less urgent) makes it batch, anything else is interactive.
    `batch_priority` None: priority never changes the class."""
    if service_tier in ("default", "flex"):
        return SERVICE_TIERS[service_tier]
    if batch_priority is not None and priority >= batch_priority:
        return BATCH
    return INTERACTIVE


def batch_prefill_cap(budget: int, batch_share: float) -> int | None:
    """Prefill tokens batch-class sequences may take in a step of `budget` tokens (None: no cap)."""
    return None if batch_share >= 1 else max(1, int(budget * batch_share))


def is_long_prompt(num_prompt_tokens: int, long_threshold: int | None) -> bool:
    """Whether a prompt prefills in the long-prompt lane (None: there is no such lane)."""
    return long_threshold is not None and num_prompt_tokens >= long_threshold


def class_rank(seq) -> int:
    """0 for interactive, 1 for batch: sorts interactive work first."""
    return int(seq.service_class == BATCH)


@dataclass(slots=True)
class PrefillCaps:
    """One step's remaining prefill allowance per lane (None: no cap)."""
    batch_left: int | None
    long_left: int | None
    long_threshold: int | None

    @classmethod
    def for_step(cls, budget: int, batch_share: float, long_threshold: int | None,
                 max_long_tokens: int | None) -> "PrefillCaps":
        long = max_long_tokens if long_threshold is not None else None
        return cls(batch_prefill_cap(budget, batch_share), long, long_threshold)

    def _is_long(self, seq) -> bool:
        return is_long_prompt(seq.num_prompt_tokens, self.long_threshold)

    def clamp(self, seq, n: int) -> int:
        """How many of `n` prefill tokens `seq` may run this step (a decode, n == 1, is never capped)."""
        if n <= 1:
            return n
        if seq.service_class == BATCH and self.batch_left is not None:
            n = min(n, self.batch_left)
        if self.long_left is not None and self._is_long(seq):
            n = min(n, self.long_left)
        return n

    def spend(self, seq, n: int) -> None:
        if n <= 1:
            return
        if seq.service_class == BATCH and self.batch_left is not None:
            self.batch_left -= n
        if self.long_left is not None and self._is_long(seq):
            self.long_left -= n
