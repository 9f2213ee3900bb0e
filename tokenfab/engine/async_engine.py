"""AsyncEngine: an LLMEngine driven by one background thread, with one output stream per request; the
EngineClient (engine/client.py) of a server in this process.

LLMEngine is not thread-safe and a step is model compute (milliseconds to seconds), so a worker
thread owns the engine: it alone calls `add_request`, `abort_request` and `step`. The event loop
talks to it through a thread-safe inbox of commands, and outputs come back with
`loop.call_soon_threadsafe`, so the HTTP loop never waits on compute (torch releases the GIL in
its kernels). The worker takes commands between steps, so a new request joins the next step.
What the front end reads of the engine is built here, on the worker thread, as plain data: `stats()`
after every turn, `load()` (the queue and the step-cost model, for SLO admission) after every step
once asked for, `info` once at the start.

Failures:
- An output whose finish_reason is "error" ends that request with RequestFailed.
- A step that raises ends the requests it had scheduled (they are aborted, blocks freed); waiting
  requests run on. After `max_consecutive_failures` failing steps in a row, or any failure outside
  a step, the engine is dead: every stream fails with EngineDeadError and `dead_reason` is set
  (the server's /health then answers 503).
"""
from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, replace

from tokenfab import kernels
from tokenfab.engine.client import (EngineDeadError, EngineListener, LoadSnapshot, ModelInfo, QueueFullError,
                                    QueueSnapshot, RequestFailed, SLOT_HORIZON)
from tokenfab.engine.lanes import BATCH, batch_prefill_cap
from tokenfab.engine.streams import RequestStream, StreamClient
from tokenfab.sampling import SamplingParams
from tokenfab.structured_output import StructuredOutputParams

log = logging.getLogger("tokenfab.engine")


__all__ = ["AsyncEngine", "EngineDeadError", "QueueFullError", "RequestFailed", "RequestStream", "EngineListener"]


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    arrival_time: float | None
    future: asyncio.Future
    service_class: str = "interactive"


@dataclass(slots=True)
class _Abort:
    request_id: str


class _Stop:
    pass


