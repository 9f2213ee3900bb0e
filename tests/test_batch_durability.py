"""Crash durability of batches: SIGKILL mid-batch, start again on the same state, and every input line
has exactly one result (server: --data-dir; offline runner: OUTPUT.progress/). Real subprocesses."""
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import httpx
import pytest
from openai import OpenAI

from serve_process import free_port

pytestmark = pytest.mark.timeout(600)

N = 10
ENGINE = ["--max-num-seqs", "2", "--max-model-len", "512"]


def input_lines(n: int = N) -> list[str]:
    return [json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
                        "body": {"prompt": f"List {i} animals:", "max_tokens": 24, "temperature": 0,
                                 "ignore_eos": True}}) for i in range(n)]


@contextlib.contextmanager
def server(data_dir, log_path):
    port = free_port()
    log = open(log_path, "a")
    proc = subprocess.Popen([sys.executable, "-m", "tokenfab", "serve", "--port", str(port), "--no-access-log",
                             "--no-ui", "--data-dir", str(data_dir), "--batch-concurrency", "2", *ENGINE],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, open(log_path).read()[-2000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                    break
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.3)
        yield proc, OpenAI(base_url=url + "/v1", api_key="unused", max_retries=2, timeout=60)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(60)
        log.close()


def wait_for(predicate, timeout: float = 300, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_server_killed_mid_batch_resumes_with_exactly_one_result_per_line(tmp_path):
    data, log = tmp_path / "data", tmp_path / "server.log"
    with server(data, log) as (proc, client):
        f = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(input_lines()).encode())), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        before = wait_for(lambda: (b := client.batches.retrieve(batch.id)).request_counts.completed >= 2 and b,
                          what="two finished lines")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert before.status == "in_progress" and before.request_counts.completed < N, "killed too late to test resume"

    with server(data, log) as (_, client):
        done = wait_for(lambda: (b := client.batches.retrieve(batch.id)).status in ("completed", "failed") and b,
                        what="the resumed batch")
        assert done.status == "completed" and done.error_file_id is None
        assert (done.request_counts.total, done.request_counts.completed) == (N, N)
        out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert [r["custom_id"] for r in out] == [f"req-{i}" for i in range(N)]    # one each, in input order
    assert all(r["response"]["status_code"] == 200 for r in out)
    assert "resuming batch" in log.read_text()


def committed(side) -> int:
    db = side / "batch.sqlite"
    if not db.exists():
        return 0
    with contextlib.suppress(sqlite3.Error):
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1)) as c:
            return c.execute("SELECT COUNT(*) FROM results").fetchone()[0]
    return 0


@pytest.mark.slow
def test_offline_runner_killed_mid_file_resumes_with_exactly_one_result_per_line(tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(input_lines()) + "\n")
    cmd = [sys.executable, "-m", "tokenfab", "batch", "run", str(src), "-o", str(out), "--no-progress", *ENGINE]
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    side = tmp_path / "out.jsonl.progress"
    got = wait_for(lambda: first.poll() is not None or committed(side) >= 2, what="two committed lines")
    assert first.poll() is None and got, "finished before it could be killed"
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert not out.exists() and 2 <= committed(side) < N

    second = subprocess.run(cmd, capture_output=True, text=True, timeout=500)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "done by an earlier run" in second.stderr
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["custom_id"] for r in records] == [f"req-{i}" for i in range(N)]
    assert all(r["response"]["status_code"] == 200 for r in records) and not side.exists()
    os.remove(out)


# -- a data dir that is not ours: refused at start, naming the file, before the model loads ------------

def corrupt(path) -> None:
    path.write_bytes(b"SQLite format 3\x00" + os.urandom(200))          # a torn header, then noise


def foreign(path) -> None:
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE files (name TEXT, owner TEXT)")             # another program's 'files'
    db.commit()
    db.close()


def stranger(path) -> None:
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE users (id INTEGER)")                         # none of ours at all
    db.commit()
    db.close()


@pytest.mark.parametrize("spoil, says", [(corrupt, "SQLite says"), (foreign, "table 'files' has columns name, owner"),
                                         (stranger, "holds tables (users)")])
def test_serve_refuses_a_corrupt_or_foreign_database_in_the_data_dir_with_one_line(tmp_path, spoil, says):
    db = tmp_path / "batch.sqlite"
    spoil(db)
    before = db.read_bytes()
    out = subprocess.run([sys.executable, "-m", "tokenfab", "serve", "--port", str(free_port()), "--no-ui",
                          "--data-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"tokenfab serve: error: {db} is not a tokenfab batch store" in out.stderr and says in out.stderr
    assert "Traceback" not in out.stderr and "--data-dir" in out.stderr
    assert db.read_bytes() == before                                        # nothing written into it


def test_store_opens_its_own_database_again(tmp_path):
    from tokenfab.batch.store import BatchStore
    with contextlib.closing(BatchStore(tmp_path)) as store:
        fid = store.add_file("in.jsonl", "batch", b"{}\n")["id"]
    with contextlib.closing(BatchStore(tmp_path)) as store:             # the column check accepts our own schema
        assert store.get_file(fid)["bytes"] == 3


def test_serve_refuses_a_data_dir_that_is_a_file_with_one_line(tmp_path):
    path = tmp_path / "not-a-dir"
    path.write_text("x")
    out = subprocess.run([sys.executable, "-m", "tokenfab", "serve", "--port", str(free_port()), "--no-ui",
                          "--data-dir", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and f"tokenfab serve: error: --data-dir {path}:" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_line_whose_replica_died_runs_again_and_a_dead_engine_pauses_the_batch():
    import asyncio

    from tokenfab.batch import runner
    from tokenfab.batch.lines import parse_lines

    lines, _ = parse_lines(b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}\n')
    replies = [(503, None, {"error": {"code": "replica_lost", "message": "replica r1 failed"}}),
               (200, "cmpl-1", {"choices": [{"text": "ok"}]})]

    class Sink:
        def __init__(self) -> None:
            self.got: dict = {}

        def done_lines(self):
            return set(self.got)

        def add(self, line, record, is_error):
            self.got[line] = (record, is_error)

    async def call(url, body):
        return replies.pop(0)

    def run(sink) -> None:
        asyncio.run(runner.run_lines(call, lines, sink, asyncio.Semaphore(1), 1))

    runner.RETRY_AFTER_S, saved = 0.0, runner.RETRY_AFTER_S
    try:
        sink = Sink()
        run(sink)
        assert not replies and [(n, bad) for n, (_, bad) in sink.got.items()] == [(lines[0].line, False)]
        replies[:] = [(503, None, {"error": {"code": "engine_dead", "message": "the engine is dead"}})]
        with pytest.raises(runner.EngineUnavailable):
            run(Sink())                                          # paused, nothing recorded: runs after a restart
    finally:
        runner.RETRY_AFTER_S = saved
