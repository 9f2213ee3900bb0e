"""`bench serve` against a scripted OpenAI-compatible server, over real HTTP and SSE.

The fake server and the bench share a VirtualClockLoop, whose clock jumps over idle time: a
scripted TTFT of 31 ms reads 31 ms however busy the machine is. Every expected value below is
derived from the script, never copied from a run.
"""
import asyncio
import heapq
import json

import numpy as np
import pytest

from tokenfab.bench.client import Endpoint
from tokenfab.bench.datasets import DatasetConfig
from tokenfab.bench.fake_server import FakeScript, start_fake_server
from tokenfab.bench.serving import AUTO_SWEEP_FRACTIONS, ServeConfig, run_serve
from tokenfab.bench.tokens import TokenCounter

pytestmark = pytest.mark.timeout(120)

TTFT_MS, PER_WORD_MS, INTERVAL_MS, SIZES, MAX_TOKENS = 30.0, 0.1, 10.0, (1, 2, 1, 3), 8
SHORT, LONG = [10, 20, 30, 40, 10, 20], [300, 320, 340]


def scripted_chunks(n_tokens):
    sizes, left, k = [], n_tokens, 0
    while left > 0:
        sizes.append(min(SIZES[k % len(SIZES)], left))
        left -= sizes[-1]
        k += 1
    return sizes


def expected_request(words):
    """(ttft, itls, e2el) in ms for a prompt of `words` words, from the script."""
    ttft = TTFT_MS + PER_WORD_MS * words
    sizes = scripted_chunks(MAX_TOKENS)
    itls = [0.0] * (sizes[0] - 1)
    for n in sizes[1:]:
        itls += [INTERVAL_MS / n] * n
    return ttft, itls, ttft + INTERVAL_MS * (len(sizes) - 1)