class AsyncEngine(StreamClient):
    def __init__(self, engine, *, max_waiting_requests: int | None = None, max_consecutive_failures: int = 3,
                 listener: EngineListener | None = None) -> None:
        super().__init__(listener)
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.max_consecutive_failures = max_consecutive_failures
        self.dead_reason: str | None = None
        self.info = model_info(engine)
        self.tokenizer = engine.tokenizer
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stats = engine.stats()
        self._load = LoadSnapshot()
        self._load_wanted = False
        # Each counter is written by one thread only, so their difference is safe to read anywhere.
        self._adds_submitted = 0
        self._adds_processed = 0

    # -- life cycle (event loop side) ---------------------------------------------------------
    def start(self) -> None:
        """Start the worker thread; call from the event loop that will consume the streams."""
        assert self._thread is None, "AsyncEngine.start() called twice"
        self._loop = asyncio.get_running_loop()
        kernels.release_thread_pool()      # the model's loader thread hands its OpenMP pool back: one pool
        self._thread = threading.Thread(target=self._run, name="tokenfab-engine", daemon=True)
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread is not None

    async def stop(self, timeout: float = 10.0) -> None:
        """Abort what is left, stop the worker and fail any stream still open."""
        if self._thread is not None and self._thread.is_alive():
            self._inbox.put(_Stop())
            await asyncio.to_thread(self._thread.join, timeout)
        self._fail_all(EngineDeadError("the server is shutting down"))
        close = getattr(self.engine, "close", None)      # tensor-parallel workers (engine.close)
        if close is not None:
            close()

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None and self._thread is not None and self._thread.is_alive()

    def degraded(self) -> str | None:
        return None

    # -- input (event loop side; read-only on the engine) -------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.engine.tokenize(prompt)

    def compile_structured(self, spec: StructuredOutputParams) -> None:
        self.engine.structured.compile(spec)

    # -- what the engine reports --------------------------------------------------------------
    def stats(self):
        """EngineStats as of the worker's last turn (a snapshot; never blocks on a step)."""
        return self._stats

    def load(self) -> LoadSnapshot:
        self._load_wanted = True
        return self._load

    def cached_prompt_tokens(self, prompts: list[list[int]], n: int = 1) -> int:
        # A lock-free read of the prefix cache's index while the worker steps (BlockManager.cached_blocks
        # is read-only): a block evicted meanwhile only makes the estimate stale.
        return cached_prompt_tokens(self.engine.block_manager, prompts, n)

    def num_waiting(self) -> int:
        """Sequences queued in the engine plus requests not yet handed to it."""
        return self._stats.num_waiting + (self._adds_submitted - self._adds_processed)

    # -- requests (event loop side) -----------------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          priority: int = 0, arrival_time: float | None = None,
                          service_class: str = "interactive") -> RequestStream:
        """Queue a request and return its stream once the engine has accepted it.

        Raises EngineDeadError, QueueFullError, or ValueError (bad input; nothing was queued).
        """
        if self.dead_reason is not None or self._thread is None:
            raise EngineDeadError(f"the engine is not running ({self.dead_reason or 'not started'})")
        if self.max_waiting_requests is not None and self.num_waiting() >= self.max_waiting_requests:
            raise QueueFullError(f"{self.num_waiting()} requests are waiting (the limit is "
                                 f"{self.max_waiting_requests}); retry later")
        stream = self._open(request_id)
        future = self._loop.create_future()
        self._adds_submitted += 1
        self._inbox.put(_Add(request_id, prompt, params, priority, arrival_time, future, service_class))
        try:
            stream.prompt_token_ids = await future
        except BaseException as e:
            self._streams.pop(request_id, None)
            stream.finished = True
            if isinstance(e, asyncio.CancelledError):   # the caller left; the add may still land
                self._inbox.put(_Abort(request_id))
            raise
        return stream

    def _cancel(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def _fail_all(self, error: BaseException) -> None:
        super()._fail_all(error)
        while True:                          # adds the worker will never see
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add) and not cmd.future.done():
                cmd.future.set_exception(error)

    def _on_dead(self) -> None:
        self._fail_all(EngineDeadError(f"the engine stopped: {self.dead_reason}"))

    # -- the worker thread --------------------------------------------------------------------
    def _post(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:                 # the event loop is closed: nobody is listening any more
            pass

    def _run(self) -> None:
        failures = 0
        try:
            while True:
                busy = self.engine.has_unfinished_requests()
                if self._apply(self._take_commands(block=not busy)):
                    return
                self._stats = self.engine.stats()
                if not self.engine.has_unfinished_requests():
                    continue
                try:
                    t0 = time.monotonic()
                    outputs = self.engine.step()
                    failures = 0
                except Exception as e:
                    failures += 1
                    if failures >= self.max_consecutive_failures:
                        raise
                    log.exception("engine step failed; failing the requests it had scheduled")
                    self._fail_step(e)
                    continue
                now = time.monotonic()
                self._stats = self.engine.stats()
                if self._load_wanted:
                    self._load = load_snapshot(self.engine)
                if outputs:
                    self._post(self._deliver, outputs, now)
                elif now - t0 < 1e-3:
                    time.sleep(1e-3)         # nothing was schedulable: don't spin a core at 100%
        except BaseException as e:
            self.dead_reason = f"{type(e).__name__}: {e}"
            log.critical("engine loop died: %s", self.dead_reason, exc_info=True)
            self._post(self._on_dead)

    def _take_commands(self, block: bool) -> list:
        cmds = [self._inbox.get()] if block else []
        while True:
            try:
                cmds.append(self._inbox.get_nowait())
            except queue.Empty:
                return cmds

    def _apply(self, cmds: list) -> bool:
        """Run queued commands in order; True when asked to stop."""
        for cmd in cmds:
            if isinstance(cmd, _Add):
                try:
                    ids = self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params,
                                                  priority=cmd.priority, arrival_time=cmd.arrival_time,
                                                  service_class=cmd.service_class)
                    self._post(_resolve, cmd.future, ids, None)
                except ValueError as e:
                    self._post(_resolve, cmd.future, None, e)
                except Exception as e:
                    log.exception("request %s: add_request failed", cmd.request_id)
                    self._post(_resolve, cmd.future, None, RequestFailed(f"the engine could not accept it: {e}"))
                finally:
                    self._adds_processed += 1
            elif isinstance(cmd, _Abort):
                self.engine.abort_request(cmd.request_id)
            elif isinstance(cmd, _Stop):
                for rid in list(getattr(self.engine, "requests", {})):
                    self.engine.abort_request(rid)
                self._stats = self.engine.stats()
                return True
        return False

    def _fail_step(self, error: Exception) -> None:
        """Abort the requests the failed step had scheduled; the engine's queues stay consistent."""
        scheduler = getattr(self.engine, "scheduler", None)
        blamed = {s.request_id for s in getattr(scheduler, "running", ())}
        if not blamed:                       # it failed before scheduling: nothing narrower to blame
            blamed = set(getattr(self.engine, "requests", {}))
        for rid in blamed:
            self.engine.abort_request(rid)
        self._stats = self.engine.stats()
        msg = f"the engine failed while running this request ({type(error).__name__}: {error})"
        self._post(self._fail_ids, sorted(blamed), msg)

    def _fail_ids(self, request_ids: list[str], message: str) -> None:
        for rid in request_ids:
            stream = self._streams.get(rid)
            if stream is not None:
                self._fail(stream, RequestFailed(message), abort=False)


