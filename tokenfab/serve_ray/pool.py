"""The ingress's engine: the server's FastAPI app (server/app.py, unchanged) runs on this object in
place of a local AsyncEngine. It is an EngineClient (engine/client.py) whose engine is the replica pools.

- `add_request` picks the pool by prompt length, calls the pool's streaming DeploymentHandle (whose
  router, router.py, picks the replica), and returns once a replica has accepted the request, with
  the same RequestStream and listener calls (metrics) as a local engine.
- A replica that dies (killed process, crashed engine loop) before the request's first text is
  *retried* on another replica: the routes send a chunk only once there is text, so nothing had
  reached the client, and outputs are cumulative, so the retry is invisible. After that it is not retried: the stream ends with ReplicaLost,
  which the routes turn into an error event (streaming) or a 503 with Retry-After (non-streaming). Never a hang.
- `stats()` sums the replicas' last reported stats; `replica_stats()` keeps them apart (/metrics'
  `replica` label); `pools()` says how many replicas each pool has (/health: degraded when one is empty).
- The model's info and tokenizer come from a replica's `describe()`: prompts are tokenized and
  grammars compiled here, so bad input is a 400 before anything is routed.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from tokenfab.engine.client import (EngineDeadError, EngineStats, LoadSnapshot, ModelInfo, QueueFullError,
                                    ReplicaLost, RequestFailed, tokenize_prompt)
from tokenfab.engine.streams import RequestStream, StreamClient
from tokenfab.sampling import SamplingParams
from tokenfab.serve_ray import routing
from tokenfab.serve_ray.replica import ACCEPTED
from tokenfab.structured_output import StructuredOutputParams

log = logging.getLogger("tokenfab.serve_ray")

_STAT_FIELDS = [f.name for f in dataclasses.fields(EngineStats)]


def sum_stats(per_replica: list[dict]) -> EngineStats:
    """The pools' engines as one: counts and counters add up, KV usage is the mean."""
    total = {}
    for name in _STAT_FIELDS:
        vals = [s.get(name) for s in per_replica if s.get(name) is not None]
        if name == "kv_cache_usage":
            total[name] = sum(vals) / len(vals) if vals else 0.0
        elif name == "spec_decode_num_accepted_tokens_per_pos":
            width = max((len(v) for v in vals), default=0)
            total[name] = tuple(sum(v[i] for v in vals if i < len(v)) for i in range(width))
        else:
            total[name] = sum(vals) if vals else 0
    return EngineStats(**total)


def _is_replica_failure(e: BaseException) -> bool:
    """The replica itself failed (died, unreachable, engine loop dead), as opposed to this request."""
    import ray.exceptions as rex
    return isinstance(e, (rex.RayActorError, rex.ActorUnavailableError, EngineDeadError))


