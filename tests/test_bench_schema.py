"""The JSON result of `bench serve` keeps a stable, documented layout.

The key lists here are the contract: changing the layout means changing them, docs/bench.md
and SCHEMA_VERSION together."""
import json
import os
import re

import pytest

from tokenfab.bench.client import Endpoint
from tokenfab.bench.datasets import DatasetConfig
from tokenfab.bench.fake_server import FakeScript, VirtualClockLoop, start_fake_server
from tokenfab.bench.schema import SCHEMA, SCHEMA_VERSION, build_result, load_result, write_result
from tokenfab.bench.serving import ServeConfig, run_serve
from tokenfab.bench.tokens import TokenCounter

TOP = ["schema", "schema_version", "tokenfab_version", "created_utc", "command", "config", "tokenizer", "sweep", "runs"]
CONFIG = ["base_url", "model", "endpoint", "dataset", "dataset_path", "num_prompts", "input_len", "output_len",
          "range_ratio", "num_prefixes", "prefix_len", "long_fraction", "long_input_len", "request_rate",
          "burstiness", "max_concurrency", "sweep", "warmup", "goodput", "buckets", "percentiles", "seed",
          "stream_usage", "ignore_eos", "temperature", "timeout_s", "extra_body"]
RUN = ["request_rate", "burstiness", "max_concurrency", "warmup_failed", "summary", "buckets", "errors", "requests"]
LATENCY = [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "std", "p50", "p99")]
SUMMARY = ["duration_s", "num_requests", "completed", "failed", "total_input_tokens", "total_output_tokens",
           "request_throughput", "output_throughput", "total_token_throughput", "request_goodput", "good_requests",
           "max_concurrent_requests", "mean_send_lag_ms", "p99_send_lag_ms", "max_send_lag_ms",
           "mean_client_lag_ms", "max_client_lag_ms"] + LATENCY
BUCKET = ["bucket", "low", "high", "num_requests", "completed", "failed", "good_requests"] + LATENCY
REQUEST = ["index", "tag", "prompt_len", "max_tokens", "success", "error", "scheduled_s", "sent_s", "end_s",
           "send_lag_ms", "slot_wait_ms", "output_len", "ttft_ms", "tpot_ms", "e2el_ms", "itl_ms", "chunks",
           "token_count_source", "server_prompt_tokens", "finish_reason"]
DOCS = os.path.join(os.path.dirname(__file__), "..", "docs", "bench.md")


@pytest.fixture(scope="module")
def result():
    loop = VirtualClockLoop()
    try:
        _, server, url = loop.run_until_complete(start_fake_server(FakeScript(ttft_ms=5, chunk_interval_ms=2)))
        cfg = ServeConfig(base_url=url, model="fake-model", dataset=DatasetConfig(input_len="8", output_len="4"),
                          num_prompts=4, max_concurrency=2, slos={"ttft": 100.0}, percentiles=[50, 99])
        runs, sweep = run_serve(cfg, TokenCounter(), Endpoint(url, "fake-model", api_key="sk-secret"),
                                clock=loop.time, run=loop.run_until_complete)
        server.close()
        cfg.api_key = "sk-secret"
        return build_result(cfg, TokenCounter(), runs, sweep)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def test_every_level_has_exactly_the_pinned_keys(result):
    assert list(result) == TOP
    assert list(result["config"]) == CONFIG
    assert list(result["tokenizer"]) == ["source", "exact"]
    assert list(result["sweep"]) == ["mode", "rates", "saturation_request_rate"]
    run = result["runs"][0]
    assert list(run) == RUN
    assert list(run["summary"]) == SUMMARY
    assert all(list(b) == BUCKET for b in run["buckets"])
    assert all(list(r) == REQUEST for r in run["requests"])
    assert (result["schema"], result["schema_version"]) == (SCHEMA, SCHEMA_VERSION)


def test_every_pinned_key_is_documented():
    docs = open(DOCS, encoding="utf-8").read()
    fixed = set(TOP + CONFIG + RUN + REQUEST + SUMMARY[:17] + BUCKET[:7]) | {"source", "exact", "mode", "rates",
                                                                              "saturation_request_rate"}
    missing = [k for k in sorted(fixed) if f"`{k}`" not in docs]
    assert not missing, f"docs/bench.md does not document {missing}"
    for pattern in ("mean_M_ms", "median_M_ms", "std_M_ms", "pP_M_ms"):
        assert pattern in docs


def test_result_is_strict_json_without_the_api_key(result, tmp_path):
    path = tmp_path / "r.json"
    write_result(str(path), result)
    text = path.read_text()
    assert "sk-secret" not in text
    assert not re.search(r"\bNaN\b|\bInfinity\b", text)
    assert load_result(str(path)) == json.loads(text)


def test_infinite_rate_is_written_as_the_string_inf(result):
    assert result["config"]["request_rate"] == "inf" and result["runs"][0]["request_rate"] == "inf"


def test_loading_a_foreign_or_newer_file_says_what_was_expected(tmp_path):
    other = tmp_path / "other.json"
    other.write_text('{"duration": 3}')
    with pytest.raises(ValueError, match="not a tokenfab bench result"):
        load_result(str(other))
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps({"schema": SCHEMA, "schema_version": SCHEMA_VERSION + 1}))
    with pytest.raises(ValueError, match="schema_version"):
        load_result(str(newer))
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        load_result(str(broken))
