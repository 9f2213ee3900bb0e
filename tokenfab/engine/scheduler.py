"""Scheduler: continuous batching under a token budget, with chunked prefill and preemption.

Each step spends `max_num_batched_tokens` tokens over at most `max_num_seqs` sequences:
1. firm work first: running interactive sequences (decodes, and prefills in progress, chunked to the
   budget), then waiting interactive prompts, admitted while the budget, the sequence cap and the KV
   pool allow;
2. then fill work: batch-class rows and prefill chunks in the long-prompt lane, running ones first,
   under the step-time budget when one is set (engine/step_budget.py: admitted only while the step
   model predicts the step within its time limit, which depends on the interactive work in it and on
   whether interactive requests are arriving; prefill chunks shrink to fit).
Prefill chunks and decodes go into one flat batch. When the pool runs dry, the newest running
sequence (or the lowest-priority one under the priority policy) is preempted by recompute: its blocks
are freed and it goes back to the front of the queue, keeping the tokens it generated.
Service classes and prefill lanes (engine/lanes.py) order this: interactive before batch in the queue,
in the running set and as preemption victims, with per-step caps on batch and long-prompt prefills.

The scheduler owns the requests' state: after the step runs, `update_from_output(batch, output)` advances
each sequence's computed tokens, registers its newly full blocks in the prefix cache, appends the sampled
tokens (accepted draft tokens included) and finishes the sequences that stop (engine/update.py).
With a KV connector (engine/kv_connector.py), a waiting prompt whose next prefix blocks are held
elsewhere is admitted with them loaded instead of computed; while they are not ready yet it waits
(WAITING_FOR_REMOTE_KV) and the prompts behind it go first.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from tokenfab.costmodel.shape import StepShape
from tokenfab.engine.kv_cache import BlockManager
from tokenfab.engine.lanes import BATCH, INTERACTIVE, PrefillCaps, class_rank, is_long_prompt
from tokenfab.engine.sequence import Sequence, SequenceStatus
from tokenfab.engine.step_budget import StepBudget
from tokenfab.engine.update import ModelOutput, StepUpdate, append_token, finish

log = logging.getLogger("tokenfab.engine")


@dataclass(slots=True)
class ScheduledBatch:
    """One step's work: each sequence with how many new tokens it runs."""
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # (content hash, block id) of the prefix blocks the KV connector loads before the step runs
    kv_loads: list[tuple[int, int]] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


@dataclass(slots=True)
class _StepPlan:
    """What one schedule() call has spent so far."""
    batch: ScheduledBatch
    tokens_left: int                 # of max_num_batched_tokens
    caps: PrefillCaps
    shape: StepShape                 # the step so far, for the step-time budget
    scheduled: set[int]
    room_made: int = 0               # preemptions made for the interactive queue head
    limit: float | None = None       # the step's time limit for fill work (None: none)
    floor_left: int = 0              # fill tokens still allowed over the limit (the progress floor)
    firm_prefill: bool = False       # an interactive prompt prefills in this step (its TTFT depends on it)
    remote: dict = field(default_factory=dict)   # seq_id -> (local hit blocks, KV connector's answer): asked once a step


