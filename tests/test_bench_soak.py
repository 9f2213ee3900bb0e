"""`tokenfab bench soak`: its pieces without a server (the mix, the server probe, a window's summary, the
flags), and one short soak end to end against `tokenfab serve` on the bundled model, which must leave no
KV block held, answer no request with a 5xx, and fail no request."""
import argparse
import json
import os

import pytest

from tokenfab.bench.client import ChunkEvent, Endpoint, RawResult
from tokenfab.bench.datasets import BenchRequest
from tokenfab.bench.drift import Thresholds, judge
from tokenfab.bench.fake_server import FakeScript, start_fake_server
from tokenfab.bench.probe import parse_metrics, read_proc
from tokenfab.bench.soak import SoakConfig, error_status, run_soak, summarize_window
from tokenfab.bench.soak_cli import parse_duration
from tokenfab.bench.soak_mix import SoakMix, SoakRequest, SoakWorkload, make_endpoints, structured_error
from tokenfab.bench.tokens import load_counter
from tokenfab.cli import build_parser, main

from serve_process import serve

BASE = Endpoint(base_url="http://127.0.0.1:9", model="m")


def soak_args(*extra: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "soak", "--base-url", "http://127.0.0.1:9", *extra])


# -- the pieces ---------------------------------------------------------------------------------

def test_flag_defaults_are_the_dataclass_defaults():
    args, mix, th = soak_args(), SoakMix(), Thresholds()
    for name in ("input_len", "long_input_len", "long_fraction", "output_len", "chat_fraction", "stream_fraction",
                 "abort_fraction", "structured_fraction"):
        assert getattr(args, name) == getattr(mix, name), name
    assert (args.max_rss_slope, args.max_p99_regression, args.max_leaked_blocks, args.max_error_rate, args.max_5xx,
            args.max_fd_growth, args.max_thread_growth, args.warmup_windows, args.consecutive) == \
        (th.max_rss_slope_mib_per_hour, th.max_p99_regression, th.max_leaked_blocks, th.max_error_rate, th.max_5xx,
         th.max_fd_growth, th.max_thread_growth, th.warmup_windows, th.consecutive)


def test_mix_follows_its_shares_and_draws_fresh_prompts():
    counter = load_counter("none")
    only_aborts = SoakWorkload(SoakMix(chat_fraction=0.0, stream_fraction=1.0, abort_fraction=1.0,
                                       structured_fraction=0.0, output_len="10"), counter, make_endpoints(BASE))
    drawn = [only_aborts.next() for _ in range(80)]          # more than one batch of prompts
    assert all(r.endpoint.kind == "completions" and r.stream for r in drawn)
    assert all(r.hang_up_after is not None and 0 <= r.hang_up_after <= 5 for r in drawn)
    assert {r.hang_up_after for r in drawn} >= {0, 5}          # mid-prefill and mid-stream
    assert len({r.req.prompt for r in drawn}) == 80
    structured = SoakWorkload(SoakMix(structured_fraction=1.0, stream_fraction=0.0, output_len="4"), counter,
                              make_endpoints(BASE)).next()
    body = structured.endpoint.payload(structured.req)
    assert structured.kind.startswith("structured/plain/")
    assert body["response_format"]["type"] == "json_schema" and "ignore_eos" not in body and "messages" in body
    assert structured.req.output_len >= 32


def test_mix_draws_long_prompts_at_their_share():
    w = SoakWorkload(SoakMix(long_fraction=0.25, input_len="8", long_input_len="64"), load_counter("none"),
                     make_endpoints(BASE))
    tags = [w.next().req.tag for _ in range(128)]
    assert set(tags) == {"short", "long"}
    assert 0.15 < tags.count("long") / len(tags) < 0.35


def test_structured_answers_are_checked_once_finished():
    assert structured_error('{"answer": "yes"}', "stop") is None
    assert structured_error('{"answer": "ye', "length") is None              # cut by max_tokens: not judged
    assert "not JSON" in structured_error('{"answer": "ye', "stop")
    assert "breaks its schema" in structured_error('{"answer": "perhaps"}', "stop")
    assert "breaks its schema" in structured_error('{"answer": "no", "why": "x"}', "stop")