def _resolve(future: asyncio.Future, value, error: BaseException | None) -> None:
    if future.done():                         # the caller was cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


# -- what the front end reads, built from the engine on its side -------------------------------------
def model_info(engine) -> ModelInfo:
    """The engine's ModelInfo: the model, its limits, and /metrics' config_info labels (what "auto"
    settings became, the KV pool's size, each linear's kernel plan)."""
    cfg = getattr(engine, "config", None)
    labels: dict[str, str] = {}
    if cfg is not None:
        labels = {k: str(getattr(cfg, k, "")) for k in ("max_num_seqs", "max_num_batched_tokens", "block_size",
                                                       "dtype", "kv_cache_dtype", "quantization")}
        kv = getattr(getattr(engine, "runner", None), "kv", None)
        if labels["kv_cache_dtype"] == "auto" and getattr(kv, "dtype", None) is not None:   # what "auto" became (doctor reads it)
            labels["kv_cache_dtype"] = str(kv.dtype).removeprefix("torch.")
        bm = getattr(engine, "block_manager", None)
        if bm is not None:
            labels["num_kv_blocks"] = str(bm.num_blocks)
        labels["max_model_len"] = str(getattr(engine, "max_model_len", ""))
        report = getattr(engine, "kernel_report", None)
        if report is not None and report.ranges:      # what each linear shape runs, and the measurements behind it
            labels["linear_plans"] = json.dumps({k: [report.layers.get(k, 1), v] for k, v in report.ranges.items()},
                                                separators=(",", ":"))
            labels["kernel_table"] = report.table_path or ""
    budget = getattr(cfg, "max_num_batched_tokens", 0)
    return ModelInfo(getattr(engine, "model_path", None), engine.max_model_len, engine.model_config.vocab_size,
                     tuple(getattr(engine, "eos_token_ids", ()) or ()), getattr(cfg, "max_num_seqs", 1),
                     getattr(cfg, "scheduling_policy", "fcfs"), budget,
                     batch_prefill_cap(budget, getattr(cfg, "batch_prefill_share", 1.0)),
                     getattr(cfg, "long_prompt_threshold", None), labels)


def queue_snapshot(scheduler, budget: int) -> QueueSnapshot:
    """The scheduler's queue now, for SLO admission (engine thread)."""
    pending, decodes, batch_decodes, ctx, batch_left, inter, left_steps = 0, 0, 0, 0, 0, 0, []
    running = set(map(id, scheduler.running))
    for s in list(scheduler.running) + list(scheduler.waiting):
        left = s.num_tokens - s.num_computed_tokens
        if s.service_class != BATCH:
            inter += 1
            if id(s) in running:
                left_steps.append(max(1, s.max_tokens - s.num_output_tokens))
        if id(s) in running and left <= 1:
            decodes += 1
            batch_decodes += s.service_class == BATCH
            ctx += s.num_computed_tokens
        elif s.service_class == BATCH:
            batch_left += left
        else:
            pending += left
    cap = batch_prefill_cap(budget, scheduler.batch_prefill_share)
    return QueueSnapshot(time.monotonic(), pending, decodes, batch_decodes, ctx / decodes if decodes else 0.0,
                         batch_left if cap is None else min(batch_left, cap), inter, scheduler.max_num_seqs,
                         tuple(sorted(left_steps)[:SLOT_HORIZON]))


def load_snapshot(engine) -> LoadSnapshot:
    """The queue, the step-cost model and a copy of the step-time budget (engine thread)."""
    scheduler = engine.scheduler
    budget = scheduler.step_budget
    if budget is not None:                 # its arrival history moves on with every step: a copy
        budget = replace(budget, recent_firm=deque(budget.recent_firm, maxlen=budget.recent_firm.maxlen))
    return LoadSnapshot(queue_snapshot(scheduler, scheduler.max_num_batched_tokens), engine.step_cost.cost, budget)


def cached_prompt_tokens(block_manager, prompts: list[list[int]], n: int = 1) -> int:
    """Prompt tokens a prefix-cache hit will skip: each prompt's leading cached full blocks, for each of
    its n sequences (the first of them registers nothing new before the others are admitted)."""
    bs = block_manager.block_size
    return n * sum(len(block_manager.cached_blocks(ids)) * bs for ids in prompts)
