"""Metric math of `bench serve` on synthetic timings: per-request TTFT/ITL/TPOT/E2E, token
counting per chunk, and the aggregates (throughput, goodput, percentiles, buckets)."""
import numpy as np
import pytest

from tokenfab.bench.aggregate import (bucket_summaries, make_buckets, max_concurrency, parse_slos, pkey,
                                      summarize)
from tokenfab.bench.client import ChunkEvent, RawResult
from tokenfab.bench.datasets import BenchRequest
from tokenfab.bench.timing import RequestRecord, apportion, request_record, resolve_counts
from tokenfab.bench.tokens import TokenCounter

APPROX = TokenCounter()


def raw(times_ms, texts=None, tokens=None, final=None, error=None, sent=100.0):
    texts = texts or ["x"] * len(times_ms)
    tokens = tokens or [None] * len(times_ms)
    events = [ChunkEvent(t / 1e3, s, n) for t, s, n in zip(times_ms, texts, tokens)]
    source = "usage" if any(n is not None for n in tokens) else None
    end = sent + (max(times_ms) / 1e3 if times_ms else 0.0)
    return RawResult(sent=sent, end=end, events=events, completion_tokens=final, count_source=source,
                     error=error)


def record(r: RawResult, prompt_len=10, scheduled=100.0, slot_at=100.0, t0=100.0, counter=APPROX):
    return request_record(0, BenchRequest("p", None, prompt_len, 64), r, scheduled, slot_at, t0, counter)


def test_multi_token_chunks_split_their_gap_evenly_and_itls_sum_to_e2e_minus_ttft():
    # chunks at 40, 50 (3 tokens), 60, 70 (2 tokens): 7 tokens
    rec = record(raw([40, 50, 60, 70], tokens=[1, 3, 1, 2]))
    assert rec.ttft_ms == pytest.approx(40)
    assert rec.e2el_ms == pytest.approx(70)
    assert rec.output_len == 7
    assert rec.itl_ms == pytest.approx([10 / 3] * 3 + [10] + [5, 5])
    assert sum(rec.itl_ms) == pytest.approx(rec.e2el_ms - rec.ttft_ms)
    assert rec.tpot_ms == pytest.approx(30 / 6)


def test_extra_tokens_in_the_first_chunk_are_zero_gaps():
    rec = record(raw([40, 60], tokens=[3, 1]))
    assert rec.itl_ms == pytest.approx([0, 0, 20])
    assert len(rec.itl_ms) == rec.output_len - 1


def test_usage_counts_win_over_the_text_of_the_chunks():
    # The text would count as many tokens; the server says one per chunk.
    rec = record(raw([10, 20], texts=["many words in here", "and more words"], tokens=[1, 1]))
    assert rec.output_len == 2
    assert rec.token_count_source == "usage"


def test_final_usage_total_is_kept_exactly_when_chunks_carry_no_counts():
    r = raw([10, 20, 30, 40], texts=["a", "b c d", "e", "f"], final=7)
    counts, source = resolve_counts(r, APPROX)
    assert sum(counts) == 7
    assert source == "final_usage"
    assert counts[1] == 4  # the chunk with the most text takes the surplus
    assert min(counts) >= 1


def test_final_usage_equal_to_the_chunk_count_gives_one_token_per_chunk():
    counts, _ = resolve_counts(raw([10, 20, 30], texts=["long text here", "x", "y"], final=3), APPROX)
    assert counts == [1, 1, 1]


def test_no_usage_at_all_counts_the_whole_output_with_the_counter():
    r = raw([10, 20], texts=[" hello", " big world"])
    counts, source = resolve_counts(r, APPROX)
    assert sum(counts) == 3 and source == "approximate"


def test_tokens_reported_only_in_the_final_usage_land_on_the_last_chunk():
    counts, _ = resolve_counts(raw([10, 20], tokens=[1, 1], final=4), APPROX)
    assert counts == [1, 3]


@pytest.mark.parametrize("total,weights", [(10, [1, 5, 1]), (2, [3, 1, 1, 1]), (5, [0, 0, 0]), (7, [2.5, 0.1])])
def test_apportion_adds_up_and_gives_the_first_chunk_a_token(total, weights):
    counts = apportion(total, weights)
    assert sum(counts) == total
    assert counts[0] >= 1
    if total >= len(weights):
        assert min(counts) >= 1


def test_one_token_output_has_no_tpot_and_no_itl():
    rec = record(raw([25], tokens=[1]))
    assert rec.tpot_ms is None and rec.itl_ms == [] and rec.e2el_ms == pytest.approx(25)


def test_send_lag_separates_slot_wait_from_client_lag():
    r = raw([10], tokens=[1], sent=100.030)
    rec = record(r, scheduled=100.0, slot_at=100.020)
    assert rec.send_lag_ms == pytest.approx(30)
    assert rec.slot_wait_ms == pytest.approx(20)


def test_failed_request_keeps_its_error_and_has_no_latencies():
    rec = record(RawResult(sent=100.0, end=100.0, error="HTTP 500: boom"))
    assert not rec.success and rec.error == "HTTP 500: boom" and rec.ttft_ms is None


