"""`tokenfab doctor` end to end: a real server with a deliberately tiny KV pool, under load, and the
doctor (CLI and /doctor) naming KV capacity; the CLI's own input errors."""
import json
import re
import threading
import time

import httpx
import pytest

from tests.serve_process import serve
from tokenfab.cli import main


def _load(url: str, stop: threading.Event, n_clients: int = 4) -> list[threading.Thread]:
    """Clients that keep generations going until `stop`: 11 prompt tokens + 20 output need all 8 blocks
    of 4 tokens, so two sequences admitted together soon preempt one another."""
    def client():
        with httpx.Client(timeout=300, trust_env=False) as c:
            while not stop.is_set():
                c.post(f"{url}/v1/completions", json={"prompt": "Count from one to a hundred: one, two,",
                                                      "max_tokens": 20, "ignore_eos": True, "temperature": 0})
    threads = [threading.Thread(target=client, daemon=True) for _ in range(n_clients)]
    for t in threads:
        t.start()
    return threads


def _wait_for_preemption(url: str, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = httpx.get(f"{url}/metrics", trust_env=False).text
        if not re.search(r"^tokenfab:num_preemptions_total\{[^}]*\} 0\.0$", text, re.M):
            return
        time.sleep(0.5)
    pytest.fail(f"no preemption within {timeout_s:.0f} s of load on an 8-block pool")


def test_doctor_names_kv_capacity_on_a_server_with_a_tiny_kv_pool_under_load(tmp_path, capsys):
    # 8 blocks × 4 tokens = 32 tokens of KV for 4 clients' 31-token requests. One thread: the machine is shared.
    with serve(tmp_path / "serve.log", "--num-kv-blocks", "8", "--block-size", "4", "--max-num-seqs", "4",
               "--max-model-len", "32", "--num-threads", "1") as url:
        stop = threading.Event()
        threads = _load(url, stop)
        try:
            _wait_for_preemption(url)
            rc = main(["doctor", "--url", url, "--interval", "5", "--json"])
            out = capsys.readouterr().out
            doc = json.loads(out)
            page = httpx.get(f"{url}/doctor", timeout=60, trust_env=False).json()
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=300)
        assert rc == 0
        kinds = [f["kind"] for f in doc["findings"]]
        print("doctor found:", kinds, json.dumps(doc["measured"]))
        assert "kv_capacity" in kinds, doc
        kv = next(f for f in doc["findings"] if f["kind"] == "kv_capacity")
        # preemptions inside the 5 s window depend on the machine's speed; the server's count is >0 (waited for)
        assert "of 8 blocks" in kv["evidence"][0]
        assert doc["measured"]["config"]["num_kv_blocks"] == 8
        # what each linear shape runs, for decode_efficiency: the bundled model's 30 layers x 4 and the head
        plans = json.loads(doc["measured"]["config"]["linear_plans"])
        assert sum(n for n, _ in plans.values()) == 30 * 4 + 1 and all(ranges for _, ranges in plans.values())
        assert "kv_capacity" in [f["kind"] for f in page["findings"]], page
        # Every request finished or was aborted with its blocks: the pool is empty again.
        metrics = httpx.get(f"{url}/metrics", trust_env=False).text
        assert 'tokenfab:kv_cache_usage_perc{model_name="SmolLM2-135M-Instruct"} 0.0' in metrics


def test_doctor_cli_refuses_no_input_and_reads_a_bench_result(tmp_path, capsys):
    assert main(["doctor"]) == 2
    assert "give --url" in capsys.readouterr().err
    result = {"schema": "tokenfab.bench.serve", "schema_version": 1, "runs": [{
        "summary": {"median_ttft_ms": 100.0, "p99_ttft_ms": 2000.0},
        "buckets": [{"bucket": "1-512", "low": 1, "high": 512, "completed": 30, "p99_ttft_ms": 300.0},
                    {"bucket": ">512", "low": 513, "high": None, "completed": 5, "p99_ttft_ms": 2000.0}]}]}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result))
    assert main(["doctor", "--bench", str(path)]) == 0
    out = capsys.readouterr().out
    assert "long TTFT tail from long prompts" in out and "513" in out
    assert main(["doctor", "--url", "http://127.0.0.1:9", "--interval", "0.1"]) == 2
    assert "cannot reach" in capsys.readouterr().err
