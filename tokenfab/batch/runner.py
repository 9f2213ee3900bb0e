"""Run a batch's lines through the server's routes with bounded concurrency, committing each result.

The routes come in as a `RouteCall` (server/batch_dispatch.py builds it), so this part never imports the
server that hosts it.

`run_lines` is shared by the server's Batch API (service.py) and the offline runner (offline.py). A
line's result is committed the moment it finishes; lines that already have one are skipped, which is
how a restarted batch resumes. A 429 (the engine's queue is full) is retried after a pause: it says
"not now", not "this line is wrong"; so is a 503 `replica_lost` (the Ray replica running it died). A 503 (the engine died or the server is draining) stops the run
without recording anything, so the line runs again after a restart.

A commit that finds the data dir's disk full (store.DiskFull) is retried every `disk_retry_s` seconds
until space returns, when one is given (the server: a batch waits out a full disk and carries on); each
worker holds its one finished result meanwhile and takes no new line. Without it, DiskFull propagates
(the offline runner: the CLI says the disk is full).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol

from tokenfab.batch.lines import BatchLine, result_line
from tokenfab.batch.store import DiskFull

log = logging.getLogger("tokenfab.batch")
RETRY_AFTER_S = 0.5
DISK_RETRY_S = 1.0


class EngineUnavailable(RuntimeError):
    """The engine cannot take work (dead or shutting down); the batch resumes after a restart."""


# POST a line's body to its url, in process: (status code, request id, response body).
RouteCall = Callable[[str, dict], Awaitable[tuple[int, str | None, dict]]]


class ResultSink(Protocol):
    def done_lines(self) -> set[int]: ...
    def add(self, line: int, record: dict, is_error: bool) -> None: ...


async def until_space(fn: Callable, *args, retry_s: float | None, what: str, **kwargs):
    """`fn(*args, **kwargs)` in a thread; while it raises DiskFull, again every `retry_s` seconds (None: raise)."""
    warned = False
    while True:
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except DiskFull as e:
            if retry_s is None:
                raise
            if not warned:
                log.warning("%s waits for disk space: %s", what, e)
                warned = True
            await asyncio.sleep(retry_s)


async def run_lines(call: RouteCall, lines: Iterable[BatchLine], sink: ResultSink, slots: asyncio.Semaphore, concurrency: int,
                    on_result: Callable[[int, bool], None] | None = None, disk_retry_s: float | None = None) -> None:
    """Run every line without a committed result; `slots` bounds how many are in the engine at once
    (one semaphore can be shared by several batches). Cancelling the caller aborts the lines in flight."""
    done = sink.done_lines()
    todo = iter([ln for ln in lines if ln.line not in done])
    workers = [asyncio.ensure_future(_worker(call, todo, sink, slots, on_result, disk_retry_s))
               for _ in range(max(1, concurrency))]
    try:
        await asyncio.gather(*workers)
    finally:
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)


async def _worker(call: RouteCall, todo, sink: ResultSink, slots: asyncio.Semaphore, on_result,
                  disk_retry_s: float | None) -> None:
    for ln in todo:
        async with slots:
            status, rid, body = await _run_one(call, ln)
        record = result_line(ln.custom_id, status, rid, body)
        ok = 200 <= status < 300
        # The commit fsyncs (synchronous=FULL): off the event loop, where it would stall every stream.
        await until_space(sink.add, ln.line, record, not ok, retry_s=disk_retry_s, what=f"line {ln.line}'s result")
        if on_result:
            on_result(ln.line, ok)


async def _run_one(call: RouteCall, ln: BatchLine) -> tuple[int, str | None, dict]:
    while True:
        status, rid, body = await call(ln.url, ln.body)
        if status == 429 or (status == 503 and _code(body) == "replica_lost"):
            await asyncio.sleep(RETRY_AFTER_S)      # not now / the replica under it died: the line is fine
            continue
        if status == 503:
            raise EngineUnavailable(body.get("error", {}).get("message", "the engine is unavailable"))
        return status, rid, body


def _code(body: dict) -> str | None:
    err = body.get("error") if isinstance(body, dict) else None
    return err.get("code") if isinstance(err, dict) else None
