"""`bench serve` end to end against `tokenfab serve` on the bundled model, once the server exists.

Besides completing, it checks that our exact prompt counts agree with the server's own
usage.prompt_tokens, and that output tokens come from the server's usage."""
import argparse
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tokenfab.cli import build_parser, main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _has_serve_command() -> bool:
    subs = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return any("serve" in a.choices for a in subs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    if not _has_serve_command():
        pytest.skip("`tokenfab serve` is not there yet")
    port = _free_port()
    log = open(tmp_path_factory.mktemp("serve") / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "tokenfab.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"tokenfab serve exited with {proc.returncode}: {log.read()[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("tokenfab serve did not become healthy within 300 s")
            time.sleep(1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


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
