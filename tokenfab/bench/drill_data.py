"""The fault drills of `tokenfab bench drills` on the server's data dir, each with a server of its own:

- sigkill:     SIGKILL mid-batch and restart on the same --data-dir; every batch line answered once
- enospc:      the data dir's disk (a tmpfs) fills mid-batch; a clear error on the write, the job resumes
               with space
- corrupt_sqlite: a corrupt or foreign batch.sqlite at start; a clear error naming the file
"""
from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import time

from tokenfab.bench.client import RawResult
from tokenfab.bench.drill_load import outcome
from tokenfab.bench.local_server import ServeProcess
from tokenfab.bench.drills import MIB, DrillContext, DrillResult, poll


# -- the Batch API under SIGKILL and ENOSPC ---------------------------------------------------------

def batch_input(n: int) -> bytes:
    return "\n".join(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
                                 "body": {"prompt": f"List {i} animals:", "max_tokens": 24, "temperature": 0,
                                          "ignore_eos": True}}) for i in range(n)).encode() + b"\n"


async def _upload(ctx: DrillContext, data: bytes) -> tuple[int, dict]:
    r = await ctx.client.post(f"{ctx.server.url}/v1/files", data={"purpose": "batch"},
                              files={"file": ("in.jsonl", io.BytesIO(data), "application/jsonl")})
    return r.status_code, r.json()


async def _start_batch(ctx: DrillContext, n: int) -> str:
    status, f = await _upload(ctx, batch_input(n))
    assert status == 200, f
    r = await ctx.client.post(f"{ctx.server.url}/v1/batches", json={"input_file_id": f["id"],
                              "endpoint": "/v1/completions", "completion_window": "24h"})
    assert r.status_code == 200, r.text
    return r.json()["id"]


