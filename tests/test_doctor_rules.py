"""`tokenfab doctor`'s rules on synthetic metric windows and bench results: one scenario per finding,
each diagnosed correctly and nothing else claimed; a healthy deployment gets no finding."""
import json

import pytest

from tokenfab.doctor import report, rules
from tokenfab.doctor.scrape import Scrape, Window
from tokenfab.plan import roofline
from tokenfab.server.metrics import ITL_BUCKETS, LATENCY_BUCKETS, TTFT_BUCKETS

INFO = {"max_num_seqs": "64", "max_num_batched_tokens": "2048", "block_size": "16", "num_kv_blocks": "512",
        "dtype": "float16", "kv_cache_dtype": "auto", "quantization": "none"}
SECONDS = 5.0


def _hist(s: Scrape, name: str, obs: list[float], edges: list[float]) -> None:
    s.buckets[name] = [(e, float(sum(o <= e for o in obs))) for e in edges] + [(float("inf"), float(len(obs)))]
    s.values[name + "_count"] = float(len(obs))
    s.values[name + "_sum"] = float(sum(obs))


def scrape(t: float, *, running=0, waiting=0, kv=0.0, preemptions=0, prompt=0, gen=0, finished=0, hits=0,
           queries=0, ttft=(), queue=(), itl=()) -> Scrape:
    """A scrape at time t; counters and histogram observations are totals since start."""
    s = Scrape(t=t, info=dict(INFO))
    s.values.update({"num_requests_running": running, "num_requests_waiting": waiting, "kv_cache_usage_perc": kv,
                     "num_preemptions_total": preemptions, "prompt_tokens_total": prompt,
                     "generation_tokens_total": gen, "request_success_total": finished,
                     "prefix_cache_hits_total": hits, "prefix_cache_queries_total": queries})
    _hist(s, "time_to_first_token_seconds", list(ttft), TTFT_BUCKETS)
    _hist(s, "request_queue_time_seconds", list(queue), LATENCY_BUCKETS)
    _hist(s, "inter_token_latency_seconds", list(itl), ITL_BUCKETS)
    return s


def window(*, n_first=10, prompt_len=200, out_len=100, running=8, waiting=(0, 0), kv=0.3, preemptions=0,
           ttft_s=0.05, queue_s=0.005, itl_s=0.02, hits=0.5) -> Window:
    """A steady window: `n_first` requests got a first token and as many finished (each `out_len`
    tokens), with the given means; before it, one earlier request's worth of totals."""
    gen = n_first * out_len
    before = scrape(100.0, running=running, waiting=waiting[0], kv=kv, prompt=prompt_len, gen=out_len, finished=1,
                    queries=prompt_len, ttft=[ttft_s], queue=[queue_s], itl=[itl_s] * out_len)
    after = scrape(100.0 + SECONDS, running=running, waiting=waiting[1], kv=kv, preemptions=preemptions,
                   prompt=prompt_len * (n_first + 1), gen=out_len + gen, finished=1 + n_first,
                   hits=hits * prompt_len * n_first, queries=prompt_len * (n_first + 1),
                   ttft=[ttft_s] * (n_first + 1), queue=[queue_s] * (n_first + 1), itl=[itl_s] * (out_len + gen))
    return Window(before, after)


@pytest.fixture(scope="module")
def dep():
    """Llama-2-7B fp16 on an RTX 3090: decode is memory-bound at every batch used here."""
    return report.deployment_for("rtx-3090", "llama-2-7b", INFO)


