"""`bench serve` end to end against `tokenfab serve` on the bundled model.

Besides completing, it checks that our exact prompt counts agree with the server's own
usage.prompt_tokens, and that output tokens come from the server's usage."""
import json

import pytest
from serve_process import serve

from tokenfab.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("serve") / "serve.log") as url:
        yield url


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_against_tokenfab_serve_counts_tokens_as_the_server_does(server_url, tmp_path, endpoint):
    out = tmp_path / "r.json"
    rc = main(["bench", "serve", "--base-url", server_url, "--endpoint", endpoint, "--num-prompts", "4",
               "--input-len", "32", "--output-len", "8", "--max-concurrency", "2", "--warmup", "1",
               "--no-progress", "--out", str(out)])
    assert rc == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["summary"]["completed"] == 4, run["errors"]
    for r in run["requests"]:
        assert r["output_len"] == 8
        assert r["token_count_source"] in ("usage", "final_usage")
        assert r["server_prompt_tokens"] == r["prompt_len"]
        assert len(r["itl_ms"]) == 7
