"""AsyncEngine: an LLMEngine driven by one background thread, with one output stream per request.

LLMEngine is not thread-safe and a step is model compute (milliseconds to seconds), so a worker
thread owns the engine: it alone calls `add_request`, `abort_request` and `step`. The event loop
talks to it through a thread-safe inbox of commands, and outputs come back with
`loop.call_soon_threadsafe`, so the HTTP loop never waits on compute (torch releases the GIL in
its kernels). The worker takes commands between steps, so a new request joins the next step.

    stream = await engine.add_request(rid, prompt_ids, params)   # ValueError: bad input, nothing queued
    async for out in stream:                                     # cumulative RequestOutputs
        ...
    stream.abort()                                               # the client left: free its blocks now

Failures:
- An output whose finish_reason is "error" ends that request with RequestFailed.
- A step that raises ends the requests it had scheduled (they are aborted, blocks freed); waiting
  requests run on. After `max_consecutive_failures` failing steps in a row, or any failure outside
  a step, the engine is dead: every stream fails with EngineDeadError and `dead_reason` is set
  (the server's /health then answers 503).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from tokenfab import kernels
from tokenfab.outputs import RequestOutput
from tokenfab.sampling import SamplingParams

log = logging.getLogger("tokenfab.engine")


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


class QueueFullError(RuntimeError):
    """Too many requests are waiting; the caller should shed this one (HTTP 429)."""


class RequestFailed(RuntimeError):
    """This request failed inside the engine; other requests are unaffected."""


class EngineListener(Protocol):
    """Receives timings for metrics, on the event loop."""
    def on_first_token(self, output: RequestOutput) -> None: ...
    def on_itl(self, gap_s: float, count: int) -> None: ...
    def on_finished(self, reason: str, output: RequestOutput | None) -> None: ...


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


class RequestStream:
    """One request's outputs, consumed on the event loop. Outputs are cumulative, so an unread output
    is replaced by the next one: a slow reader skips to the newest, and memory stays one output deep."""

    def __init__(self, request_id: str, owner: "AsyncEngine") -> None:
        self.request_id = request_id
        self.prompt_token_ids: list[int] = []
        self.finished = False
        self.last: RequestOutput | None = None
        self._owner = owner
        self._items: deque[RequestOutput | BaseException] = deque()
        self._ready = asyncio.Event()
        self._num_tokens = 0                    # generated so far over all n samples (for ITL)
        self._last_token_time: float | None = None

    def _put(self, item: RequestOutput | BaseException) -> None:
        last = self._items[-1] if self._items else None
        if isinstance(item, RequestOutput) and isinstance(last, RequestOutput) and not last.finished:
            self._items[-1] = item           # cumulative: the newer output supersedes the unread one
        else:
            self._items.append(item)
        self._ready.set()

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished and not self._items:
            raise StopAsyncIteration
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.last = item
        if item.finished:
            self.finished = True
        return item

    async def result(self) -> RequestOutput:
        """Wait for the final output."""
        async for _ in self:
            pass
        assert self.last is not None
        return self.last

    def abort(self) -> None:
        """Stop the request now (its KV blocks are freed at the engine's next turn). Idempotent."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)


class AsyncEngine:
    def __init__(self, engine, *, max_waiting_requests: int | None = None, max_consecutive_failures: int = 3,
                 listener: EngineListener | None = None) -> None:
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.max_consecutive_failures = max_consecutive_failures
        self.listener = listener
        self.dead_reason: str | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}     # touched only on the event loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stats = engine.stats()
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

    def stats(self):
        """EngineStats as of the worker's last turn (a snapshot; never blocks on a step)."""
        return self._stats

    @property
    def num_requests(self) -> int:
        """Requests accepted and not finished (each counts once whatever its n)."""
        return len(self._streams)

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
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = RequestStream(request_id, self)
        self._streams[request_id] = stream
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

    def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        stream.finished = True
        self._inbox.put(_Abort(request_id))
        if self.listener:
            self.listener.on_finished("abort", stream.last)

    # -- outputs (event loop side, called from the worker via call_soon_threadsafe) -----------
    def _deliver(self, outputs: list[RequestOutput], now: float) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue                     # aborted while this step ran
            try:
                self._deliver_one(stream, out, now)
            except Exception as e:            # a bug on one request's path must not stop the others
                log.exception("request %s: failed while handling its output", out.request_id)
                self._fail(stream, RequestFailed(f"internal error while handling this request: {e}"), abort=True)

    def _deliver_one(self, stream: RequestStream, out: RequestOutput, now: float) -> None:
        num_tokens = sum(len(o.token_ids) for o in out.outputs)
        new = num_tokens - stream._num_tokens
        if new > 0 and self.listener:
            if stream._last_token_time is None:
                self.listener.on_first_token(out)
            else:
                self.listener.on_itl(now - stream._last_token_time, new)
        if new > 0:
            stream._num_tokens, stream._last_token_time = num_tokens, now
        failed = [o for o in out.outputs if o.finish_reason == "error"]
        if failed or out.error:
            self._fail(stream, RequestFailed(out.error or "the engine failed on this request"), abort=not out.finished)
            return
        stream._put(out)
        if out.finished:
            self._streams.pop(stream.request_id, None)
            if self.listener:
                self.listener.on_finished(out.outputs[0].finish_reason or "stop", out)

    def _fail(self, stream: RequestStream, error: BaseException, abort: bool) -> None:
        self._streams.pop(stream.request_id, None)
        if abort:
            self._inbox.put(_Abort(stream.request_id))
        stream._put(error)
        if self.listener:
            self.listener.on_finished("error", stream.last)

    def _fail_all(self, error: BaseException) -> None:
        for stream in list(self._streams.values()):
            self._streams.pop(stream.request_id, None)
            stream._put(error)
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