def test_metrics_text_gives_process_and_kv_figures_for_any_prefix():
    text = """# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 1.048576e+08
# TYPE process_open_fds gauge
process_open_fds 31.0
# TYPE process_threads gauge
process_threads 9.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="a"} 1.0
vllm:num_requests_running{model_name="b"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="a"} 0.25
# TYPE tokenfab:kv_cache_used_blocks gauge
tokenfab:kv_cache_used_blocks{model_name="a"} 7.0
# TYPE tokenfab:replica_num_requests_running gauge
tokenfab:replica_num_requests_running{replica="r1"} 5.0
"""
    s = parse_metrics(text)
    assert (s.rss_bytes, s.open_fds, s.threads) == (100 << 20, 31, 9)
    assert s.running == 3 and s.waiting is None and s.busy             # the per-replica copy is not added
    assert s.kv_used_blocks == 7 and s.kv_usage == 0.25 and s.source == "metrics"
    assert parse_metrics("# nothing here\n").source == "none"


def test_proc_figures_of_a_live_process_and_a_clear_error_for_a_gone_one():
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc here")
    rss, threads, fds = read_proc(os.getpid())
    assert rss > 1 << 20 and threads >= 1 and fds >= 3
    with pytest.raises(ValueError, match="is gone"):
        read_proc(2 ** 22 + 12345)


def test_failures_are_counted_by_status():
    assert error_status(RawResult(status=503, error="HTTP 503: busy")) == "503"
    assert error_status(RawResult(error="timed out after 5 s")) == "timeout"
    assert error_status(RawResult(status=200, error="error in stream: boom")) == "stream"
    assert error_status(RawResult(status=200, error="structured output is not JSON")) == "invalid_output"
    assert error_status(RawResult(error="ConnectError: refused")) == "transport"


def test_a_window_counts_hang_ups_apart_and_times_only_streams_for_ttft():
    counter = load_counter("none")
    ep = make_endpoints(BASE)

    def req(stream: bool, hang_up=None) -> SoakRequest:
        return SoakRequest(BenchRequest("a b c", None, 3, 4, "short"), ep["completions"], stream, hang_up)

    streamed = RawResult(sent=10.0, end=10.4, events=[ChunkEvent(0.1, " x", 1), ChunkEvent(0.4, " y y y", 3)],
                         completion_tokens=4, status=200)
    plain = RawResult(sent=10.0, end=11.0, events=[ChunkEvent(1.0, " x x x x", 4)], completion_tokens=4, status=200)
    hung = RawResult(sent=10.0, end=10.05, status=200, hung_up=True)
    failed = RawResult(sent=10.0, end=10.01, status=500, error="HTTP 500: boom")
    done = [(req(True), streamed, 10.0, 10.0), (req(False), plain, 10.0, 10.0), (req(True, 0), hung, 10.0, 10.0),
            (req(False), failed, 10.0, 10.0)]
    w = summarize_window(0, done, start=9.0, t0=0.0, server=parse_metrics(""), counter=counter,
                         percentiles=[50.0, 99.0])
    assert (w.requests, w.completed, w.aborted, w.failed) == (4, 2, 1, 1)
    assert w.errors == {"500": 1} and w.output_tokens == 8
    assert w.latency["p50_ttft_ms"] == pytest.approx(100.0)             # the plain answer has no TTFT of its own
    assert w.latency["p99_tpot_ms"] == pytest.approx(100.0)
    assert w.latency["median_e2el_ms"] == pytest.approx(700.0)          # 400 ms streamed, 1000 ms plain
    assert w.kinds == {"completions/plain/short": 2, "completions/stream/short": 1,
                       "completions/stream/short/abort": 1}
    assert w.stats().num_5xx == 1


def test_durations_read_with_units():
    assert parse_duration("90", "--duration") == 90.0
    assert parse_duration("30m", "--duration") == 1800.0
    assert parse_duration("1.5h", "--window") == 5400.0
    with pytest.raises(ValueError, match="--window '5 minutes'"):
        parse_duration("5 minutes", "--window")


@pytest.mark.parametrize("flags, message", [
    (["--duration", "10s", "--window", "5s"], "gives 2 window(s)"),
    (["--duration", "1m", "--window", "2m"], "shorter than one --window"),
    (["--abort-fraction", "1.5"], "--abort-fraction 1.5"),
    (["--max-concurrency", "0"], "--max-concurrency 0"),
    (["--output-len", "lots"], "--output-len"),
    (["--pid", "-4"], "--pid -4"),
])
def test_bad_flags_get_one_clear_line_and_exit_2(flags, message, capsys):
    assert main(["bench", "soak", "--base-url", "http://127.0.0.1:9", *flags]) == 2
    err = capsys.readouterr().err
    assert "tokenfab bench soak: error:" in err and message in err and "Traceback" not in err


# -- the loop, on a virtual clock against the scripted server ------------------------------------

