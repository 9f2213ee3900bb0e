"""`tokenfab bench` on the command line, against the scripted server in a subprocess (real time)."""
import json
import os
import selectors
import subprocess
import sys

import pytest

from tokenfab.cli import main

pytestmark = pytest.mark.timeout(180)
TTFT_MS, INTERVAL_MS = 20.0, 5.0


@pytest.fixture(scope="module")
def fake_url():
    proc = subprocess.Popen([sys.executable, "-m", "tokenfab.bench.fake_server", "--port", "0", "--ttft-ms",
                             str(TTFT_MS), "--interval-ms", str(INTERVAL_MS), "--tokens-per-chunk", "1,2"],
                            stdout=subprocess.PIPE, text=True)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        if not sel.select(timeout=30):
            pytest.fail("the fake server did not start within 30 s")
        line = proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, line
        yield line.split()[-1]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def serve(url, tmp_path, *extra):
    out = tmp_path / "r.json"
    rc = main(["bench", "serve", "--base-url", url, "--tokenizer", "none", "--num-prompts", "6", "--input-len", "16",
               "--output-len", "5", "--max-concurrency", "3", "--warmup", "3", "--no-progress", "--out", str(out),
               *extra])
    return rc, out


def test_parser_registration_imports_nothing_heavy():
    code = ("import argparse, sys; from tokenfab.bench import cli; p = argparse.ArgumentParser(); "
            "cli.add_parser(p.add_subparsers()); "
            "print([m for m in ('torch', 'transformers', 'httpx', 'numpy', 'matplotlib', 'rich') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_serve_writes_a_result_with_every_request_and_plots(fake_url, tmp_path, capsys):
    rc, out = serve(fake_url, tmp_path, "--plot", str(tmp_path / "plots"), "--goodput", "ttft:1000")
    assert rc == 0
    result = json.loads(out.read_text())
    run = result["runs"][0]
    assert run["summary"]["completed"] == 6 and run["summary"]["failed"] == 0
    for r in run["requests"]:
        assert r["output_len"] == 5 and r["chunks"] == 4  # 1,2,1,1 tokens per chunk
        # the server never answers early, so the script is a lower bound in real time
        assert r["ttft_ms"] >= TTFT_MS and r["e2el_ms"] >= TTFT_MS + 3 * INTERVAL_MS
    assert sorted(os.listdir(tmp_path / "plots")) == ["buckets.png", "latency_cdf.png"]
    shown = capsys.readouterr().out
    assert "Request throughput" in shown and "TTFT" in shown and "Goodput" in shown


def test_agent_sessions_write_per_turn_ttfts_tables_and_a_ttft_by_turn_plot(fake_url, tmp_path, capsys):
    out = tmp_path / "agent.json"
    rc = main(["bench", "serve", "--base-url", fake_url, "--tokenizer", "none", "--dataset", "agent",
               "--num-sessions", "2", "--turns", "3", "--system-len", "32", "--user-len", "8", "--output-len", "3",
               "--think-time", "0.05", "--max-concurrency", "2", "--no-progress", "--out", str(out),
               "--plot", str(tmp_path / "plots")])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["config"]["endpoint"] == "chat" and result["config"]["agent"]["num_sessions"] == 2
    sessions = result["runs"][0]["sessions"]
    assert sessions["completed"] == 2 and sessions["prefix_cache"] is None
    assert [row["turn"] for row in sessions["by_turn"]] == [1, 2, 3]
    assert all(row["p50_ttft_ms"] >= TTFT_MS for row in sessions["by_turn"])   # the script is a lower bound
    assert "ttft_by_turn.png" in os.listdir(tmp_path / "plots")
    shown = capsys.readouterr().out
    assert "TTFT by turn" in shown and "prefix-cache hit rate" in shown and "not reported" in shown


def test_sweep_writes_one_run_per_rate_and_a_sweep_plot(fake_url, tmp_path):
    rc, out = serve(fake_url, tmp_path, "--sweep", "40,80", "--plot", str(tmp_path / "plots"))
    assert rc == 0
    result = json.loads(out.read_text())
    assert [r["request_rate"] for r in result["runs"]] == [40.0, 80.0]
    assert "sweep.png" in os.listdir(tmp_path / "plots")


def test_compare_shows_each_file_and_its_ratio_to_the_first(fake_url, tmp_path, capsys):
    rc, out = serve(fake_url, tmp_path)
    assert rc == 0
    a = json.loads(out.read_text())
    b = json.loads(out.read_text())
    b["runs"][0]["summary"]["output_throughput"] = 2 * a["runs"][0]["summary"]["output_throughput"]
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    capsys.readouterr()
    assert main(["bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--labels", "base,fast",
                 "--plot", str(tmp_path / "cmp")]) == 0
    shown = capsys.readouterr().out
    row = next(line for line in shown.splitlines() if "Output throughput" in line)
    assert "2.00×" in row
    assert os.listdir(tmp_path / "cmp") == ["compare_latency_cdf.png"]


@pytest.mark.parametrize("args,says", [
    (["--base-url", "127.0.0.1:8000"], "http://"),
    (["--base-url", "http://127.0.0.1:9", "--goodput", "ttft"], "ttft:MS"),
    (["--base-url", "http://127.0.0.1:9", "--dataset", "jsonl:/no/such.jsonl"], "does not exist"),
    (["--base-url", "http://127.0.0.1:9", "--input-len", "lots"], "not a number"),
    (["--base-url", "http://127.0.0.1:9", "--sweep", "1,fast"], "request rate"),
])
def test_user_mistakes_exit_2_with_a_one_line_reason(args, says, capsys):
    assert main(["bench", "serve", *args]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1


def test_compare_rejects_a_file_that_is_not_a_result(tmp_path, capsys):
    (tmp_path / "x.json").write_text("{}")
    assert main(["bench", "compare", str(tmp_path / "x.json")]) == 2
    assert "not a tokenfab bench result" in capsys.readouterr().err
