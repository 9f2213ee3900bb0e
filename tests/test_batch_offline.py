"""`tokenfab batch run`'s core (batch/offline.py) in process, on the test session's bundled engine."""
from __future__ import annotations

import hashlib
import json

from tokenfab import SamplingParams
from tokenfab.batch.offline import progress_dir, run_file
from tokenfab.server.batch_dispatch import offline_routes
from tokenfab.batch.store import BatchStore

PROMPTS = ["The capital of France is", "Water boils at", "One, two,"]


def write_input(path) -> bytes:
    lines = [json.dumps({"custom_id": f"p{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": p, "max_tokens": 5, "temperature": 0, "ignore_eos": True}})
             for i, p in enumerate(PROMPTS)]
    lines.insert(1, '{"custom_id": "broken", "url": "/v1/completions"}')          # no body
    data = ("\n".join(lines) + "\n").encode()
    path.write_bytes(data)
    return data


def test_offline_run_equals_llm_generate_and_resumes_without_rerunning_done_lines(bundled_llm, tmp_path):
    refs = [o.outputs[0].text for o in bundled_llm.generate(
        PROMPTS, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False)]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    data = write_input(src)
    # An earlier, interrupted run left line 1's result behind: it must be kept, not run again.
    key = "input-" + hashlib.sha256(data).hexdigest()[:24]
    seeded = {"id": "batch_req_from_earlier_run", "custom_id": "p0",
              "response": {"status_code": 200, "request_id": "cmpl-x", "body": {"choices": [{"text": refs[0]}]}},
              "error": None}
    store = BatchStore(progress_dir(out))
    store.add_result(key, 1, seeded, False)
    store.close()

    summary = run_file(offline_routes(bundled_llm.engine), str(src), str(out), concurrency=2, show_progress=False)
    assert summary == {"total": 4, "completed": 3, "failed": 1, "resumed": 1}
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["custom_id"] for r in records] == ["p0", "broken", "p1", "p2"]
    assert records[0]["id"] == "batch_req_from_earlier_run"
    assert records[1]["error"]["line"] == 2 and records[1]["error"]["code"] == "missing_body"
    assert [records[i]["response"]["body"]["choices"][0]["text"] for i in (0, 2, 3)] == refs
    assert not progress_dir(out).exists()
    assert bundled_llm.engine.block_manager.num_used_blocks() == 0
