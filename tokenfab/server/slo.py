"""Latency targets for the interactive class: predict a new request's TTFT, shed it early when the
target cannot be met, and report predicted and achieved latency and goodput per service class.

    tokenfab serve --slo-ttft-ms 2000 --slo-tpot-ms 200

- Everything it knows of the engine comes from the EngineClient's `load()` (engine/client.py), a
  LoadSnapshot the engine builds on its own thread at the end of each step:
  - the step cost (`MeasuredStepCost`, costmodel/), fitted online to this server's own steps
    (costmodel/online.py: refitted every REFIT_EVERY steps over the last WINDOW); the scheduler's
    step-time budget reads the same model. Until MIN_ROWS steps have run nothing is shed;
  - the queue (`QueueSnapshot`): interactive prefill tokens still to run, running decodes and their
    mean context, and the batch prefill chunk a step carries (capped by its lane, engine/lanes.py).
  Requests admitted since that snapshot are added on the event loop.
- A new interactive request's TTFT is the time of the steps that clear the interactive prefill
  ahead of it and its own prompt, each step also carrying the running interactive decodes. Batch work
  rides in those steps only as far as the scheduler's step-time budget lets it (engine/step_budget.py:
  none, in a step where an interactive prompt waits or prefills); without the budget, each step carries
  every running decode and a full batch prefill chunk.
  Its own prompt counts without the leading full blocks the prefix cache already holds (asked of
  the engine client at admission), and it cannot start before a sequence slot is free: with
  `max_num_seqs` interactive sequences running or queued ahead, it waits the decode steps until
  enough running ones reach their max_tokens (a bound: one that stops early frees its slot sooner).
  Batch sequences hold no slot against it (they are preempted for interactive work).
  Over `--slo-ttft-ms` (or, with `--slo-tpot-ms`, when one more decode would make the step slower
  than the target), it gets 429 `slo_unattainable` with `Retry-After`, at once: never a silent
  multi-second queue. Batch-class requests are never shed; they wait.
"""
from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tokenfab.costmodel.shape import StepShape
from tokenfab.engine.client import LoadSnapshot, QueueSnapshot
from tokenfab.engine.lanes import INTERACTIVE, SERVICE_CLASSES
from tokenfab.server.errors import APIError

__all__ = ["LoadSnapshot", "QueueSnapshot", "SloAdmission", "Listeners", "predict_ttft", "predict_tpot"]

LATENCY_WINDOW = 1000          # requests per class behind the P99 gauges
MAX_SIMULATED_STEPS = 4096


def predict_ttft(cost, snap: QueueSnapshot, prompt_tokens: int, budget: int, cached_tokens: int = 0,
                 step_budget=None) -> float:
    """Seconds until a prompt queued behind `snap.interactive_prefill` tokens gets its first token.
    `cached_tokens` of the prompt are a prefix-cache hit and cost nothing; the prompt's own prefill
    starts once a sequence slot is free (`slot_wait_steps`), meanwhile the steps carry the decodes
    and whatever prefill is ahead of it. With the scheduler's `step_budget` (engine/step_budget.py),
    batch work takes no time in these steps: each is TTFT-critical (the new prompt waits or prefills),
    and fill then only rides where it is free. Without it, every running decode and a full batch
    prefill chunk ride in every step."""
    own = max(1, prompt_tokens - cached_tokens) if prompt_tokens else 0
    work = snap.interactive_prefill + own
    decodes = snap.decodes - snap.batch_decodes if step_budget is not None else snap.decodes
    batch_chunk = 0 if step_budget is not None else snap.batch_chunk
    room = max(1, budget - decodes - batch_chunk)
    wait = snap.slot_wait_steps()
    total, steps = 0.0, 0
    while work > 0 and steps < MAX_SIMULATED_STEPS:
        startable = work if steps >= wait else work - own     # no slot yet: only the queue ahead runs
        chunk = min(startable, room)
        shape = StepShape()
        if decodes:
            shape.add(int(snap.mean_context), 1, decodes)
        if batch_chunk:
            shape.add(0, batch_chunk)
        if chunk:
            shape.add(0, chunk)
        total += cost.step_time(shape)
        work -= chunk
        steps += 1
    if work > 0:                       # a very deep queue: the rest at the last step's rate
        total += total / steps * (max(0, wait - steps) + math.ceil(work / room))
    return total