class Scheduler:
    @classmethod
    def from_config(cls, block_manager: BlockManager, config, step_cost, eos_token_ids, max_model_len: int) -> "Scheduler":
        """The engine's scheduler for an EngineConfig, with its step-time budget over `step_cost` when enabled."""
        budget = (StepBudget(step_cost, config.step_time_budget_ms / 1e3 if config.step_time_budget_ms else None,
                             config.step_time_slack, config.step_budget_min_tokens)
                  if config.enable_step_time_budget else None)
        return cls(block_manager, config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill,
                   config.scheduling_policy, config.batch_prefill_share, config.long_prompt_threshold,
                   config.max_long_prefill_tokens, budget, eos_token_ids, max_model_len)

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, policy: str = "fcfs", batch_prefill_share: float = 1.0,
                 long_prompt_threshold: int | None = None, max_long_prefill_tokens: int | None = None,
                 step_budget: StepBudget | None = None, eos_token_ids=(), max_model_len: int | None = None):
        """`eos_token_ids`, `max_model_len`: the finish checks of `update_from_output`."""
        self.bm = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.kv_connector = None         # scheduler side of a KV connector (engine/kv_connector.py), when one is set
        self.step_budget = step_budget
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
        self.num_generation_tokens = 0   # tokens appended since start

    def add(self, seq: Sequence, front: bool = False) -> None:
        """Queue `seq` after the waiting sequences of its class (interactive ones before batch ones);
        `front`: ahead of its class (a preempted sequence, under fcfs)."""
        seq.status = SequenceStatus.WAITING
        if self.step_budget is not None and seq.service_class != BATCH and seq.num_preemptions == 0:
            self.step_budget.note_arrival(seq.arrival_time)
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

    def _is_long(self, seq: Sequence) -> bool:
        return is_long_prompt(seq.num_prompt_tokens, self.long_prompt_threshold)

    def _is_fill(self, seq: Sequence, n: int) -> bool:
        """Batch rows, and prefill chunks (n > 1 tokens to run) in the long-prompt lane: the work that goes
        into a step after the interactive work, under the step-time budget (engine/step_budget.py)."""
        return seq.service_class == BATCH or (n > 1 and self._is_long(seq))

    def schedule(self) -> ScheduledBatch:
        caps = PrefillCaps.for_step(self.max_num_batched_tokens, self.batch_prefill_share, self.long_prompt_threshold,
                                    self.max_long_prefill_tokens) if self.chunked else PrefillCaps(None, None, None)
        plan = _StepPlan(ScheduledBatch(), self.max_num_batched_tokens, caps, StepShape(), set())
        self._make_room_for_interactive(plan.batch)
        plan.room_made = len(plan.batch.preempted)
        # Running sequences: interactive, then batch, each oldest first (the running list is in admission order).
        firm, fill = [], []
        for seq in sorted(self.running, key=class_rank):
            (fill if self._is_fill(seq, seq.num_tokens - seq.num_computed_tokens) else firm).append(seq)

        # 1. Firm work: running interactive sequences (decodes, short prefills), then waiting short prompts.
        for seq in firm:
            self._schedule_running(seq, plan, is_fill=False)
        self._admit_waiting(plan, is_fill=False)

        # 2. Fill work within the step-time budget: long-prompt prefills, then batch rows, running ones first.
        if self.step_budget is not None:
            short_waiting = any(s.service_class != BATCH and not self._is_long(s) for s in self.waiting)
            critical = plan.firm_prefill or short_waiting
            plan.limit = self.step_budget.limit(plan.shape, critical)
            plan.floor_left = self.step_budget.floor(plan.shape, critical)
        for seq in fill:
            self._schedule_running(seq, plan, is_fill=True)
        self._admit_waiting(plan, is_fill=True)
        if self.step_budget is not None:
            self.step_budget.settle(plan.shape)
        now = time.monotonic()
        for seq in plan.batch.seqs:
            if seq.scheduled_time is None:
                seq.scheduled_time = now
        return plan.batch

    def update_from_output(self, batch: ScheduledBatch, output: ModelOutput) -> StepUpdate:
        """Apply an executed step: advance each scheduled sequence's computed tokens (draft tokens count
        once accepted), register its newly full blocks, append the sampled tokens one at a time up to the
        first finish, and finish prompt-only sequences once scored. A sequence whose update raises (e.g.
        a tokenizer failure) ends with an error instead of the batch."""
        update, prompt_done = StepUpdate(), []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n - len(seq.spec_tokens)
            self.bm.cache_full_blocks(seq)
            if seq.max_tokens == 0 and seq.num_computed_tokens == seq.num_tokens:
                prompt_done.append(seq)     # prompt only (max_tokens 0): scored, nothing to sample
        now = time.monotonic()
        for seq, tokens in output.sampled:
            update.request_ids[seq.request_id] = None
            try:
                self._append(seq, tokens, now, update)
            except Exception as e:
                log.exception("request %s failed in postprocessing", seq.request_id)
                update.errors[seq.request_id] = f"{type(e).__name__}: {e}"
                seq.status = SequenceStatus.FINISHED_ERROR
                self.remove(seq)
                update.finished.append(seq)
        for seq in prompt_done:
            self._finish(seq, SequenceStatus.FINISHED_LENGTH, None, update)
            update.request_ids[seq.request_id] = None
        return update

    def _append(self, seq: Sequence, tokens: list, now: float, update: StepUpdate) -> None:
        """Append `tokens` (accepted drafts, then one of the target's own). Before this, the sequence's
        computed tokens reach up to its drafts; each accepted draft's K/V was computed in this step."""
        had_drafts = bool(seq.spec_tokens)
        seq.spec_tokens = []
        ids: list[int] = []
        update.new_tokens.append((seq, ids))
        for j, tok in enumerate(tokens):
            ids.append(tok.token_id)
            self.num_generation_tokens += 1
            done = append_token(seq, tok, now, self.eos_token_ids, self.max_model_len)
            if done is not None:
                self._finish(seq, *done, update)
                return
            if j < len(tokens) - 1:
                seq.num_computed_tokens += 1
        if had_drafts:                      # the accepted drafts' blocks; the rejected ones' are freed
            self.bm.cache_full_blocks(seq)
            self.bm.trim(seq, seq.num_tokens)

    def _finish(self, seq: Sequence, status: SequenceStatus, reason, update: StepUpdate) -> None:
        finish(seq, status, reason)
        self.remove(seq)
        update.finished.append(seq)

    def _fit(self, seq: Sequence, computed: int, n: int, plan: "_StepPlan") -> int:
        """Fill tokens of `n` that keep the step within its time limit (or the progress floor)."""
        if plan.limit is None or n <= 0:
            return n
        k = max(self.step_budget.fit(plan.shape, computed, n, plan.limit), min(n, plan.floor_left))
        if not self.chunked and n > 1 and k < n:       # an unchunked prompt runs whole or waits
            return n if plan.floor_left > 0 else 0
        return k

    def _schedule_running(self, seq: Sequence, plan: "_StepPlan", is_fill: bool) -> None:
        if plan.tokens_left <= 0 or seq not in self.running:      # not preempted earlier in this step
            return
        n = seq.num_tokens - seq.num_computed_tokens
        drafts = bool(seq.spec_tokens)
        if drafts:
            # Drafts (engine/spec) are optional: cut to the budget, and dropped rather than preempt anyone.
            n = min(n + len(seq.spec_tokens), plan.tokens_left)
            if is_fill:
                n = self._fit(seq, seq.num_computed_tokens, n, plan)
                if n <= 0:
                    return
            if not self.bm.allocate(seq, n):
                n = 1
            seq.spec_tokens = seq.spec_tokens[:n - 1]
        else:                            # the lanes cap prefills; a decode's drafts are not one
            n = plan.caps.clamp(seq, min(n, plan.tokens_left))
            if is_fill:
                n = self._fit(seq, seq.num_computed_tokens, n, plan)
            if n <= 0:
                return
        while not self.bm.allocate(seq, n):
            victim = self._victim(exclude=plan.scheduled)   # seq itself is always a candidate
            self._preempt(victim, plan.batch)
            if victim is seq:
                break
        if seq not in self.running:
            return
        self._take(seq, seq.num_computed_tokens, n, plan, is_fill, spend_caps=not drafts)

    def _admit_waiting(self, plan: "_StepPlan", is_fill: bool) -> None:
        """Waiting sequences of the kind asked in queue order, unless the running ones had to preempt (the
        pool is tight). One whose lane is spent this step is passed over, so the prompts behind it still start."""
        for seq in list(self.waiting):
            if plan.tokens_left <= 0 or len(self.running) >= self.max_num_seqs \
                    or len(plan.batch.preempted) > plan.room_made:
                break
            cached = self.bm.find_cached_prefix(seq)
            num_cached = len(cached) * self.bm.block_size
            remote = self._remote_blocks(seq, cached, plan) if self.kv_connector is not None else []
            if remote is None:
                continue                   # its blocks are on their way: the prompts behind it go first
            num_computed = num_cached + len(remote) * self.bm.block_size
            n = seq.num_tokens - num_computed
            if self._is_fill(seq, n) != is_fill:
                continue
            if not self.chunked and n > plan.tokens_left:
                break
            n = plan.caps.clamp(seq, min(n, plan.tokens_left))
            if is_fill:
                n = self._fit(seq, num_computed, n, plan)
            if n <= 0:
                continue
            if not self.bm.allocate(seq, num_computed - num_cached + n, cached):
                break
            self.waiting.remove(seq)
            if seq.num_preemptions == 0:
                self.bm.record_prefix_query(seq.num_tokens, num_cached)
                seq.num_cached_tokens = num_computed
            seq.num_computed_tokens = num_computed
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if remote:                     # loaded into the blocks after the cached ones before the step runs
                plan.batch.kv_loads.extend(zip(remote, seq.block_table[len(cached):]))
            self._take(seq, num_computed, n, plan, is_fill)

    def _remote_blocks(self, seq: Sequence, cached: list[int], plan: "_StepPlan") -> list[int] | None:
        """Hashes of the prefix blocks after `cached` that the KV connector supplies now; None while
        they are not ready (the sequence waits for them)."""
        if seq.needs_prompt_logprobs:
            return []                      # the prompt's logits need every position computed here
        asked = plan.remote.get(seq.seq_id)
        if asked is not None and asked[0] == len(cached):
            return asked[1]
        plan.remote[seq.seq_id] = (len(cached), self._ask_connector(seq, cached))
        return plan.remote[seq.seq_id][1]

    def _ask_connector(self, seq: Sequence, cached: list[int]) -> list[int] | None:
        hashes = self.bm.prefix_hashes(seq.token_ids, cached)
        num, ready = self.kv_connector.match(hashes) if hashes else (0, True)
        if num and not ready:
            seq.status = SequenceStatus.WAITING_FOR_REMOTE_KV
            return None
        seq.status = SequenceStatus.WAITING
        return hashes[:num]

    @staticmethod
    def _take(seq: Sequence, computed: int, n: int, plan: "_StepPlan", is_fill: bool, spend_caps: bool = True) -> None:
        plan.batch.seqs.append(seq)
        plan.batch.num_new_tokens.append(n)
        plan.scheduled.add(seq.seq_id)
        if spend_caps:
            plan.caps.spend(seq, n)
        plan.tokens_left -= n
        plan.shape.add(computed, n)
        if is_fill:
            plan.floor_left -= n
        elif n > 1 and spend_caps:       # a prefill chunk, not a decode with drafts
            plan.firm_prefill = True

    def _make_room_for_interactive(self, batch: ScheduledBatch) -> None:
        """Preempt running batch sequences, newest first, while the interactive sequence at the head of
        the queue could not start for want of blocks or of a sequence slot. The victims' full blocks stay
        in the prefix cache, so their recompute is mostly hits."""
        if not self.waiting or self.waiting[0].service_class != INTERACTIVE:
            return
        head = self.waiting[0]
        if head.status is SequenceStatus.WAITING_FOR_REMOTE_KV:
            return                         # it cannot start this step whatever room is made
        while True:
            victims = [s for s in self.running if s.service_class == BATCH]
            if not victims:
                return
            cached = self.bm.find_cached_prefix(head)
            n = min(head.num_tokens - len(cached) * self.bm.block_size, self.max_num_batched_tokens)
            if len(self.running) < self.max_num_seqs and self.bm.can_admit(head, cached, n):
                return
            self._preempt(victims[-1], batch)
