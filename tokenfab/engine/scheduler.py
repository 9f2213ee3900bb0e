"""Scheduler: continuous batching under a token budget, with chunked prefill and preemption.

Each step spends `max_num_batched_tokens` tokens over at most `max_num_seqs` sequences:
1. running sequences first: decodes (one token) and prefills in progress (chunked to the budget);
2. then waiting sequences, admitted while the budget, the sequence cap and the KV pool allow.
Prefill chunks and decodes go into one flat batch. When the pool runs dry, the newest running
sequence (or the lowest-priority one under the priority policy) is preempted by recompute: its blocks
are freed and it goes back to the front of the queue, keeping the tokens it generated.
Service classes and prefill lanes (engine/lanes.py) order this: interactive before batch in the queue,
in the running set and as preemption victims, with per-step caps on batch and long-prompt prefills.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tokenfab.engine.kv_cache import BlockManager
from tokenfab.engine.lanes import BATCH, INTERACTIVE, PrefillCaps, class_rank
from tokenfab.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledBatch:
    """One step's work: each sequence with how many new tokens it runs."""
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, policy: str = "fcfs", batch_prefill_share: float = 1.0,
                 long_prompt_threshold: int | None = None, max_long_prefill_tokens: int | None = None):
        self.bm = block_manager
        self.batch_prefill_share = batch_prefill_share
        self.long_prompt_threshold = long_prompt_threshold
        self.max_long_prefill_tokens = max_long_prefill_tokens
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked = enable_chunked_prefill
        self.policy = policy
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence, front: bool = False) -> None:
        """Queue `seq` after the waiting sequences of its class (interactive ones before batch ones);
        `front`: ahead of its class (a preempted sequence, under fcfs)."""
        seq.status = SequenceStatus.WAITING
        if self.policy == "priority":
            # Keep the queue ordered by (class, priority, arrival); preempted sequences keep their place by key.
            key = (class_rank(seq), seq.priority, seq.arrival_time)
            i = 0
            for i, other in enumerate(self.waiting):
                if (class_rank(other), other.priority, other.arrival_time) > key:
                    break
            else:
                i = len(self.waiting)
            self.waiting.insert(i, seq)
            return
        rank = class_rank(seq)
        after = (lambda other: class_rank(other) >= rank) if front else (lambda other: class_rank(other) > rank)
        i = next((i for i, other in enumerate(self.waiting) if after(other)), len(self.waiting))
        self.waiting.insert(i, seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence (finished or aborted) from the queues and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free_seq(seq)

    def _victim(self, exclude: set[int]) -> Sequence:
        candidates = [s for s in self.running if s.seq_id not in exclude]
        batch = [s for s in candidates if s.service_class == BATCH]
        candidates = batch or candidates           # batch work is preempted before interactive work
        if self.policy == "priority":
            return max(candidates, key=lambda s: (s.priority, s.arrival_time))
        return candidates[-1]

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.bm.free_seq(seq)
        seq.spec_tokens = []
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.add(seq, front=True)
        batch.preempted.append(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()
        caps = PrefillCaps.for_step(budget, self.batch_prefill_share, self.long_prompt_threshold,
                                    self.max_long_prefill_tokens) if self.chunked else PrefillCaps(None, None, None)
        self._make_room_for_interactive(batch)
        room_made = len(batch.preempted)

        # 1. Running sequences: interactive, then batch, each oldest first (the running list is in admission order).
        for seq in sorted(self.running, key=class_rank):
            if budget <= 0:
                break
            if seq not in self.running:      # preempted earlier in this loop
                continue
            n = seq.num_tokens - seq.num_computed_tokens
            if seq.spec_tokens:
                # Drafts (engine/spec) are optional: cut to the budget, and dropped rather than preempt anyone.
                n = min(n + len(seq.spec_tokens), budget)
                if not self.bm.allocate(seq, n):
                    n = 1
                seq.spec_tokens = seq.spec_tokens[:n - 1]
            else:                            # the lanes cap prefills; a decode's drafts are not one
                n = caps.clamp(seq, min(n, budget))
                if n <= 0:
                    continue
            while not self.bm.allocate(seq, n):
                victim = self._victim(exclude=scheduled)   # seq itself is always a candidate
                self._preempt(victim, batch)
                if victim is seq:
                    break
            if seq not in self.running:
                continue
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            scheduled.add(seq.seq_id)
            if not seq.spec_tokens:
                caps.spend(seq, n)
            budget -= n

        # 2. Waiting sequences in queue order, unless step 1 had to preempt (the pool is tight). One whose
        # lane is spent this step is passed over, so the short prompts behind it still start.
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs or len(batch.preempted) > room_made:
                break
            cached = self.bm.find_cached_prefix(seq)
            num_cached = len(cached) * self.bm.block_size
            n = seq.num_tokens - num_cached
            if not self.chunked and n > budget:
                break
            n = caps.clamp(seq, min(n, budget))
            if n <= 0:
                continue
            if not self.bm.allocate(seq, n, cached):
                break
            self.waiting.remove(seq)
            if seq.num_preemptions == 0:
                self.bm.record_prefix_query(seq.num_tokens, num_cached)
                seq.num_cached_tokens = num_cached
            seq.num_computed_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            scheduled.add(seq.seq_id)
            caps.spend(seq, n)
            budget -= n
        return batch

    def _make_room_for_interactive(self, batch: ScheduledBatch) -> None:
        """Preempt running batch sequences, newest first, while the interactive sequence at the head of
        the queue could not start for want of blocks or of a sequence slot. The victims' full blocks stay
        in the prefix cache, so their recompute is mostly hits."""
        if not self.waiting or self.waiting[0].service_class != INTERACTIVE:
            return
        head = self.waiting[0]
        while True:
            victims = [s for s in self.running if s.service_class == BATCH]
            if not victims:
                return
            cached = self.bm.find_cached_prefix(head)
            n = min(head.num_tokens - len(cached) * self.bm.block_size, self.max_num_batched_tokens)
            if len(self.running) < self.max_num_seqs and self.bm.can_admit(head, cached, n):
                return
            self._preempt(victims[-1], batch)
