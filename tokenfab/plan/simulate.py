"""Discrete-event simulation of one engine replica: continuous batching with chunked prefill.

The policy is the engine scheduler's (tokenfab/engine/scheduler.py), step for step:
1. running sequences in admission order get their tokens (a decode: 1; a prefill: a chunk of what
   the budget leaves), growing their KV blocks; when the pool is short the newest running sequence
   (the lowest-priority one under the priority policy) not yet scheduled this step is preempted by
   recompute and goes back to the waiting queue;
2. waiting sequences (FCFS, or ordered by (priority, arrival)) are admitted while the token budget,
   `max_num_seqs` and the pool allow, unless this step preempted.
Speculative decoding (`spec_tokens` k > 0) as the engine runs it: while at most `spec_max_batch_size`
sequences decode, each decode scores 1 + k tokens and emits 1 + k x `spec_acceptance` tokens on
average (the acceptance rate is accepted / drafted tokens, as /metrics counts them; the fraction
carries over between steps).
A sequence whose computed tokens catch up with its tokens samples one; the step's duration comes
from a step-cost model (`new_shape()` / `step_time(shape)`): the roofline, or measured step times.
Between steps the clock jumps to the next event, so a simulated hour takes milliseconds to seconds.
"""
from __future__ import annotations

import math
from bisect import insort
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from tokenfab.costmodel.shape import StepShape
from tokenfab.plan.workload import Request


class StepCost(Protocol):
    def new_shape(self) -> StepShape: ...
    def step_time(self, shape: StepShape) -> float: ...


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_kv_blocks: int | None = None     # None: an unlimited pool
    policy: str = "fcfs"                 # fcfs | priority (online requests before offline ones)
    enable_chunked_prefill: bool = True
    spec_tokens: int = 0                 # speculative decoding: k draft tokens per decode (0: off)
    spec_acceptance: float = 0.0         # share of draft tokens accepted
    spec_max_batch_size: int = 4         # as the engine: no speculation in a step with more decodes

    def __post_init__(self):
        if self.spec_tokens < 0 or not 0.0 <= self.spec_acceptance <= 1.0:
            raise ValueError(f"spec_tokens must be >= 0 and spec_acceptance in [0, 1], "
                             f"got {self.spec_tokens} and {self.spec_acceptance}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be fcfs or priority, got {self.policy!r}")
        if min(self.max_num_seqs, self.max_num_batched_tokens, self.block_size) < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and block_size must be positive")


class _Seq:
    __slots__ = ("req", "key", "computed", "generated", "blocks", "first_sched", "first_token",
                 "finish", "preemptions", "drafts", "credit")

    def __init__(self, req: Request):
        self.req = req
        self.key = (1 if req.offline else 0, req.arrival, req.id)   # lower runs first
        self.computed = self.generated = self.blocks = self.preemptions = self.drafts = 0
        self.credit = 0.0       # speculative decoding: emitted tokens owed, fractional
        self.first_sched = self.first_token = self.finish = None