def write_prompts(path, chat=False):
    lines = [" ".join(["w"] * n) for n in SHORT + LONG] + ["w w FAIL", "w w FAILMID"]
    with open(path, "w") as f:
        for text in lines:
            row = {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
            f.write(json.dumps({**row, "max_tokens": MAX_TOKENS}) + "\n")
    return len(lines)


def bench(loop, tmp_path, *, usage="auto", stream_usage="continuous", endpoint="completions", cap=3, rate=float("inf"),
          sweep=None, warmup=3, num_prompts=None, slos=None, percentiles=(50, 99)):
    fake, server, url = loop.run_until_complete(start_fake_server(
        FakeScript(TTFT_MS, PER_WORD_MS, INTERVAL_MS, SIZES, usage)))
    n_lines = write_prompts(tmp_path / "p.jsonl", chat=endpoint == "chat")
    # The approximate counter counts each "w" as one token, as the fake server does.
    cfg = ServeConfig(base_url=url, model="fake-model", endpoint=endpoint,
                      dataset=DatasetConfig(name="jsonl", path=str(tmp_path / "p.jsonl"), endpoint=endpoint),
                      num_prompts=num_prompts or n_lines, request_rate=rate, max_concurrency=cap, sweep=sweep,
                      warmup=warmup, slos=slos or {}, buckets=[64], percentiles=list(percentiles))
    ep = Endpoint(url, "fake-model", kind=endpoint, stream_usage=stream_usage)
    try:
        runs, sweep_info = run_serve(cfg, TokenCounter(), ep, clock=loop.time, run=loop.run_until_complete)
    finally:
        server.close()
    return fake, runs, sweep_info


@pytest.mark.parametrize("usage,stream_usage,source", [
    ("auto", "continuous", "usage"), ("auto", "final", "final_usage"),
    ("logprobs", "off", "logprobs"), ("none", "off", "approximate")])
def test_per_request_metrics_equal_the_script_whatever_the_servers_token_counts(vloop, tmp_path, usage, stream_usage,
                                                                                 source):
    _, runs, _ = bench(vloop, tmp_path, usage=usage, stream_usage=stream_usage)
    ok = [r for r in runs[0].records if r.success]
    assert len(ok) == len(SHORT + LONG)
    for r in ok:
        ttft, itls, e2el = expected_request(r.prompt_len)
        assert r.ttft_ms == pytest.approx(ttft, abs=1e-6)
        assert r.itl_ms == pytest.approx(itls, abs=1e-6)
        assert r.e2el_ms == pytest.approx(e2el, abs=1e-6)
        assert r.tpot_ms == pytest.approx((e2el - ttft) / (MAX_TOKENS - 1), abs=1e-6)
        assert r.output_len == MAX_TOKENS
        assert r.chunks == len(scripted_chunks(MAX_TOKENS))
        assert r.token_count_source == source


def test_failures_are_counted_and_summarized_never_dropped(vloop, tmp_path):
    _, runs, _ = bench(vloop, tmp_path)
    s, errors = runs[0].summary, runs[0].errors
    assert (s["num_requests"], s["completed"], s["failed"]) == (len(SHORT + LONG) + 2, len(SHORT + LONG), 2)
    messages = {e["error"]: e["count"] for e in errors}
    assert messages == {"HTTP 500: scripted failure": 1, "error in stream: scripted failure in the stream": 1}


def expected_duration_ms(words_in_order, cap):
    """Makespan of FIFO slots: each request holds a slot for its stream's length."""
    free = [0.0] * cap
    end = 0.0
    for words in words_in_order:
        start = heapq.heappop(free)
        if words is None:         # HTTP 500: answered at once
            length = 0.0
        elif words == "mid":      # one content chunk, then the error ("w w FAILMID": 3 words)
            length = TTFT_MS + PER_WORD_MS * 3
        else:
            length = expected_request(words)[2]
        heapq.heappush(free, start + length)
        end = max(end, start + length)
    return end


def test_throughput_and_goodput_equal_the_scripted_values(vloop, tmp_path):
    _, runs, _ = bench(vloop, tmp_path, cap=3, slos={"ttft": 40.0, "tpot": 10.0})
    s = runs[0].summary
    # warm-up takes the first lines, so the run's order is read back from its records
    order = [r.prompt_len if r.success else None if r.error.startswith("HTTP 500") else "mid"
             for r in runs[0].records]
    assert sorted(o for o in order if isinstance(o, int)) == sorted(SHORT + LONG)
    duration = expected_duration_ms(order, 3) / 1e3
    completed = len(SHORT + LONG)
    assert s["duration_s"] == pytest.approx(duration, abs=1e-6)
    assert s["request_throughput"] == pytest.approx(completed / duration, rel=1e-3)
    assert s["total_output_tokens"] == completed * MAX_TOKENS
    assert s["output_throughput"] == pytest.approx(completed * MAX_TOKENS / duration, rel=1e-3)
    assert s["total_input_tokens"] == sum(SHORT + LONG)
    assert s["total_token_throughput"] == pytest.approx((sum(SHORT + LONG) + completed * MAX_TOKENS) / duration,
                                                        rel=1e-3)
    # TTFT <= 40 ms holds for the short prompts only (30 + 0.1·words), TPOT <= 10 for all
    assert s["good_requests"] == len(SHORT)
    assert s["request_goodput"] == pytest.approx(len(SHORT) / duration, rel=1e-3)


def test_per_bucket_percentiles_equal_the_scripted_values(vloop, tmp_path):
    _, runs, _ = bench(vloop, tmp_path, percentiles=(50, 90, 99))
    short, long = runs[0].buckets[0], runs[0].buckets[1]
    assert (short["bucket"], short["num_requests"], short["failed"]) == ("1-64", len(SHORT) + 2, 2)
    assert (long["bucket"], long["num_requests"], long["failed"]) == (">64", len(LONG), 0)
    for row, words in ((short, SHORT), (long, LONG)):
        ttfts = [expected_request(w)[0] for w in words]
        e2els = [expected_request(w)[2] for w in words]
        for p in (50, 90, 99):
            assert row[f"p{p}_ttft_ms"] == pytest.approx(np.percentile(ttfts, p), abs=1e-6)
            assert row[f"p{p}_e2el_ms"] == pytest.approx(np.percentile(e2els, p), abs=1e-6)
        assert row["p99_tpot_ms"] == pytest.approx(INTERVAL_MS * (len(scripted_chunks(MAX_TOKENS)) - 1)
                                                   / (MAX_TOKENS - 1), abs=1e-6)


def test_chat_role_chunk_does_not_count_as_the_first_token(vloop, tmp_path):
    _, runs, _ = bench(vloop, tmp_path, endpoint="chat")
    ok = [r for r in runs[0].records if r.success]
    assert ok
    for r in ok:
        # the fake server counts the words of the messages, the opening role chunk came at 0 ms
        assert r.ttft_ms == pytest.approx(TTFT_MS + PER_WORD_MS * r.server_prompt_tokens, abs=1e-6)


def test_concurrency_cap_is_never_exceeded_and_warmup_is_not_counted(vloop, tmp_path):
    fake, runs, _ = bench(vloop, tmp_path, cap=2, warmup=2, num_prompts=20)
    s = runs[0].summary
    assert fake.stats.max_in_flight == 2
    assert s["max_concurrent_requests"] <= 2
    assert s["num_requests"] == 20
    # warm-up requests reached the server but are in no count
    assert len(fake.stats.arrivals) == 22


def test_scheduled_and_actual_send_times_agree_when_the_client_keeps_up(vloop, tmp_path):
    _, runs, _ = bench(vloop, tmp_path, cap=None, rate=20.0, num_prompts=15)
    for r in runs[0].records:
        assert r.send_lag_ms == pytest.approx(0.0, abs=1e-6)
    gaps = np.diff([r.scheduled_s for r in runs[0].records])
    assert (gaps >= 0).all() and gaps.sum() > 0


def test_slot_wait_shows_as_send_lag_under_a_cap(vloop, tmp_path):
    _, runs, _ = bench(vloop, tmp_path, cap=1, num_prompts=4)
    recs = runs[0].records
    assert recs[0].send_lag_ms == pytest.approx(0.0, abs=1e-6)
    for prev, r in zip(recs, recs[1:]):  # with one slot, each waits for the one before to end
        assert r.sent_s == pytest.approx(prev.end_s, abs=1e-6)
        assert r.slot_wait_ms == pytest.approx(r.send_lag_ms, abs=1e-6)


def test_rate_sweep_runs_each_rate_once(vloop, tmp_path):
    _, runs, info = bench(vloop, tmp_path, sweep=[5.0, 50.0], num_prompts=6)
    assert [r.request_rate for r in runs] == [5.0, 50.0]
    assert info["mode"] == "list" and info["saturation_request_rate"] is None


def test_auto_sweep_spans_fractions_of_the_measured_peak(vloop, tmp_path):
    _, runs, info = bench(vloop, tmp_path, sweep="auto", num_prompts=6, cap=None)
    peak = runs[0].summary["request_throughput"]
    assert runs[0].request_rate == float("inf")
    assert [r.request_rate for r in runs[1:]] == pytest.approx([f * peak for f in AUTO_SWEEP_FRACTIONS], rel=1e-3)
    assert info["saturation_request_rate"] == max(r.summary["request_throughput"] for r in runs)


def test_unreachable_server_fails_in_warmup_with_its_error(vloop, tmp_path):
    cfg = ServeConfig(base_url="http://127.0.0.1:9", model="m", dataset=DatasetConfig(input_len="4", output_len="2"),
                      num_prompts=2, warmup=1, timeout_s=5)
    with pytest.raises(ValueError, match="every warm-up request"):
        run_serve(cfg, TokenCounter(), Endpoint(cfg.base_url, "m", timeout_s=5), clock=vloop.time,
                  run=vloop.run_until_complete)
