"""The agent workload (`bench serve --dataset agent`) against a real `tokenfab serve` on the bundled model.

Small on purpose (2 sessions x 3 turns, short lengths), so it runs in the default test run: the
virtual-clock tests (test_bench_agent.py) check the mechanics exactly, this one that a real server
gets well-formed conversations with tools, counts their tokens as the bench does, and that later
turns hit its prefix cache."""
import json

import pytest

from serve_process import serve
from tokenfab.cli import main

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("serve") / "serve.log") as url:
        yield url


def test_agent_sessions_reuse_their_history_in_the_servers_prefix_cache(server_url, tmp_path):
    """2 sessions x 3 turns: every turn's TTFT is reported by turn index, the bench counts each prompt
    (tools and history included) as the server does, and later turns hit the server's prefix cache."""
    out = tmp_path / "agent.json"
    rc = main(["bench", "serve", "--base-url", server_url, "--dataset", "agent", "--num-sessions", "2",
               "--turns", "3", "--system-len", "96", "--user-len", "16", "--tool-len", "16", "--output-len", "8",
               "--num-tools", "2", "--think-time", "0", "--max-concurrency", "2", "--warmup", "1",
               "--no-progress", "--out", str(out)])
    assert rc == 0
    run = json.loads(out.read_text())["runs"][0]
    s = run["sessions"]
    assert s["completed"] == 2, run["errors"]
    assert [(row["turn"], row["completed"]) for row in s["by_turn"]] == [(1, 2), (2, 2), (3, 2)]
    assert all(row["p50_ttft_ms"] > 0 for row in s["by_turn"])
    assert all(r["server_prompt_tokens"] == r["prompt_len"] for r in run["requests"])
    assert s["new_tokens"] < s["prompt_tokens"]
    assert s["prefix_cache"] is not None and s["prefix_cache"]["hit_rate"] > 0
