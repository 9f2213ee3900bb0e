"""The Batch API through the official `openai` client, on the bundled model in a server thread.

Reference outputs come from `LLM.generate` / `LLM.chat` (greedy) before the server starts, so the
engine is only ever driven by one thread at a time.
"""
from __future__ import annotations

import io
import json
import os
import time

import httpx
import pytest
from openai import OpenAI

from tokenfab import SamplingParams
from tokenfab.server.app import build_app
from tokenfab.server.config import ServerConfig
from tokenfab.server.launch import ServerThread

pytestmark = pytest.mark.timeout(300)

PROMPTS = ["The capital of France is", "One, two, three,", "Water boils at"]
CHAT = [{"role": "user", "content": "Name a color."}]
MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


def line(cid: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def completion_line(cid: str, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    return line(cid, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                         "ignore_eos": True})


@pytest.fixture(scope="module")
def refs(bundled_llm):
    return {"completions": [o.outputs[0].text for o in bundled_llm.generate(PROMPTS, GREEDY, use_tqdm=False)],
            "chat": bundled_llm.chat(CHAT, GREEDY, use_tqdm=False)[0].outputs[0].text}


@pytest.fixture(scope="module")
def server(bundled_llm, refs, tmp_path_factory):
    config = ServerConfig(access_log=False, data_dir=str(tmp_path_factory.mktemp("batch-data")),
                          batch_max_file_bytes=4096, batch_max_total_bytes=16384, batch_concurrency=2)
    app = build_app(bundled_llm.engine, config)
    with ServerThread(app) as srv:
        srv.app = app
        yield srv
    assert bundled_llm.engine.block_manager.num_used_blocks() == 0


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def upload(client: OpenAI, lines: list[str]):
    return client.files.create(file=("input.jsonl", io.BytesIO(("\n".join(lines) + "\n").encode())), purpose="batch")


def wait(client: OpenAI, batch_id: str, until=("completed", "failed", "cancelled"), timeout: float = 240):
    deadline = time.monotonic() + timeout
    while True:
        b = client.batches.retrieve(batch_id)
        if b.status in until:
            return b
        assert time.monotonic() < deadline, f"batch still {b.status}"
        time.sleep(0.2)


def records(client: OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def test_batch_of_completions_and_chat_equals_llm_generate(client, refs):
    lines = [completion_line(f"c{i}", p) for i, p in enumerate(PROMPTS)]
    lines.append(line("chat", "/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": MAX_TOKENS,
                                                       "temperature": 0, "ignore_eos": True}))
    f = upload(client, lines)
    assert (f.object, f.purpose, f.status) == ("file", "batch", "processed")
    assert client.files.retrieve(f.id).bytes == f.bytes
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h",
                                  metadata={"job": "t1"})
    assert batch.status == "validating" and batch.metadata == {"job": "t1"}
    done = wait(client, batch.id)
    assert done.status == "completed", done
    assert done.error_file_id is not None                 # the chat line's url is not the batch's endpoint
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (4, 3, 1)
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    out = records(client, done.output_file_id)
    assert [r["custom_id"] for r in out] == ["c0", "c1", "c2"]
    assert [r["response"]["body"]["choices"][0]["text"] for r in out] == refs["completions"]
    assert all(r["response"]["status_code"] == 200 and r["response"]["request_id"].startswith("cmpl-")
               and r["error"] is None for r in out)
    (err,) = records(client, done.error_file_id)
    assert err["custom_id"] == "chat" and err["error"]["line"] == 4 and err["error"]["code"] == "invalid_url"


def test_chat_batch_equals_llm_chat(client, refs):
    f = upload(client, [line("only", "/v1/chat/completions", {"messages": CHAT, "max_tokens": MAX_TOKENS,
                                                              "temperature": 0, "ignore_eos": True})])
    done = wait(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                              completion_window="24h").id)
    assert done.status == "completed" and done.error_file_id is None
    (r,) = records(client, done.output_file_id)
    assert r["response"]["body"]["choices"][0]["message"]["content"] == refs["chat"]