async def _store_response(ctx: DrillContext) -> dict:
    """A stored /v1/responses answer (store defaults to true), for the restart to keep."""
    r = await ctx.client.post(f"{ctx.server.url}/v1/responses", json={"model": ctx.model, "input": "Say hello.",
                                                                     "max_output_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


async def _batch(ctx: DrillContext, batch_id: str) -> dict | None:
    with contextlib.suppress(Exception):
        r = await ctx.client.get(f"{ctx.server.url}/v1/batches/{batch_id}")
        if r.status_code == 200:
            return r.json()
    return None


async def _batch_done_lines(ctx: DrillContext, batch_id: str, at_least: int) -> dict | None:
    async def enough():
        b = await _batch(ctx, batch_id)
        return b if b and b["request_counts"]["completed"] + b["request_counts"]["failed"] >= at_least else None
    return await poll(enough, 300.0, 0.1)


async def _batch_finished(ctx: DrillContext, batch_id: str, timeout_s: float = 300.0) -> dict | None:
    async def ended():
        b = await _batch(ctx, batch_id)
        return b if b and b["status"] in ("completed", "failed", "cancelled", "expired") else None
    return await poll(ended, timeout_s, 0.2)


async def _check_batch_output(ctx: DrillContext, batch: dict | None, n: int, result: DrillResult) -> None:
    """Every line answered exactly once, in order; missing lines count as lost, extra ones as duplicated."""
    if not result.check("the batch completed", batch is not None and batch["status"] == "completed",
                        f"status {batch and batch['status']}, errors {batch and batch.get('errors')}"):
        result.tally.counts["lost"] += n
        return
    text = (await ctx.client.get(f"{ctx.server.url}/v1/files/{batch['output_file_id']}/content")).text
    ids = [json.loads(x)["custom_id"] for x in text.splitlines() if x.strip()]
    want = [f"req-{i}" for i in range(n)]
    missing = [c for c in want if c not in ids]
    result.tally.counts["lost"] += len(missing)
    result.tally.duplicated += len(ids) - len(set(ids))
    result.tally.counts["completed"] += len(set(ids) & set(want))
    result.check(f"{n} batch lines, one result each, in input order", ids == want,
                 f"{len(ids)} results, {len(missing)} missing, {len(ids) - len(set(ids))} twice")


async def sigkill(ctx: DrillContext) -> DrillResult:
    cfg = ctx.cfg
    n = cfg.batch_lines
    result = DrillResult("sigkill", "SIGKILL mid-batch, restart on the same --data-dir")
    data = cfg.workdir / "sigkill-data"
    shutil.rmtree(data, ignore_errors=True)
    server = ctx.new_server("sigkill", "--data-dir", str(data), "--batch-concurrency", "2")
    try:
        await server.start()
        await ctx.use(server)
        batch_id = await _start_batch(ctx, n)
        stored = await _store_response(ctx)
        async with ctx.load(seed=6) as load:
            before = await _batch_done_lines(ctx, batch_id, 2)
            t_kill = time.perf_counter()
            server.send(signal.SIGKILL)
            await server.wait_exit(10.0)
            result.check("killed mid-batch", before is not None and before["status"] == "in_progress",
                         f"{before and before['request_counts']} done at the kill")
            server.launch()
            await server.wait_healthy()
            result.recovery_s = time.perf_counter() - t_kill
            await asyncio.sleep(1.0)            # the load runs on the restarted server too
            done = await _batch_finished(ctx, batch_id)
        load.tally(killed=[t_kill], into=result.tally)
        result.check("the restarted server served the load", any(raw.sent > t_kill and outcome(raw) == "completed"
                                                                  for _, raw in load.results))
        await _check_batch_output(ctx, done, n, result)
        r = await ctx.client.get(f"{ctx.server.url}/v1/responses/{stored['id']}")
        result.check("a stored response is intact after the restart",
                     r.status_code == 200 and r.json()["output"] == stored["output"], f"GET answered {r.status_code}")
        result.kv_idle_blocks = await ctx.idle_kv()
    finally:
        server.stop()
    return result


def _mount_tmpfs(path, size: int) -> str | None:
    """Mount a tmpfs of `size` bytes at `path`; None, or why it cannot be done here."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    if shutil.which("mount") is None:
        return "no mount command"
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                         capture_output=True, text=True)
    return None if out.returncode == 0 else f"mount -t tmpfs failed: {out.stderr.strip() or out.returncode}"


def _unmount(path) -> None:
    if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _fill(path) -> int:
    """Write zeros into `path` until the disk is full; the bytes written."""
    written = 0
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                written += f.write(b"\0" * (64 << 10))
        except OSError:
            pass
    return written


def _integrity(db) -> str:
    with contextlib.closing(sqlite3.connect(db, timeout=10)) as c:
        return c.execute("PRAGMA integrity_check").fetchone()[0]


async def enospc(ctx: DrillContext) -> DrillResult:
    cfg = ctx.cfg
    n = cfg.batch_lines
    result = DrillResult("enospc", f"data dir's disk full (tmpfs of {cfg.tmpfs_bytes / MIB:g} MiB) mid-batch")
    mnt = cfg.workdir / "enospc-data"
    mnt.mkdir(parents=True, exist_ok=True)
    why = _mount_tmpfs(mnt, cfg.tmpfs_bytes)
    if why:
        result.skipped = why
        return result
    server = ctx.new_server("enospc", "--data-dir", str(mnt), "--batch-concurrency", "1")
    try:
        await server.start()
        await ctx.use(server)
        batch_id = await _start_batch(ctx, n)
        async with ctx.load(seed=7) as load:
            await _batch_done_lines(ctx, batch_id, 1)
            filler = mnt / "filler"
            _fill(filler)
            status, body = await _upload(ctx, batch_input(2))
            msg = (body.get("error") or {}).get("message", "") if isinstance(body, dict) else ""
            result.tally.add(RawResult(status=status, error=f"HTTP {status}: {msg}" if status != 200 else None,
                                       finish_reason="stop"))
            result.check("an upload to the full disk gets a clear error", status == 507 and "full" in msg,
                         f"HTTP {status}: {msg[:120]}")
            await asyncio.sleep(2.0)
            mid = await _batch(ctx, batch_id)
            result.check("the batch waits, not failed, while the disk is full",
                         mid is not None and mid["status"] not in ("failed", "completed"),
                         f"status {mid and mid['status']}, {mid and mid['request_counts']}")
            health = (await ctx.client.get(f"{server.url}/health")).status_code
            result.check("/health answers while the disk is full", health == 200, str(health))
            filler.unlink()
            t_space = time.perf_counter()
            done = await _batch_finished(ctx, batch_id)
            result.recovery_s = time.perf_counter() - t_space
        load.tally(into=result.tally)
        await _check_batch_output(ctx, done, n, result)
        status, _ = await _upload(ctx, batch_input(2))
        result.check("uploads work again once space returns", status == 200, f"HTTP {status}")
        result.check("batch.sqlite passes PRAGMA integrity_check", _integrity(mnt / "batch.sqlite") == "ok")
        result.kv_idle_blocks = await ctx.idle_kv()
    finally:
        server.stop()
        _unmount(mnt)
    return result


# -- a corrupt or foreign database at start ---------------------------------------------------------

def _corrupt(path) -> None:
    path.write_bytes(b"SQLite format 3\x00" + os.urandom(200))      # a torn header, then noise


def _foreign(path) -> None:
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("CREATE TABLE files (name TEXT, owner TEXT)")      # another program's 'files'
        db.commit()


async def corrupt_sqlite(ctx: DrillContext) -> DrillResult:
    result = DrillResult("corrupt_sqlite", "corrupt or foreign batch.sqlite at start")
    last: ServeProcess | None = None
    for name, spoil in (("corrupt", _corrupt), ("foreign", _foreign)):
        data = ctx.cfg.workdir / f"{name}-data"
        shutil.rmtree(data, ignore_errors=True)
        data.mkdir(parents=True)
        db = data / "batch.sqlite"
        spoil(db)
        before = db.read_bytes()
        server = ctx.new_server(f"{name}-sqlite", "--data-dir", str(data))
        server.launch()
        rc = await server.wait_exit(120.0)
        log = server.log_tail(4000)
        result.check(f"{name}: refused with exit 2 and one line naming the file",
                     rc == 2 and f"{db} is not a tokenfab batch store" in log and "Traceback" not in log,
                     f"exit {rc}: {log.strip().splitlines()[-1][:160] if log.strip() else ''}")
        result.check(f"{name}: the file is left as it was", db.read_bytes() == before)
        db.rename(db.with_suffix(".sqlite.bad"))          # what the message says to do
        last = server
    assert last is not None
    t0 = time.perf_counter()
    try:
        await last.start()
        result.recovery_s = time.perf_counter() - t0
        await ctx.use(last)
        async with ctx.load(seed=8) as load:
            await asyncio.sleep(ctx.cfg.load_s / 2)
        load.tally(into=result.tally)
        result.check("with the file moved aside, the server starts and serves", result.tally["completed"] > 0)
        result.kv_idle_blocks = await ctx.idle_kv()
    finally:
        last.stop()
    return result