def ceiling(dep, batch: int, prompt_len=200, out_len=100) -> float:
    """The roofline decode step the rules compare with (context: prompt + half the output)."""
    return roofline.decode(dep, batch, prompt_len + out_len // 2).total_s


def kinds(findings) -> list[str]:
    return [f.kind for f in findings]


def test_healthy_window_claims_nothing_without_and_with_the_roofline(dep):
    assert kinds(rules.diagnose(window())[0]) == []
    # 2.5x the roofline's step: neither at the bandwidth ceiling nor far above it.
    w = window(running=8, itl_s=2.5 * ceiling(dep, 8))
    assert kinds(rules.diagnose(w, dep=dep)[0]) == []


def test_kv_capacity_named_from_full_pool_and_preemptions_and_queue_is_not_claimed_separately():
    w = window(kv=0.97, preemptions=6, waiting=(1, 5), running=6, ttft_s=0.30, queue_s=0.25)
    findings, m = rules.diagnose(w)
    assert kinds(findings) == ["kv_capacity"]
    f = findings[0]
    assert f.numbers["preemptions"] == 6 and f.numbers["kv_usage"] == pytest.approx(0.97)
    text = " ".join(f.evidence + f.advice)
    assert "97%" in text and "--kv-cache-dtype int8" in text and "--kv-cache-memory-bytes" in text


def test_preemptions_are_kv_capacity_even_when_both_usage_samples_missed_the_full_pool():
    # Preemption happens only when no block is free; the gauge is a point sample at each scrape.
    w = window(kv=0.5, preemptions=4, waiting=(1, 3), running=2, ttft_s=0.30, queue_s=0.25)
    assert kinds(rules.diagnose(w)[0]) == ["kv_capacity"]
    assert kinds(rules.diagnose(window(kv=0.5, preemptions=0, waiting=(1, 3), running=2, ttft_s=0.30,
                                       queue_s=0.25))[0]) == ["queueing"]


def test_kv_full_with_the_sequence_cap_reached_is_not_kv_capacity():
    # 64 of 64 running and waiting: the cap, not the pool, holds requests back (and there are no preemptions).
    w = window(kv=0.95, running=64, waiting=(0, 0))
    assert "kv_capacity" not in kinds(rules.diagnose(w)[0])


def test_queueing_named_from_a_growing_queue_with_replicas_and_the_seq_cap():
    w = window(running=64, waiting=(2, 12), kv=0.5, ttft_s=1.7, queue_s=1.5)
    findings, _ = rules.diagnose(w)
    assert kinds(findings) == ["queueing"]
    f = findings[0]
    assert f.numbers["waiting_after"] == 12 and f.numbers["queue_share"] == pytest.approx(1.5 / 1.7)
    # arrivals = 2 finished/s + 10 more waiting over 5 s = 4/s: twice what finishes.
    assert f.numbers["arrivals_per_s"] == pytest.approx(4.0)
    advice = " ".join(f.advice)
    assert "--max-num-seqs" in advice and "plan capacity --rate 4.00" in advice and "about 2 replicas" in advice


def test_prefill_named_when_ttft_is_mostly_prefill_and_compute_bound_with_the_roofline(dep):
    itl = 2.5 * ceiling(dep, 8, prompt_len=2048)
    w = window(prompt_len=2048, ttft_s=max(0.9, 30 * itl), queue_s=0.01, itl_s=itl, hits=0.0)
    assert kinds(rules.diagnose(w)[0]) == ["prefill_compute"]
    findings, _ = rules.diagnose(w, dep=dep)
    assert kinds(findings) == ["prefill_compute"]
    f = findings[0]
    assert f.numbers["bound"] == "compute" and "compute-bound" in f.title
    assert "--enable-prefix-caching" in " ".join(f.advice)       # 0 % hits


def test_long_tail_named_from_the_long_prompt_bucket_only():
    def bucket(label, low, high, p50, p99):
        return {"bucket": label, "low": low, "high": high, "completed": 20, "median_ttft_ms": p50, "p99_ttft_ms": p99,
                "median_e2el_ms": p50 + 500, "p99_e2el_ms": p99 + 600}
    tail = {"schema": "tokenfab.bench.serve", "runs": [{"summary": {
        "median_ttft_ms": 200.0, "p99_ttft_ms": 3000.0, "median_e2el_ms": 700.0, "p99_e2el_ms": 1500.0},
        "buckets": [bucket("1-128", 1, 128, 150, 400), bucket("129-512", 129, 512, 220, 500),
                    bucket(">512", 513, None, 900, 3000)]}]}
    findings, m = rules.diagnose(None, bench=tail)
    assert m is None and kinds(findings) == ["long_tail"]
    f = findings[0]
    assert f.numbers["bucket"] == ">512" and f.numbers["p99_ms"] == 3000.0
    assert "513" in " ".join(f.advice)
    # With a healthy live window beside it, still only the tail.
    assert kinds(rules.diagnose(window(), bench=tail)[0]) == ["long_tail"]
    # The same P99 spread evenly over the buckets is a tail, but not one long prompts cause.
    even = json.loads(json.dumps(tail))
    for b in even["runs"][0]["buckets"]:
        b["p99_ttft_ms"] = 3000.0
    assert kinds(rules.diagnose(None, bench=even)[0]) == []


def test_decode_bandwidth_named_at_the_roofline(dep):
    w = window(running=1, itl_s=ceiling(dep, 1) / 0.8)
    findings, _ = rules.diagnose(w, dep=dep)
    assert kinds(findings) == ["decode_bandwidth"]
    f = findings[0]
    assert f.numbers["fraction_of_roofline"] == pytest.approx(0.8, rel=0.02)
    assert "--quantization int8 or int4" in " ".join(f.advice) and "--max-num-seqs" in " ".join(f.advice)


def test_host_overhead_named_at_small_batch_far_above_the_roofline(dep):
    w = window(running=2, itl_s=5 * ceiling(dep, 2))
    findings, _ = rules.diagnose(w, dep=dep)
    assert kinds(findings) == ["host_overhead"]
    assert findings[0].numbers["ratio"] == pytest.approx(5.0, rel=0.02)
    # The same slowness at a batch of 32 is not blamed on the host.
    w = window(running=32, itl_s=5 * ceiling(dep, 32))
    assert "host_overhead" not in kinds(rules.diagnose(w, dep=dep)[0])


def test_scrape_parses_tokenfab_metrics_text_and_window_quantiles_cover_only_the_window():
    text = """# TYPE tokenfab:num_requests_waiting gauge
tokenfab:num_requests_waiting{model_name="m"} 3.0
# TYPE tokenfab:request_success counter
tokenfab:request_success_total{finished_reason="stop",model_name="m"} 4.0
tokenfab:request_success_total{finished_reason="abort",model_name="m"} 1.0
# TYPE tokenfab:config_info gauge
tokenfab:config_info{max_num_seqs="8",model_name="m"} 1.0
# TYPE tokenfab:time_to_first_token_seconds histogram
tokenfab:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} %d
tokenfab:time_to_first_token_seconds_bucket{le="1.0",model_name="m"} %d
tokenfab:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} %d
tokenfab:time_to_first_token_seconds_count{model_name="m"} %d
tokenfab:time_to_first_token_seconds_sum{model_name="m"} %f
"""
    before = Scrape.parse(text % (10, 10, 10, 10, 0.5), 0.0)
    after = Scrape.parse(text % (10, 20, 20, 20, 5.5), 2.0)
    assert before.values["num_requests_waiting"] == 3.0 and before.values["request_success_total"] == 5.0
    assert before.info == {"max_num_seqs": "8"}
    w = Window(before, after)
    # The 10 fast ones came before the window; the 10 in it all fell in (0.1, 1.0].
    assert 0.1 < w.quantile("time_to_first_token_seconds", 0.5) <= 1.0
    assert w.mean("time_to_first_token_seconds") == pytest.approx(0.5)
    assert w.quantile("inter_token_latency_seconds", 0.5) is None


def test_report_json_holds_findings_and_says_what_it_could_not_judge():
    doc = report.run(window(kv=0.97, preemptions=3, waiting=(0, 2)), None, None)
    assert [f["kind"] for f in doc["findings"]] == ["kv_capacity"]
    assert any("--hardware" in n for n in doc["notes"]) and any("--bench" in n for n in doc["notes"])
    json.dumps(doc)


def test_decode_efficiency_named_with_the_fraction_of_the_roofline_when_steps_run_far_below_it(dep):
    """A batch of 8 whose steps take 6x the roofline's (the 1B Q4_K_M case: 163 ms against 24 ms) is the
    bottleneck even with nothing else wrong; 2.5x stays healthy (test above)."""
    w = window(running=8, itl_s=6 * ceiling(dep, 8))
    findings, _ = rules.diagnose(w, dep=dep)
    assert kinds(findings) == ["decode_efficiency"]
    f = findings[0]
    assert f.numbers["fraction_of_roofline"] == pytest.approx(1 / 6, rel=0.02)
    assert "17% of their roofline" in f.evidence[0] and "--num-threads" in " ".join(f.advice)


def test_decode_efficiency_names_the_slowest_kernels_and_takes_small_batches_from_host_overhead(dep):
    step = 5 * ceiling(dep, 2)
    # the kernel table's times at this batch: the linear kernels explain 80 % of the step
    kernels = [("q6_k:2048x8192", 8, "qgemm", 0.5 * step), ("int4:16384x2048", 16, "qgemm", 0.3 * step)]
    w = window(running=2, itl_s=step)
    findings, _ = rules.diagnose(w, dep=dep, kernels=kernels)
    assert kinds(findings) == ["decode_efficiency"]             # not also host_overhead
    f = findings[0]
    assert f.numbers["kernel_s"] == pytest.approx(0.8 * step)
    assert "q6_k:2048x8192 x8 on qgemm" in f.evidence[1] and "80%" in f.evidence[1]
    assert f.advice[0].startswith("q6_k:2048x8192 runs qgemm")
    # kernels that explain little of a small batch's step: the host's time, as before
    few = [("int4:16384x2048", 16, "qgemm", 0.1 * step)]
    assert kinds(rules.diagnose(w, dep=dep, kernels=few)[0]) == ["host_overhead"]


def test_kernel_times_read_the_servers_plans_and_its_kernel_table(tmp_path):
    from tokenfab.kernels.tuning import KernelTable
    path = tmp_path / "table.json"
    table = KernelTable({"int4:16384x2048": {"rows": [1, 4, 8], "times": {"qgemm": [0.002, 0.004, 0.012],
                                                                         "qmadd": [0.007, 0.010, 0.013]}},
                         "q6_k:2048x8192": {"rows": [1, 4, 8], "times": {"qgemm": [0.003, 0.005, 0.01]}}},
                        str(path))
    table.save()
    plans = {"int4:16384x2048": [16, [[4, "qgemm"], [None, "qmadd"]]], "q6_k:2048x8192": [8, [[None, "qgemm"]]],
             "int4:2048x2048": [24, [[None, "qgemm"]]]}          # a shape the table has not measured: left out
    config = {"kernel_table": str(path), "linear_plans": json.dumps(plans)}
    got = report.kernel_times(config, batch=3)                  # 3 rows: the 4-row bucket, qgemm
    assert got == [("int4:16384x2048", 16, "qgemm", pytest.approx(16 * 0.004)),
                   ("q6_k:2048x8192", 8, "qgemm", pytest.approx(8 * 0.005))]
    assert report.kernel_times(config, batch=6)[0] == ("int4:16384x2048", 16, "qmadd", pytest.approx(16 * 0.013))
    assert report.kernel_times({**config, "kernel_table": str(tmp_path / "none.json")}, 1) is None
