"""BatchService: the server's batch jobs, run as background tasks over a BatchStore.

Status transitions, as OpenAI defines them:
    validating -> in_progress -> finalizing -> completed
    validating -> failed                        (the input file is empty or unreadable)
    validating | in_progress -> cancelling -> cancelled   (POST /v1/batches/{id}/cancel)
On start-up every batch left in validating, in_progress, finalizing or cancelling carries on from
its committed results: only lines without one run again. Finalizing writes the output file (2xx
responses) and the error file (line errors and non-2xx responses), each in input order, and only
when it would not be empty.

A full disk under the data dir pauses a batch instead of failing it: every write it makes waits for
space and is retried (runner.until_space), and the batch carries on where it stood once space returns.
"""
from __future__ import annotations

import asyncio
import logging

from tokenfab.batch.lines import error_line, parse_lines
from tokenfab.batch.runner import DISK_RETRY_S, EngineUnavailable, RouteCall, run_lines, until_space
from tokenfab.batch.store import BatchStore

log = logging.getLogger("tokenfab.batch")


class _StoreSink:
    def __init__(self, store: BatchStore, batch_id: str) -> None:
        self.store, self.batch_id = store, batch_id

    def done_lines(self) -> set[int]:
        return self.store.done_lines(self.batch_id)

    def add(self, line: int, record: dict, is_error: bool) -> None:
        self.store.add_result(self.batch_id, line, record, is_error)


class BatchService:
    def __init__(self, store: BatchStore, call: RouteCall, concurrency: int) -> None:
        self.store, self.call, self.concurrency = store, call, concurrency
        self.slots = asyncio.Semaphore(concurrency)       # shared by all batches: the engine's share for them
        self._tasks: dict[str, asyncio.Task] = {}

    # -- life cycle ------------------------------------------------------------------------------
    def resume(self) -> None:
        for obj in self.store.active_batches():
            log.info("resuming batch %s (%s, %d/%d lines done)", obj["id"], obj["status"],
                     obj["request_counts"]["completed"] + obj["request_counts"]["failed"],
                     obj["request_counts"]["total"])
            self.submit(obj["id"])

    async def stop(self) -> None:
        """Stop running batches without changing their status: they resume at the next start."""
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- requests --------------------------------------------------------------------------------
    def submit(self, batch_id: str) -> None:
        self._tasks[batch_id] = asyncio.ensure_future(self._run(batch_id))
        self._tasks[batch_id].add_done_callback(lambda _: self._tasks.pop(batch_id, None))

    async def cancel(self, batch_id: str) -> dict:
        obj = self.store.get_batch(batch_id)
        if obj["status"] not in ("validating", "in_progress"):
            return obj                     # cancelling, finalizing or finished: nothing to stop
        obj = self.store.update_batch(batch_id, status="cancelling")
        task = self._tasks.get(batch_id)
        if task is not None:
            task.cancel()                  # its handler sees "cancelling" and finalizes as cancelled
        else:
            self.submit(batch_id)
        return obj

    # -- one batch -------------------------------------------------------------------------------
    async def _run(self, batch_id: str) -> None:
        try:
            what = f"batch {batch_id}"
            obj = self.store.get_batch(batch_id)
            if obj["status"] == "validating":
                obj = await until_space(self._validate, obj, retry_s=DISK_RETRY_S, what=what)
            if obj["status"] == "in_progress":
                lines, _ = parse_lines(self.store.file_content(obj["input_file_id"]), obj["endpoint"])
                await run_lines(self.call, lines, _StoreSink(self.store, batch_id), self.slots, self.concurrency,
                                disk_retry_s=DISK_RETRY_S)
                obj = await until_space(self.store.update_batch, batch_id, status="finalizing", retry_s=DISK_RETRY_S, what=what)
            if obj["status"] in ("finalizing", "cancelling"):
                await until_space(self._finalize, obj, retry_s=DISK_RETRY_S, what=what)
        except asyncio.CancelledError:
            if self.store.get_batch(batch_id)["status"] == "cancelling":
                self._finalize(self.store.get_batch(batch_id))
            else:
                raise                      # the server is stopping: the batch resumes at the next start
        except EngineUnavailable as e:
            log.warning("batch %s paused: %s; it resumes when the server restarts", batch_id, e)
        except Exception as e:
            log.exception("batch %s failed", batch_id)
            self.store.update_batch(batch_id, status="failed", errors=_errors("internal_error", str(e)))

    def _validate(self, obj: dict) -> dict:
        try:
            data = self.store.file_content(obj["input_file_id"])
        except Exception as e:
            return self.store.update_batch(obj["id"], status="failed",
                                           errors=_errors("input_file_unreadable", f"the input file cannot be read: {e}"))
        lines, bad = parse_lines(data, obj["endpoint"])
        if not lines and not bad:
            return self.store.update_batch(obj["id"], status="failed",
                                           errors=_errors("empty_file", "the input file has no request lines"))
        for err in bad:
            self.store.add_result(obj["id"], err.line, error_line(err), True)
        counts = {"total": len(lines) + len(bad), "completed": 0, "failed": 0}
        return self.store.update_batch(obj["id"], status="in_progress", request_counts=counts)

    def _finalize(self, obj: dict) -> None:
        out, err = [], []
        for _, is_error, record in self.store.results(obj["id"]):
            (err if is_error else out).append(record)
        stem = obj["id"].removeprefix("batch_")
        fields = {"request_counts": {**obj["request_counts"], **self.store.counts(obj["id"])}}
        if out:
            fields["output_file_id"] = self.store.add_file(f"{obj['id']}_output.jsonl", "batch_output",
                                                           _jsonl(out), f"file-{stem}-output", limited=False)["id"]
        if err:
            fields["error_file_id"] = self.store.add_file(f"{obj['id']}_error.jsonl", "batch_output",
                                                          _jsonl(err), f"file-{stem}-error", limited=False)["id"]
        done = "cancelled" if obj["status"] == "cancelling" else "completed"
        if done == "completed" and obj["finalizing_at"] is None:
            self.store.update_batch(obj["id"], status="finalizing")
        self.store.update_batch(obj["id"], status=done, **fields)


def _jsonl(records: list[str]) -> bytes:
    return ("\n".join(records) + "\n").encode()


def _errors(code: str, message: str) -> dict:
    return {"object": "list", "data": [{"code": code, "message": message, "param": None, "line": None}]}