def test_malformed_lines_go_to_the_error_file_with_line_numbers_and_the_rest_run(client):
    lines = ["{not json", completion_line("ok1", "Hello"), json.dumps({"method": "POST"}),
             completion_line("ok1", "again"),                                  # repeated custom_id
             line("bad-temp", "/v1/completions", {"prompt": "x", "temperature": -1, "max_tokens": 2}),
             completion_line("ok2", "Bye")]
    f = upload(client, lines)
    done = wait(client, client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                              completion_window="24h").id)
    assert done.status == "completed"
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (6, 2, 4)
    assert [r["custom_id"] for r in records(client, done.output_file_id)] == ["ok1", "ok2"]
    errs = records(client, done.error_file_id)
    assert [e["error"]["line"] for e in errs if e["error"]] == [1, 3, 4]
    assert [e["error"]["code"] for e in errs if e["error"]] == ["invalid_json", "missing_custom_id",
                                                                "duplicate_custom_id"]
    (bad_param,) = [e for e in errs if e["response"]]       # ran, and the route rejected it with a 400
    assert bad_param["custom_id"] == "bad-temp" and bad_param["response"]["status_code"] == 400
    assert bad_param["response"]["body"]["error"]["param"] == "temperature"


def test_cancel_stops_a_running_batch_and_keeps_finished_lines(client):
    lines = [completion_line(f"r{i}", f"Count to {i}:", max_tokens=40) for i in range(12)]
    f = upload(client, lines)
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    wait(client, batch.id, until=("in_progress",))
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled")
    done = wait(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at and done.cancelling_at
    out = records(client, done.output_file_id)
    assert len(out) == done.request_counts.completed < 12
    assert {r["custom_id"] for r in out} <= {f"r{i}" for i in range(12)}


def test_list_pages_newest_first_with_after_cursor(client):
    page = client.batches.list(limit=2)
    assert len(page.data) == 2 and page.has_more
    following = client.batches.list(limit=2, after=page.data[-1].id)
    assert following.data and following.data[0].id not in {b.id for b in page.data}
    assert page.data[0].created_at >= following.data[0].created_at


def test_upload_limits_and_bad_requests_are_4xx_with_openai_errors(server, client):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        big = http.post("/v1/files", files={"file": ("big.jsonl", b"x" * 5000)}, data={"purpose": "batch"})
        assert big.status_code == 413 and big.json()["error"]["code"] == "file_too_large"
        wrong = http.post("/v1/files", files={"file": ("a.jsonl", b"{}\n")}, data={"purpose": "fine-tune"})
        assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "purpose"
        r = http.post("/v1/batches", json={"input_file_id": "file-nope", "endpoint": "/v1/completions",
                                           "completion_window": "24h"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input_file_id"
        r = http.post("/v1/batches", json={"input_file_id": "x", "endpoint": "/v1/embeddings",
                                           "completion_window": "24h"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "endpoint"
        assert http.get("/v1/batches/batch_nope").status_code == 404
        assert http.get("/v1/batches", params={"limit": 0}).status_code == 400
    # The total limit: uploads that each fit, until together they would not.
    ids = []
    with pytest.raises(Exception) as exc:
        for _ in range(10):
            ids.append(upload(client, [completion_line("a", "y" * 1500)]).id)
    assert "storage_full" in str(exc.value) or "413" in str(exc.value)
    for i in ids:
        assert client.files.delete(i).deleted
    with pytest.raises(Exception):
        client.files.retrieve(ids[0])




def test_an_upload_to_a_full_disk_is_a_507_with_an_openai_error_and_stores_nothing(server, client):
    store = server.app.state.batches.store
    before = [f.id for f in client.files.list().data]
    store._q(f"PRAGMA max_page_count = {store._q('PRAGMA page_count')[0][0]}")    # full at its size
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            for _ in range(200):         # small rows fit in the pages there are, until they do not
                r = http.post("/v1/files", files={"file": ("a.jsonl", b"{}\n")}, data={"purpose": "batch"})
                if r.status_code != 200:
                    break
    finally:
        store._q("PRAGMA max_page_count = 1073741823")
    assert r.status_code == 507, r.text
    err = r.json()["error"]
    assert err["code"] == "insufficient_storage" and "is full" in err["message"]
    stored = [f.id for f in client.files.list().data]
    assert sorted(os.listdir(store.files_dir)) == sorted(stored)      # no bytes without a row
    for fid in set(stored) - set(before):
        client.files.delete(fid)
    assert upload(client, [completion_line("a", "Hi")]).bytes > 0
