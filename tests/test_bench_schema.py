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
          "stream_usage", "ignore_eos", "temperature", "timeout_s", "extra_body", "agent"]
RUN = ["request_rate", "burstiness", "max_concurrency", "warmup_failed", "summary", "buckets", "errors", "requests",
       "sessions"]
AGENT = ["num_sessions", "turns", "system_len", "user_len", "tool_len", "output_len", "think_time", "num_tools",
         "range_ratio"]
SESSION_STATS = [f"{s}_session_ms" for s in ("mean", "median", "std", "p50", "p99")]
SESSIONS = ["num_sessions", "completed", "failed", "turns_sent", "prompt_tokens", "new_tokens", "resent_share",
            "server_prompt_tokens", "prefix_cache"] + SESSION_STATS + ["by_turn", "records"]
BY_TURN = ["turn", "requests", "completed", "mean_prompt_tokens", "mean_new_tokens"] + [
    f"{s}_ttft_ms" for s in ("mean", "median", "std", "p50", "p99")]
SESSION_RECORD = ["index", "turns_planned", "turns_sent", "success", "start_s", "end_s", "session_ms", "think_s",
                  "requests"]
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


@pytest.fixture(scope="module")
def agent_result():
    from tokenfab.bench.agent import AgentConfig
    from tokenfab.bench.agent_run import run_agent
    loop = VirtualClockLoop()
    try:
        _, server, url = loop.run_until_complete(start_fake_server(FakeScript(ttft_ms=5, chunk_interval_ms=2)))
        cfg = ServeConfig(base_url=url, model="fake-model", endpoint="chat", percentiles=[50, 99],
                          agent=AgentConfig(num_sessions=2, turns="2", system_len="16", user_len="4", output_len="2",
                                            think_time="0.1"))
        runs, sweep = run_agent(cfg, TokenCounter(), Endpoint(url, "fake-model", kind="chat"), clock=loop.time,
                                run=loop.run_until_complete)
        server.close()
        return build_result(cfg, TokenCounter(), runs, sweep)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def test_an_agent_run_has_exactly_the_pinned_session_keys(agent_result):
    assert list(agent_result["config"]) == CONFIG and list(agent_result["config"]["agent"]) == AGENT
    sessions = agent_result["runs"][0]["sessions"]
    assert list(sessions) == SESSIONS
    assert [list(row) for row in sessions["by_turn"]] == [BY_TURN, BY_TURN]
    assert [list(r) for r in sessions["records"]] == [SESSION_RECORD, SESSION_RECORD]


def test_other_datasets_have_null_agent_sections(result):
    assert result["config"]["agent"] is None and result["runs"][0]["sessions"] is None


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
    fixed = set(TOP + CONFIG + RUN + REQUEST + SUMMARY[:17] + BUCKET[:7] + AGENT + SESSIONS[:9] + BY_TURN[:5]
                + SESSION_RECORD + ["by_turn", "records"]) | {"source", "exact", "mode", "rates",
                                                              "saturation_request_rate"}
    missing = [k for k in sorted(fixed) if f"`{k}`" not in docs]
    assert not missing, f"docs/bench.md does not document {missing}"
    for pattern in ("mean_M_ms", "median_M_ms", "std_M_ms", "pP_M_ms", "`session`", "`ttft`"):
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
    older = tmp_path / "older.json"     # version 1 lacks only the agent sections, which readers take as absent
    older.write_text(json.dumps({"schema": SCHEMA, "schema_version": 1}))
    assert load_result(str(older))["schema_version"] == 1
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        load_result(str(broken))