def predict_tpot(cost, snap: QueueSnapshot, step_budget=None) -> float:
    """A decode step's time with one more running sequence. Without a step budget, every running decode
    and the batch chunk are in it; with one, the interactive decodes are, and batch work (its decodes
    and chunk) only as far as the budget lets it in (StepBudget.bounded_time)."""
    if step_budget is None:
        shape = StepShape()
        shape.add(int(snap.mean_context), 1, snap.decodes + 1)
        if snap.batch_chunk:
            shape.add(0, snap.batch_chunk)
        return cost.step_time(shape)
    firm, fill = StepShape(), StepShape()
    firm.add(int(snap.mean_context), 1, snap.decodes - snap.batch_decodes + 1)
    if snap.batch_decodes:
        fill.add(int(snap.mean_context), 1, snap.batch_decodes)
    if snap.batch_chunk:
        fill.add(0, snap.batch_chunk)
    return step_budget.bounded_time(cost, firm, fill)


class SloAdmission:
    """Admission by predicted latency, and the per-class SLO metrics (an EngineClient listener).
    `load`: the engine's latest LoadSnapshot (EngineClient.load); `budget`: a step's token budget."""

    def __init__(self, load: Callable[[], LoadSnapshot], budget: int, ttft_s: float | None,
                 tpot_s: float | None) -> None:
        self.load, self.budget, self.ttft_s, self.tpot_s = load, budget, ttft_s, tpot_s
        self._admitted: deque[tuple[float, int]] = deque()     # interactive (time, prompt tokens) not yet in a snapshot
        self.classes: dict[str, str] = {}                       # engine request id -> service class
        self.predicted = {c: deque(maxlen=LATENCY_WINDOW) for c in SERVICE_CLASSES}
        self.achieved = {c: deque(maxlen=LATENCY_WINDOW) for c in SERVICE_CLASSES}
        self.finished = dict.fromkeys(SERVICE_CLASSES, 0)
        self.good = dict.fromkeys(SERVICE_CLASSES, 0)
        self.shed = 0
        self._first: dict[str, float] = {}

    def _snapshot(self, snap: QueueSnapshot) -> QueueSnapshot:
        while self._admitted and self._admitted[0][0] <= snap.time:
            self._admitted.popleft()
        extra = sum(n for _, n in self._admitted)
        return replace(snap, interactive_prefill=snap.interactive_prefill + extra,
                       interactive_seqs=snap.interactive_seqs + len(self._admitted))

    def admit(self, prompt_tokens: int, service_class: str, cached_tokens: int = 0) -> None:
        """Raise a 429 when an interactive request's target cannot be met; record the prediction.
        `cached_tokens`: of the prompt tokens, those a prefix-cache hit will skip (EngineClient.cached_prompt_tokens)."""
        load = self.load()
        cost, step_budget = load.cost, load.step_budget
        if cost is None:
            return                                              # not calibrated yet: admit
        snap = self._snapshot(load.queue)
        ttft = predict_ttft(cost, snap, prompt_tokens, self.budget, cached_tokens, step_budget)
        self.predicted[service_class].append(ttft)
        if service_class == INTERACTIVE:
            why = None
            if self.ttft_s is not None and ttft > self.ttft_s:
                why = (f"predicted time to first token {ttft * 1e3:.0f} ms exceeds the target of "
                       f"{self.ttft_s * 1e3:.0f} ms", ttft - self.ttft_s)
            elif self.tpot_s is not None and (tpot := predict_tpot(cost, snap, step_budget)) > self.tpot_s:
                why = (f"predicted time per output token {tpot * 1e3:.0f} ms exceeds the target of "
                       f"{self.tpot_s * 1e3:.0f} ms", tpot * snap.decodes)
            if why is not None:
                self.shed += 1
                retry = max(1, math.ceil(why[1]))
                raise APIError(429, f"{why[0]} with the current load; retry in {retry} s, or send it with "
                                    "service_tier \"flex\" to queue it instead", code="slo_unattainable",
                               headers={"Retry-After": str(retry)})
        if service_class == INTERACTIVE:
            self._admitted.append((time.monotonic(), max(0, prompt_tokens - cached_tokens)))

    def track(self, request_ids: list[str], service_class: str) -> None:
        for rid in request_ids:
            self.classes[rid] = service_class

    # -- EngineListener (event loop) ------------------------------------------------------------
    def on_first_token(self, output) -> None:
        m, cls = output.metrics, self.classes.get(output.request_id)
        if cls is None or m is None or m.first_token_time is None:
            return
        self._first[output.request_id] = m.first_token_time - m.arrival_time
        self.achieved[cls].append(m.first_token_time - m.arrival_time)

    def on_itl(self, gap_s: float, count: int) -> None:
        pass

    def on_finished(self, reason: str, output) -> None:
        rid = output.request_id if output is not None else None
        cls = self.classes.pop(rid, None)
        ttft = self._first.pop(rid, None)
        if cls is None or reason not in ("stop", "length"):
            return
        self.finished[cls] += 1
        m = output.metrics
        tokens = max(len(o.token_ids) for o in output.outputs) if output.outputs else 0
        tpot = ((m.finished_time - m.first_token_time) / (tokens - 1)
                if m and m.finished_time and m.first_token_time and tokens > 1 else 0.0)
        if ttft is not None and (self.ttft_s is None or ttft <= self.ttft_s) and \
                (self.tpot_s is None or tpot <= self.tpot_s):
            self.good[cls] += 1

    # -- /metrics (a collector on the server's registry) ----------------------------------------
    def collect(self):
        p99 = GaugeMetricFamily("tokenfab:slo_ttft_p99_seconds", "P99 time to first token over the last "
                                f"{LATENCY_WINDOW} requests per class: predicted at admission, and achieved.",
                                labels=["service_class", "kind"])
        for cls in SERVICE_CLASSES:
            for kind, values in (("predicted", self.predicted[cls]), ("achieved", self.achieved[cls])):
                if values:
                    p99.add_metric([cls, kind], _p99(values))
        yield p99
        fin = CounterMetricFamily("tokenfab:slo_requests_finished", "Finished requests per class.",
                                  labels=["service_class"])
        good = CounterMetricFamily("tokenfab:slo_requests_good", "Finished requests within the TTFT and TPOT "
                                   "targets per class (goodput's numerator).", labels=["service_class"])
        for cls in SERVICE_CLASSES:
            fin.add_metric([cls], self.finished[cls])
            good.add_metric([cls], self.good[cls])
        yield fin
        yield good
        shed = CounterMetricFamily("tokenfab:slo_requests_shed", "Interactive requests refused with 429 "
                                   "slo_unattainable.", labels=[])
        shed.add_metric([], self.shed)
        yield shed


class Listeners:
    """Several EngineClient listeners as one."""

    def __init__(self, *listeners) -> None:
        self.listeners = listeners

    def on_first_token(self, output) -> None:
        for x in self.listeners:
            x.on_first_token(output)

    def on_itl(self, gap_s: float, count: int) -> None:
        for x in self.listeners:
            x.on_itl(gap_s, count)

    def on_finished(self, reason: str, output) -> None:
        for x in self.listeners:
            x.on_finished(reason, output)


def _p99(values) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, math.ceil(0.99 * len(v)) - 1)]