class ReplicaPoolEngine(StreamClient):
    """The EngineClient (engine/client.py) of the ingress: requests go to the replica pools."""

    def __init__(self, handles: dict, desc: dict, long_threshold: int | None = None,
                 accept_timeout_s: float = 120.0) -> None:
        """handles: pool name -> DeploymentHandle of EngineReplica (routing.SHORT_POOL, optionally LONG_POOL).
        desc: a replica's `describe()` (its ModelInfo and tokenizer).
        accept_timeout_s: how long a request may wait for a pool with no running replica before a 503, and
        how long a request whose replicas keep failing before its first token is retried."""
        super().__init__()
        self.handles = handles
        self.info: ModelInfo = desc["info"]
        self.tokenizer = desc["tokenizer"]
        self.long_threshold = long_threshold
        self.accept_timeout_s = accept_timeout_s
        self.max_waiting_requests: int | None = None     # each replica sheds its own load
        self.dead_reason: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: dict[str, asyncio.Task] = {}
        self._started = False
        self._grammars = None
        self.retries = 0                      # requests re-sent after their replica failed (/metrics)

    # -- what the replicas report (from the routers, router.py) ---------------------------------------
    def replica_stats(self) -> dict[str, dict[str, dict]]:
        """pool -> replica id -> its last reported stats (replicas that have not reported yet: {})."""
        out: dict[str, dict[str, dict]] = {}
        for pool in self.handles:
            merged: dict[str, dict] = {}
            for r in routing.routers(pool):
                merged.update(r.replica_stats())
            out[pool] = merged
        return out

    def pools(self) -> dict[str, int]:
        """Running replicas per pool."""
        return {pool: len(reps) for pool, reps in self.replica_stats().items()}

    def degraded(self) -> str | None:
        empty = [p for p, n in self.pools().items() if n == 0]
        return f"no running replica in pool(s) {', '.join(empty)}" if empty else None

    def stats(self) -> EngineStats:
        return sum_stats([s for reps in self.replica_stats().values() for s in reps.values()])

    def load(self) -> LoadSnapshot:
        """Nothing to predict from here: each replica queues its own requests (SLO admission needs one
        engine, `tokenfab serve` says so)."""
        return LoadSnapshot()

    def cached_prompt_tokens(self, prompts: list[list[int]], n: int = 1) -> int:
        return 0                              # the prefix caches live in the replicas

    def num_waiting(self) -> int:
        return self.stats().num_waiting

    # -- input: checked here, before anything is routed -------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return tokenize_prompt(self.tokenizer, self.info.vocab_size, prompt)

    def compile_structured(self, spec: StructuredOutputParams) -> None:
        """Grammars are compiled here too, so a bad schema gets its 400 before anything is routed."""
        if self._grammars is None:
            from tokenfab.engine.structured import GrammarCompiler
            self._grammars = GrammarCompiler(self.tokenizer, self.info.vocab_size, list(self.info.eos_token_ids))
        self._grammars.compile(spec)

    # -- life cycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._started = True

    async def stop(self, timeout: float = 10.0) -> None:
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        self._started = False
        self._fail_all(EngineDeadError("the server is shutting down"))

    @property
    def is_alive(self) -> bool:
        return self._started and self.dead_reason is None

    # -- requests -------------------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          priority: int = 0, arrival_time: float | None = None,
                          service_class: str = "interactive") -> RequestStream:
        if not self._started:
            raise EngineDeadError("the replica pools are not running")
        ids = self.tokenize(prompt)
        pool = routing.choose_pool(len(ids), self.long_threshold, set(self.handles))
        stream = self._open(request_id)
        accepted = self._loop.create_future()
        task = self._loop.create_task(self._pump(stream, pool, ids, params, priority, arrival_time or time.time(),
                                                 service_class, accepted))
        self._tasks[request_id] = task
        task.add_done_callback(lambda t, rid=request_id: self._tasks.pop(rid, None) if self._tasks.get(rid) is t
                               else None)
        try:
            stream.prompt_token_ids = await asyncio.wait_for(asyncio.shield(accepted), self.accept_timeout_s)
        except BaseException as e:
            self._streams.pop(request_id, None)
            stream.finished = True
            task.cancel()
            if isinstance(e, asyncio.TimeoutError):
                raise EngineDeadError(f"no replica of the {pool!r} pool accepted the request within "
                                      f"{self.accept_timeout_s:g} s (is the pool empty? see /health)") from None
            raise
        return stream

    def _cancel(self, request_id: str) -> None:
        task = self._tasks.pop(request_id, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()                     # cancels the replica call: its generator aborts the request

    # -- one request's life on the replicas -----------------------------------------------------------
    async def _pump(self, stream: RequestStream, pool: str, ids: list[int], params: SamplingParams,
                    priority: int, arrival_time: float, service_class: str, accepted: asyncio.Future) -> None:
        started = False                       # text reached the stream (the routes send nothing before): no retry
        replica = None
        deadline = time.monotonic() + self.accept_timeout_s
        attempt = 0
        while True:
            attempt += 1
            gen = self.handles[pool].options(stream=True).generate.remote(
                request_id=stream.request_id, prompt_ids=ids, params=params, priority=priority,
                arrival_time=arrival_time, service_class=service_class)
            try:
                async for item in gen:
                    if isinstance(item, tuple) and item and item[0] == ACCEPTED:
                        replica = item[2]
                        if not accepted.done():
                            accepted.set_result(item[1])
                        continue
                    started = started or any(o.text for o in item.outputs)
                    self._deliver([item], time.monotonic())
                    if item.finished:
                        return
                error: BaseException = RequestFailed(f"replica {replica} ended the stream without a final output")
                break
            except asyncio.CancelledError:
                gen.cancel()
                raise
            except Exception as e:
                # Ray drops a dead replica from the router's set within moments, so a retry finds a live one
                # (or waits for Ray's replacement when the pool is empty), until the deadline.
                if _is_replica_failure(e) and not started and time.monotonic() < deadline:
                    log.warning("request %s: replica %s failed before its first text (%s); retrying on "
                                "another replica (attempt %d)", stream.request_id, replica or "(not yet accepted)",
                                type(e).__name__, attempt + 1)
                    self.retries += 1
                    replica = None
                    await asyncio.sleep(min(1.0, 0.1 * attempt))
                    continue
                error = _as_engine_error(e, replica, started)
                break
        if not accepted.done():
            accepted.set_exception(error)
            accepted.exception()              # retrieved here too: add_request may have gone
        elif stream.request_id in self._streams:
            self._fail(stream, error, abort=False)


def _as_engine_error(e: BaseException, replica: str | None, started: bool) -> BaseException:
    """The replica's exception as the server knows them: ValueError (400), QueueFullError (429),
    EngineDeadError (503), ReplicaLost (503), RequestFailed (500)."""
    for cls in (ValueError, QueueFullError, RequestFailed):
        if isinstance(e, cls):
            cause = getattr(e, "cause", None)
            return cls(str(cause if cause is not None else e))
    if _is_replica_failure(e):
        where = f"replica {replica}" if replica else "the replica"
        if started:
            return ReplicaLost(f"{where} failed while streaming this request ({type(e).__name__}); "
                                 "the output so far is incomplete, retry the request")
        return EngineDeadError(f"{where} failed before starting this request, and retrying found no live "
                               f"replica in time ({type(e).__name__}); see /health")
    return RequestFailed(f"the replica failed on this request ({type(e).__name__}: {e})")