def _rec(i, prompt_len, ttft, e2el, out, ok=True, sent=0.0):
    tpot = (e2el - ttft) / (out - 1) if ok and out > 1 else None
    itl = [tpot] * (out - 1) if tpot is not None else []
    return RequestRecord(index=i, tag="", prompt_len=prompt_len, max_tokens=out, success=ok,
                         error=None if ok else "HTTP 500: boom", scheduled_s=sent, sent_s=sent,
                         end_s=sent + (e2el if ok else 0) / 1e3, send_lag_ms=0.0, slot_wait_ms=0.0,
                         output_len=out if ok else 0, ttft_ms=ttft if ok else None, tpot_ms=tpot,
                         e2el_ms=e2el if ok else None, itl_ms=itl)


RECORDS = [_rec(0, 100, 50, 250, 11), _rec(1, 128, 70, 170, 6), _rec(2, 129, 300, 600, 4),
           _rec(3, 5000, 900, 1200, 1), _rec(4, 200, 0, 0, 10, ok=False)]


def test_throughput_counts_completed_requests_and_their_tokens_over_the_duration():
    s = summarize(RECORDS, 2.0, [50, 99], {})
    assert (s["num_requests"], s["completed"], s["failed"]) == (5, 4, 1)
    assert s["total_input_tokens"] == 100 + 128 + 129 + 5000
    assert s["total_output_tokens"] == 11 + 6 + 4 + 1
    assert s["request_throughput"] == pytest.approx(4 / 2.0)
    assert s["output_throughput"] == pytest.approx(22 / 2.0)
    assert s["total_token_throughput"] == pytest.approx((5357 + 22) / 2.0)
    assert s["request_goodput"] is None


def test_percentiles_match_numpy_on_completed_requests():
    s = summarize(RECORDS, 2.0, [50, 90, 99.9], {})
    ttfts = [50, 70, 300, 900]
    assert s["mean_ttft_ms"] == pytest.approx(np.mean(ttfts))
    assert s["p90_ttft_ms"] == pytest.approx(np.percentile(ttfts, 90))
    assert s["p99.9_e2el_ms"] == pytest.approx(np.percentile([250, 170, 600, 1200], 99.9))
    # the one-token request has no TPOT
    assert s["mean_tpot_ms"] == pytest.approx(np.mean([20, 20, 100]))
    itls = [20] * 10 + [20] * 5 + [100] * 3
    assert s["p50_itl_ms"] == pytest.approx(np.percentile(itls, 50))


def test_goodput_counts_requests_meeting_every_slo():
    slos = parse_slos(["ttft:100", "tpot:50"])
    s = summarize(RECORDS, 2.0, [50], slos)
    assert s["good_requests"] == 2  # requests 0 and 1; 2 misses both, 3 misses TTFT, 4 failed
    assert s["request_goodput"] == pytest.approx(1.0)
    # a one-token request has no TPOT and passes the TPOT limit
    assert summarize(RECORDS, 2.0, [50], parse_slos(["ttft:1000", "tpot:1"]))["good_requests"] == 1


def test_bucket_edges_are_inclusive_and_every_request_lands_in_one_bucket():
    rows = bucket_summaries(RECORDS, make_buckets([128, 512]), [50, 99], {})
    assert [r["bucket"] for r in rows] == ["1-128", "129-512", ">512"]
    assert [r["num_requests"] for r in rows] == [2, 2, 1]
    assert [r["failed"] for r in rows] == [0, 1, 0]
    assert rows[0]["p99_ttft_ms"] == pytest.approx(np.percentile([50, 70], 99))
    assert rows[1]["p50_ttft_ms"] == pytest.approx(300)
    assert rows[2]["p50_e2el_ms"] == pytest.approx(1200)


def test_empty_bucket_reports_nulls_not_zeros():
    rows = bucket_summaries(RECORDS, make_buckets([10]), [50], {})
    assert rows[0]["num_requests"] == 0 and rows[0]["p50_ttft_ms"] is None


def test_max_concurrency_counts_overlapping_requests():
    recs = [_rec(0, 1, 1, 1000, 2, sent=0.0), _rec(1, 1, 1, 1000, 2, sent=0.5), _rec(2, 1, 1, 100, 2, sent=1.0)]
    assert max_concurrency(recs) == 2  # the third starts exactly when the first ends


@pytest.mark.parametrize("bad,says", [("ttft", "ttft:MS"), ("latency:5", "ttft:MS"), ("ttft:abc", "not a number"),
                                      ("tpot:-1", "positive")])
def test_bad_slo_is_rejected_saying_what_is_wrong(bad, says):
    with pytest.raises(ValueError, match=says):
        parse_slos([bad])


def test_bucket_edges_must_increase():
    with pytest.raises(ValueError, match="increasing"):
        make_buckets([512, 128])


def test_percentile_keys_follow_vllm():
    assert pkey(99) == "p99" and pkey(99.9) == "p99.9" and pkey(50.0) == "p50"
