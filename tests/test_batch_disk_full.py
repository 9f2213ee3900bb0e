"""A full disk under the data dir: the store's writes fail with DiskFull (507) and leave nothing behind,
and a running batch waits for space instead of failing, then finishes with one result per line.

SQLite's `max_page_count` makes the database full at its current size (SQLITE_FULL, as on a full disk),
and a symlink to /dev/full makes a file write fail with ENOSPC: no root, no tmpfs. The drill
(`tokenfab bench drills --only enospc`) does the same on a real 4 MiB tmpfs.
"""
from __future__ import annotations

import asyncio
import json
import os

import pytest

from tokenfab.batch import service as service_mod
from tokenfab.batch.service import BatchService
from tokenfab.batch.store import BatchStore, DiskFull


def fill(store: BatchStore) -> None:
    """The database may not grow past the pages it has now."""
    pages = store._q("PRAGMA page_count")[0][0]
    store._q(f"PRAGMA max_page_count = {pages}")


def free(store: BatchStore) -> None:
    store._q("PRAGMA max_page_count = 1073741823")


def test_a_result_on_a_full_disk_raises_507_and_commits_once_space_returns(tmp_path):
    store = BatchStore(tmp_path)
    fill(store)
    with pytest.raises(DiskFull) as exc:
        for line in range(100):
            store.add_result("b", line, {"text": "x" * 600}, False)
    assert exc.value.status == 507 and exc.value.code == "insufficient_storage" and str(tmp_path) in str(exc.value)
    stopped_at = line
    assert store.done_lines("b") == set(range(stopped_at))
    free(store)
    assert store.add_result("b", stopped_at, {"text": "x" * 600}, False)
    assert store.done_lines("b") == set(range(stopped_at + 1))
    assert store._q("PRAGMA integrity_check") == [("ok",)]


def test_a_file_that_does_not_fit_leaves_no_bytes_and_no_row(tmp_path):
    store = BatchStore(tmp_path)
    (store.files_dir / "file-x.tmp").symlink_to("/dev/full")       # its write fails with ENOSPC
    with pytest.raises(DiskFull):
        store.add_file("in.jsonl", "batch", b"{}\n" * 10, file_id="file-x")
    assert os.listdir(store.files_dir) == [] and store.list_files() == []
    fill(store)                                   # from here the bytes fit, and the rows until the pages are full
    with pytest.raises(DiskFull):
        for i in range(1000):
            store.add_file("in.jsonl", "batch", b"{}\n", file_id=f"file-{i:04d}")
    assert i > 0 and sorted(os.listdir(store.files_dir)) == sorted(f["id"] for f in store.list_files())
    free(store)
    assert store.add_file("in.jsonl", "batch", b"{}\n", file_id=f"file-{i:04d}")["bytes"] == 3


def test_a_running_batch_waits_out_a_full_disk_then_completes_each_line_once(tmp_path, monkeypatch):
    monkeypatch.setattr(service_mod, "DISK_RETRY_S", 0.02)
    n = 12
    store = BatchStore(tmp_path)
    data = "\n".join(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
                                 "body": {"prompt": "x" * 400}}) for i in range(n)).encode()
    calls = []

    async def call(url: str, body: dict):
        calls.append(body["prompt"])
        await asyncio.sleep(0.001)
        return 200, f"cmpl-{len(calls)}", {"choices": [{"text": body["prompt"]}]}

    async def run() -> tuple[dict, dict]:
        fid = store.add_file("in.jsonl", "batch", data)["id"]
        batch_id = store.create_batch(fid, "/v1/completions", "24h", None)["id"]
        service = BatchService(store, call, concurrency=2)
        fill(store)
        service.submit(batch_id)
        await asyncio.sleep(0.5)
        during = store.get_batch(batch_id)
        free(store)
        for _ in range(500):
            if store.get_batch(batch_id)["status"] == "completed":
                break
            await asyncio.sleep(0.01)
        return during, store.get_batch(batch_id)

    during, done = asyncio.run(run())
    assert during["status"] == "in_progress" and during["request_counts"]["completed"] < n
    assert done["status"] == "completed" and done["request_counts"] == {"total": n, "completed": n, "failed": 0}
    out = [json.loads(x)["custom_id"] for x in store.file_content(done["output_file_id"]).decode().splitlines()]
    assert out == [f"req-{i}" for i in range(n)]
    assert len(calls) <= n + 2           # at most a worker's line each ran while its commit waited
    assert store._q("PRAGMA integrity_check") == [("ok",)]
