"""The offline runner: a batch input file through the engine without a server, resumable.

    tokenfab batch run input.jsonl -o output.jsonl

The lines run through the same route code as the server's Batch API (an app that is never served),
so an output line is what the server would have written. Results are committed one by one to a
sidecar store next to the output (`output.jsonl.progress/`, SQLite); a run that is killed and started
again runs only the lines without a result. When every line has one, output.jsonl is written in input
order (successes and errors together, as vLLM's run_batch does) and the sidecar is removed.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
from pathlib import Path

from tokenfab.batch.lines import error_line, parse_lines
from tokenfab.batch.runner import RouteCall, run_lines
from tokenfab.batch.store import BatchStore


class _Sink:
    def __init__(self, store: BatchStore, key: str) -> None:
        self.store, self.key = store, key

    def done_lines(self) -> set[int]:
        return self.store.done_lines(self.key)

    def add(self, line: int, record: dict, is_error: bool) -> None:
        self.store.add_result(self.key, line, record, is_error)


def progress_dir(output: str | os.PathLike) -> Path:
    return Path(f"{output}.progress")


def run_file(routes: contextlib.AbstractAsyncContextManager[RouteCall], input_path: str, output_path: str,
             concurrency: int, show_progress: bool = True) -> dict:
    """Run every line of `input_path` into `output_path` through `routes` (entered for the run:
    server/batch_dispatch.py's `offline_routes(engine)`); returns {"total", "completed", "failed", "resumed"}."""
    data = Path(input_path).read_bytes()
    lines, bad = parse_lines(data)
    if not lines and not bad:
        raise ValueError(f"{input_path} has no request lines (one JSON object per line)")
    key = "input-" + hashlib.sha256(data).hexdigest()[:24]     # the progress belongs to this exact input
    side = progress_dir(output_path)
    store = BatchStore(side)
    try:
        other = {k for (k,) in store._q("SELECT DISTINCT batch_id FROM results")} - {key}
        if other:
            raise ValueError(f"{side} holds progress for a different input file; delete it or choose another -o")
        for err in bad:
            store.add_result(key, err.line, error_line(err), True)
        resumed = len(store.done_lines(key) - {e.line for e in bad})
        asyncio.run(_run(routes, lines, _Sink(store, key), concurrency, len(lines) + len(bad),
                         len(store.done_lines(key)), show_progress))
        rows = store.results(key)
        assert len(rows) == len(lines) + len(bad), "every line has exactly one result"
        tmp = Path(f"{output_path}.tmp")
        tmp.write_text("".join(r + "\n" for _, _, r in rows))
        os.replace(tmp, output_path)
        failed = sum(e for _, e, _ in rows)
    finally:
        store.close()
    shutil.rmtree(side, ignore_errors=True)
    return {"total": len(rows), "completed": len(rows) - failed, "failed": failed, "resumed": resumed}


async def _run(routes, lines, sink, concurrency: int, total: int, done: int, show_progress: bool) -> None:
    with _progress(total, done, show_progress) as advance:
        async with routes as call:
            await run_lines(call, lines, sink, asyncio.Semaphore(concurrency), concurrency,
                            on_result=lambda _line, _ok: advance())


@contextlib.contextmanager
def _progress(total: int, done: int, show: bool):
    if not show:
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
        TimeRemainingColumn
    with Progress(TextColumn("batch"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("eta"), TimeRemainingColumn(), console=Console(stderr=True)) as bar:
        task = bar.add_task("lines", total=total, completed=done)
        yield lambda: bar.advance(task)