@dataclass(frozen=True, slots=True)
class RequestResult:
    id: int
    arrival: float
    prompt_len: int
    output_len: int
    offline: bool
    queue_s: float          # arrival → first scheduled
    ttft_s: float           # arrival → first token
    tpot_s: float | None    # (e2e − ttft) / (output − 1); None for one-token outputs
    e2e_s: float
    preemptions: int


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between order statistics (numpy's default)."""
    if not values:
        return math.nan
    v = sorted(values)
    x = (len(v) - 1) * p / 100
    lo = math.floor(x)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (x - lo)


@dataclass(slots=True)
class SimResult:
    requests: list[RequestResult]
    end_s: float                 # last completion (the clock starts at 0)
    last_arrival_s: float
    busy_s: float                # time spent inside steps
    num_steps: int
    num_preemptions: int
    area_in_system: float        # ∫ (requests in system) dt, integrated from arrival/departure events
    tokens_per_step: float
    seqs_per_step: float

    @property
    def busy_fraction(self) -> float:
        """Share of the time the replica is stepping. Continuous batching steps whenever anything is
        in flight, so this nears 1 long before the replica saturates; see capacity.utilization."""
        return self.busy_s / self.end_s if self.end_s else 0.0

    @property
    def mean_in_system(self) -> float:
        return self.area_in_system / self.end_s if self.end_s else 0.0

    @property
    def drain_s(self) -> float:
        """Time from the last arrival until the system is empty: grows with the run when overloaded."""
        return self.end_s - self.last_arrival_s

    def select(self, online: bool | None = True) -> list[RequestResult]:
        return [r for r in self.requests if online is None or r.offline != online]

    def summary(self, online: bool | None = True, percentiles: tuple[float, ...] = (50, 90, 99)) -> dict:
        rs = self.select(online)
        out: dict = {"requests": len(rs)}
        for metric in ("ttft", "tpot", "e2e", "queue"):
            vals = [getattr(r, f"{metric}_s") for r in rs]
            vals = [v for v in vals if v is not None]
            out[metric] = {f"p{p:g}": percentile(vals, p) for p in percentiles}
            out[metric]["mean"] = sum(vals) / len(vals) if vals else math.nan
        span = self.end_s or 1.0
        out["request_rate"] = len(rs) / span
        out["output_tok_s"] = sum(r.output_len for r in rs) / span
        out["total_tok_s"] = sum(r.output_len + r.prompt_len for r in rs) / span
        return out

    def totals(self) -> dict:
        return {"end_s": self.end_s, "busy_s": self.busy_s, "busy_fraction": self.busy_fraction,
                "steps": self.num_steps, "preemptions": self.num_preemptions,
                "mean_in_system": self.mean_in_system, "drain_s": self.drain_s,
                "tokens_per_step": self.tokens_per_step, "seqs_per_step": self.seqs_per_step}


class Simulator:
    def __init__(self, cost: StepCost, config: SchedulerConfig = SchedulerConfig(), fast_forward: bool = True,
                 trace: list | None = None):
        """`trace`, when given, receives each step's [(request id, new tokens), ...] (and turns
        off fast-forwarding, which skips over steps)."""
        self.cost = cost
        self.cfg = config
        self.trace = trace
        self.fast_forward = fast_forward and trace is None

    # -- block accounting (counts only; the simulator needs how many, not which) --------------
    def _allocate(self, seq: _Seq, n: int) -> bool:
        need = -(-(seq.computed + n) // self.cfg.block_size) - seq.blocks
        if need > 0:
            if self.free_blocks is not None:
                if need > self.free_blocks:
                    return False
                self.free_blocks -= need
            seq.blocks += need
        return True

    def _free(self, seq: _Seq) -> None:
        if self.free_blocks is not None:
            self.free_blocks += seq.blocks
        seq.blocks = 0

    def _enqueue(self, seq: _Seq, front: bool = False) -> None:
        if self.cfg.policy == "priority":
            insort(self.waiting, seq, key=lambda s: s.key)
        elif front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def _preempt(self, victim: _Seq) -> None:
        self.running.remove(victim)
        self._free(victim)
        victim.preemptions += 1
        self.num_preemptions += 1
        self._enqueue(victim, front=True)

    def _schedule(self) -> tuple[list[tuple[_Seq, int]], StepShape]:
        cfg = self.cfg
        shape = self.cost.new_shape()
        add = shape.add
        batch: list[tuple[_Seq, int]] = []
        budget = cfg.max_num_batched_tokens
        bs = cfg.block_size
        preempted = False
        running = self.running
        i = 0      # running[:i] are scheduled this step; victims come from running[i:]
        spec = cfg.spec_tokens > 0 and self._num_decoding() <= cfg.spec_max_batch_size
        while i < len(running) and budget > 0:
            seq = running[i]
            n = seq.req.prompt_len + seq.generated - seq.computed
            seq.drafts = 0
            if spec and n == 1 and seq.generated > 0:
                seq.drafts = max(0, min(cfg.spec_tokens, seq.req.output_len - seq.generated - 1, budget - 1))
                n += seq.drafts
            if n > budget:
                n = budget
            need = -(-(seq.computed + n) // bs) - seq.blocks
            if need > 0:
                victim = None
                while self.free_blocks is not None and need > self.free_blocks and victim is not seq:
                    victim = (max(running[i:], key=lambda s: s.key) if cfg.policy == "priority"
                              else running[-1])
                    self._preempt(victim)
                    preempted = True
                if victim is seq:
                    continue                         # running[i] is now the next sequence
                self._allocate(seq, n)
            batch.append((seq, n))
            add(seq.computed, n)
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs and not preempted:
            seq = self.waiting[0]
            n = seq.req.prompt_len + seq.generated        # recompute everything after a preemption
            if not cfg.enable_chunked_prefill and n > budget:
                break
            n = min(n, budget)
            seq.computed = seq.drafts = 0
            if not self._allocate(seq, n):
                if not self.running:
                    raise ValueError(f"request {seq.req.id} needs {-(-n // cfg.block_size)} KV blocks to start "
                                     f"but the pool has {cfg.num_kv_blocks}; give more memory or shorter prompts")
                break
            if self.cfg.policy == "priority":
                self.waiting.pop(0)
            else:
                self.waiting.popleft()
            if seq.first_sched is None:
                seq.first_sched = self.now
            self.running.append(seq)
            batch.append((seq, n))
            shape.add(0, n)
            budget -= n
        return batch, shape

    def _num_decoding(self) -> int:
        return sum(1 for s in self.running if s.generated > 0 and s.computed == s.req.prompt_len + s.generated - 1)

    def _decode_run_length(self) -> int:
        """How many pure-decode steps can be costed without looking at each sequence: all running
        sequences decode, nobody can be admitted, nobody finishes before the last of them, and the
        pool surely holds the blocks they grow into. 0 when the next step needs the full scheduler."""
        cfg, running = self.cfg, self.running
        if not running or len(running) > cfg.max_num_batched_tokens or self._windowed:
            return 0
        if cfg.spec_tokens and len(running) <= cfg.spec_max_batch_size:
            return 0                       # speculative steps go through the scheduler one by one
        if self.waiting and len(running) < cfg.max_num_seqs:
            # Admission stays impossible while the pool only shrinks: the queue's head needs more
            # blocks than are free, or the decodes use up the whole token budget.
            room = cfg.max_num_batched_tokens - len(running)
            if room > 0:
                head = self.waiting[0]
                n = min(head.req.prompt_len + head.generated, room)
                if self.free_blocks is None or -(-n // cfg.block_size) <= self.free_blocks:
                    return 0
        k = None
        for s in running:
            left = s.req.output_len - s.generated
            if s.generated == 0 or s.computed != s.req.prompt_len + s.generated - 1:
                return 0
            k = left if k is None or left < k else k
        if self.free_blocks is not None:
            # Each sequence grows by at most ceil(k / block_size) + 1 blocks in k steps.
            k = min(k, (self.free_blocks // len(running) - 1) * cfg.block_size)
        return k if k and k > 1 else 0

    def _run_decodes(self, k: int, arrivals: deque) -> tuple[float, int, list[_Seq]]:
        """Up to `k` decode steps of the whole running set, stopping after a step that sees an arrival.
        Returns (time spent, steps taken, sequences that finished)."""
        running = self.running
        b = len(running)
        ctx = sum(s.computed for s in running)
        next_arrival = arrivals[0].arrival if arrivals else math.inf
        t, steps = self.now, 0
        shape = self.cost.new_shape()
        shape.num_tokens = shape.num_seqs = b
        step_time = self.cost.step_time
        while steps < k:
            shape.attn_pairs = shape.kv_tokens = ctx + b
            t += step_time(shape)
            ctx += b
            steps += 1
            if t >= next_arrival:
                break
        finished = []
        for s in running:
            s.computed += steps
            s.generated += steps
            self._allocate(s, 0)
            if s.generated >= s.req.output_len:
                s.finish = t
                finished.append(s)
        for s in finished:
            running.remove(s)
            self._free(s)
        spent, self.now = t - self.now, t
        return spent, steps, finished

    def run(self, requests: list[Request]) -> SimResult:
        cfg = self.cfg
        self.free_blocks = cfg.num_kv_blocks
        self.waiting = [] if cfg.policy == "priority" else deque()
        self.running: list[_Seq] = []
        self.num_preemptions = 0
        self.now = 0.0
        if reset := getattr(self.cost, "reset", None):
            reset()                        # a stateful (noisy) cost starts its sequence afresh
        # Sliding-window attention makes a step's cost depend on each context, not only on their sum.
        self._windowed = bool(getattr(self.cost.new_shape(), "window", None))
        if cfg.num_kv_blocks is not None and requests:
            # As the engine caps max_model_len at the pool: a sequence must fit alone, or preempting
            # everything else could never let it finish.
            big = max(requests, key=lambda r: r.prompt_len + r.output_len)
            if big.prompt_len + big.output_len > cfg.num_kv_blocks * cfg.block_size:
                raise ValueError(f"request {big.id} needs {big.prompt_len + big.output_len} tokens of KV but the pool "
                                 f"holds {cfg.num_kv_blocks * cfg.block_size}; give more memory or shorter requests")
        if not cfg.enable_chunked_prefill and requests:
            # as the engine caps max_model_len at the step's budget: a prompt, or a preempted sequence's
            # recompute, runs in one step
            big = max(requests, key=lambda r: r.prompt_len + r.output_len)
            if big.prompt_len + big.output_len > cfg.max_num_batched_tokens:
                raise ValueError(f"request {big.id} needs {big.prompt_len + big.output_len} tokens in one step, but "
                                 f"chunked prefill is off and a step holds {cfg.max_num_batched_tokens}")
        arrivals = deque(sorted(requests, key=lambda r: r.arrival))
        last_arrival = arrivals[-1].arrival if arrivals else 0.0
        done: list[_Seq] = []
        in_system, area, last_t = 0, 0.0, 0.0
        busy, steps, tok_sum, seq_sum = 0.0, 0, 0, 0

        def arrive_until(t: float) -> None:
            nonlocal in_system, area, last_t
            while arrivals and arrivals[0].arrival <= t:
                req = arrivals.popleft()
                area += in_system * (req.arrival - last_t)
                in_system, last_t = in_system + 1, req.arrival
                self._enqueue(_Seq(req))

        while arrivals or self.waiting or self.running:
            if not self.waiting and not self.running:
                self.now = max(self.now, arrivals[0].arrival)   # idle: jump to the next arrival
            arrive_until(self.now)
            k = self._decode_run_length() if self.fast_forward else 0
            if k:
                b = len(self.running)
                spent, n, finished = self._run_decodes(k, arrivals)
                busy += spent
                steps += n
                tok_sum += n * b
                seq_sum += n * b
                arrive_until(self.now)
                area += in_system * (self.now - last_t)
                last_t = self.now
                done.extend(finished)
                in_system -= len(finished)
                continue
            batch, shape = self._schedule()
            assert batch, "a step with nothing scheduled would never advance the clock"
            if self.trace is not None:
                self.trace.append([(seq.req.id, n) for seq, n in batch])
            dt = self.cost.step_time(shape)
            end = self.now + dt
            busy += dt
            steps += 1
            tok_sum += shape.num_tokens
            seq_sum += shape.num_seqs
            arrive_until(end)              # arrivals during the step join the queue at its end
            area += in_system * (end - last_t)
            last_t = end
            for seq, n in batch:
                if seq.drafts:             # a verification round: the accepted drafts plus one token
                    seq.credit += 1 + seq.drafts * cfg.spec_acceptance
                    emit = min(int(seq.credit), seq.req.output_len - seq.generated)
                    seq.credit -= emit
                    seq.computed += emit
                    seq.generated += emit - 1      # the last one below
                else:
                    seq.computed += n
                if seq.computed == seq.req.prompt_len + seq.generated:
                    seq.generated += 1
                    if seq.first_token is None:
                        seq.first_token = end
                    if seq.generated >= seq.req.output_len:
                        seq.finish = end
                        self.running.remove(seq)
                        self._free(seq)
                        done.append(seq)
                        in_system -= 1
            self.now = end
        assert self.free_blocks == cfg.num_kv_blocks, "blocks leaked: every request finished"
        results = [RequestResult(
            id=s.req.id, arrival=s.req.arrival, prompt_len=s.req.prompt_len, output_len=s.req.output_len,
            offline=s.req.offline, queue_s=s.first_sched - s.req.arrival, ttft_s=s.first_token - s.req.arrival,
            tpot_s=(s.finish - s.first_token) / (s.req.output_len - 1) if s.req.output_len > 1 else None,
            e2e_s=s.finish - s.req.arrival, preemptions=s.preemptions) for s in sorted(done, key=lambda s: s.req.id)]
        return SimResult(requests=results, end_s=self.now, last_arrival_s=last_arrival, busy_s=busy,
                         num_steps=steps, num_preemptions=self.num_preemptions, area_in_system=area,
                         tokens_per_step=tok_sum / max(steps, 1), seqs_per_step=seq_sum / max(steps, 1))


def simulate(cost: StepCost, requests: list[Request], config: SchedulerConfig = SchedulerConfig()) -> SimResult:
    return Simulator(cost, config).run(requests)
