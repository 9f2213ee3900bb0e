"""Scheduler: continuous batching under a token budget, with chunked prefill and preemption.

Each step spends `max_num_batched_tokens` tokens over at most `max_num_seqs` sequences:
1. running sequences first: decodes (one token) and prefills in progress (chunked to the budget);
2. then waiting sequences, admitted while the budget, the sequence cap and the KV pool allow.
Prefill chunks and decodes go into one flat batch. When the pool runs dry, the newest running
sequence (or the lowest-priority one under the priority policy) is preempted by recompute: its blocks
are freed and it goes back to the front of the queue, keeping the tokens it generated.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tokenfab.engine.kv_cache import BlockManager
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
                 enable_chunked_prefill: bool = True, policy: str = "fcfs"):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked = enable_chunked_prefill
        self.policy = policy
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        if self.policy == "priority":
            # Keep the queue ordered by (priority, arrival); preempted sequences keep their place by key.
            key = (seq.priority, seq.arrival_time)
            i = 0
            for i, other in enumerate(self.waiting):
                if (other.priority, other.arrival_time) > key:
                    break
            else:
                i = len(self.waiting)
            self.waiting.insert(i, seq)
        else:
            self.waiting.append(seq)

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
        if self.policy == "priority":
            self.add(seq)
        else:
            self.waiting.appendleft(seq)
        batch.preempted.append(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()

        # 1. Running sequences, oldest first (the running list is in admission order).
        for seq in list(self.running):
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
            n = min(n, budget)
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
            budget -= n

        # 2. Waiting sequences, unless this step had to preempt (the pool is tight).
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not batch.preempted:
            seq = self.waiting[0]
            cached = self.bm.find_cached_prefix(seq)
            num_cached = len(cached) * self.bm.block_size
            n = seq.num_tokens - num_cached
            if not self.chunked and n > budget:
                break
            n = min(n, budget)
            if not self.bm.allocate(seq, n, cached):
                break
            self.waiting.popleft()
            if seq.num_preemptions == 0:
                self.bm.record_prefix_query(seq.num_tokens, num_cached)
                seq.num_cached_tokens = num_cached
            seq.num_computed_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            scheduled.add(seq.seq_id)
            budget -= n
        return batch