@pytest.mark.parametrize("rate", [float("inf"), 8.0])
def test_every_window_times_requests_as_scripted_under_the_cap(vloop, rate):
    """The scripted server answers 50 ms after a request, then a token every 20 ms: every window must
    report exactly that, never exceed the cap, and come out as long as asked."""
    fake, server, url = vloop.run_until_complete(start_fake_server(FakeScript(50.0, 0.0, 20.0, (1,))))
    mix = SoakMix(chat_fraction=0.5, stream_fraction=1.0, abort_fraction=0.0, structured_fraction=0.0,
                  input_len="8", long_input_len="24", output_len="4")
    cfg = SoakConfig(base_url=url, model="fake-model", duration_s=4.0, window_s=1.0, max_concurrency=2,
                     request_rate=rate, mix=mix, idle_timeout_s=1.0)
    cfg.validate()
    counter = load_counter("none")
    workload = SoakWorkload(mix, counter, make_endpoints(Endpoint(url, "fake-model", stream_usage="continuous")))
    try:
        run = vloop.run_until_complete(run_soak(cfg, workload, counter, clock=vloop.time))
    finally:
        server.close()
    assert len(run.windows) == 4 and run.start.source == "none"       # the fake has no /metrics
    assert fake.stats.max_in_flight <= 2
    for w in run.windows:
        assert w.failed == 0 and w.aborted == 0 and w.completed == w.requests > 0
        assert w.latency["p99_ttft_ms"] == pytest.approx(50.0) and w.latency["p99_tpot_ms"] == pytest.approx(20.0)
        assert w.latency["p99_e2el_ms"] == pytest.approx(110.0)
        assert w.output_tokens == 4 * w.completed
        assert w.load_end_s - w.start_s < 1.0 + 0.111                  # its time, at most one request more
    if rate == float("inf"):                                            # closed loop: 2 slots, 110 ms each
        assert all(w.requests == 2 * 10 and w.load_end_s - w.start_s >= 1.0 for w in run.windows)
    else:                                                               # Poisson at 8/s over 4 s (seeded)
        assert 16 <= sum(w.requests for w in run.windows) <= 48
    verdict = judge([w.stats() for w in run.windows], run.start.kv_used_blocks, cfg.thresholds)
    assert verdict.passed


# -- end to end ----------------------------------------------------------------------------------

@pytest.mark.timeout(300)
def test_short_soak_against_tokenfab_serve_leaks_no_kv_block_and_fails_no_request(tmp_path):
    out, plots = tmp_path / "soak.json", tmp_path / "plots"
    with serve(tmp_path / "serve.log") as url:
        rc = main(["bench", "soak", "--base-url", url, "--duration", "16", "--window", "4",
                   "--max-concurrency", "2", "--input-len", "16", "--long-input-len", "96", "--output-len", "8",
                   "--abort-fraction", "0.3", "--structured-fraction", "0.2", "--no-progress",
                   "--out", str(out), "--plot", str(plots)])
    result = json.loads(out.read_text())
    assert rc == (0 if result["drift"]["passed"] else 1)          # the exit code is the verdict
    windows = result["windows"]
    assert len(windows) == 4 and result["config"]["num_windows"] == 4
    start = result["start"]
    assert start["source"] == "metrics" and start["kv_used_blocks"] == 0
    for w in windows:
        assert w["requests"] > 0
        assert w["failed"] == 0, w["error_messages"]
        s = w["server"]
        assert s["idle"] is True
        assert s["kv_used_blocks"] == start["kv_used_blocks"], f"window {w['index']} left KV blocks held"
        assert s["rss_bytes"] > 0 and s["threads"] >= 1 and s["open_fds"] >= 1
    assert any(w["latency"]["p99_ttft_ms"] is not None for w in windows)
    # The draws are seeded: the first six (at least 2 per window go out) hold a hang-up, a structured and a
    # plain request, however slow the machine.
    kinds = {k for w in windows for k in w["kinds"]}
    assert any(k.endswith("/abort") for k in kinds) and any(k.startswith("structured/") for k in kinds)
    assert any(k.startswith("chat/plain/") or k.startswith("completions/plain/") for k in kinds)
    assert sum(w["aborted"] for w in windows) > 0
    checks = {c["name"]: c for c in result["drift"]["checks"]}
    assert checks["leaked_kv_blocks"]["passed"] is True and checks["leaked_kv_blocks"]["value"] == 0
    assert checks["5xx"]["value"] == 0 and checks["error_rate"]["value"] == 0
    assert checks["rss_slope"]["value"] is not None                # measured, though 16 s say little about it
    assert os.listdir(plots) == ["soak.png"]
