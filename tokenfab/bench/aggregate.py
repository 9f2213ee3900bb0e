"""Aggregates over a run's request records: throughput, goodput, and latency percentiles,
overall and per prompt-length bucket, with vLLM `bench serve`'s definitions and key names.

- Throughput counts completed requests and their tokens over the run's duration (first
  request due → last request done). Input tokens are the completed requests' prompt lengths.
- Goodput counts completed requests that met every SLO given (value <= limit, in ms); a
  request with one output token has no TPOT and passes a TPOT limit, as in vLLM.
- Percentiles are numpy's linear interpolation (what vLLM uses); keys are `p99_ttft_ms`,
  `p99.9_ttft_ms`. Failed requests are counted, never silently dropped.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from tokenfab.bench.timing import RequestRecord

METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True, slots=True)
class Bucket:
    low: int          # inclusive
    high: int | None  # inclusive; None = no upper bound

    @property
    def label(self) -> str:
        return f"{self.low}-{self.high}" if self.high is not None else f">{self.low - 1}"

    def holds(self, n: int) -> bool:
        return n >= self.low and (self.high is None or n <= self.high)


def make_buckets(edges: list[int]) -> list[Bucket]:
    """Edges 128,512 → [1-128], [129-512], [>512]."""
    if any(e < 1 for e in edges) or sorted(set(edges)) != list(edges):
        raise ValueError(f"bucket edges {edges} must be increasing positive token counts, e.g. 128,512,2048,8192")
    lows = [1] + [e + 1 for e in edges]
    return [Bucket(lo, hi) for lo, hi in zip(lows, list(edges) + [None])]


def pkey(p: float) -> str:
    return f"p{int(p) if float(p).is_integer() else p}"


def parse_slos(items: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` → {"ttft": 500.0, "tpot": 50.0} (ms)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, _, value = item.partition(":")
        if name not in SLO_METRICS or not value:
            raise ValueError(f"goodput SLO {item!r}: expected ttft:MS, tpot:MS or e2el:MS")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"goodput SLO {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] <= 0:
            raise ValueError(f"goodput SLO {item!r} must be a positive number of milliseconds")
    return slos


def meets_slos(rec: RequestRecord, slos: dict[str, float]) -> bool:
    if not rec.success:
        return False
    values = {"ttft": rec.ttft_ms, "tpot": rec.tpot_ms or 0.0, "e2el": rec.e2el_ms}
    return all(values[m] <= limit for m, limit in slos.items())


def metric_stats(name: str, values: list[float], percentiles: list[float]) -> dict[str, float | None]:
    arr = np.asarray(values, dtype=float)
    out: dict[str, float | None] = {}
    have = arr.size > 0
    out[f"mean_{name}_ms"] = float(arr.mean()) if have else None
    out[f"median_{name}_ms"] = float(np.median(arr)) if have else None
    out[f"std_{name}_ms"] = float(arr.std()) if have else None
    for p in percentiles:
        out[f"{pkey(p)}_{name}_ms"] = float(np.percentile(arr, p)) if have else None
    return out


def latency_stats(records: list[RequestRecord], percentiles: list[float]) -> dict[str, float | None]:
    ok = [r for r in records if r.success]
    series = {
        "ttft": [r.ttft_ms for r in ok],
        "tpot": [r.tpot_ms for r in ok if r.tpot_ms is not None],
        "itl": [x for r in ok for x in r.itl_ms],
        "e2el": [r.e2el_ms for r in ok],
    }
    out: dict[str, float | None] = {}
    for m in METRICS:
        out.update(metric_stats(m, series[m], percentiles))
    return out


def summarize(records: list[RequestRecord], duration_s: float, percentiles: list[float],
              slos: dict[str, float]) -> dict[str, float | int | None]:
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    dur = duration_s if duration_s > 0 else math.nan
    lags = np.asarray([r.send_lag_ms for r in records], dtype=float)
    client_lags = np.asarray([r.send_lag_ms - r.slot_wait_ms for r in records], dtype=float)
    good = sum(meets_slos(r, slos) for r in ok) if slos else None
    summary: dict[str, float | int | None] = {
        "duration_s": duration_s,
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
        "request_goodput": (good / dur) if good is not None else None,
        "good_requests": good,
        "max_concurrent_requests": max_concurrency(records),
        "mean_send_lag_ms": float(lags.mean()) if lags.size else None,
        "p99_send_lag_ms": float(np.percentile(lags, 99)) if lags.size else None,
        "max_send_lag_ms": float(lags.max()) if lags.size else None,
        "mean_client_lag_ms": float(client_lags.mean()) if client_lags.size else None,
        "max_client_lag_ms": float(client_lags.max()) if client_lags.size else None,
    }
    summary.update(latency_stats(records, percentiles))
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in summary.items()}


def bucket_summaries(records: list[RequestRecord], buckets: list[Bucket], percentiles: list[float],
                     slos: dict[str, float]) -> list[dict]:
    out = []
    for b in buckets:
        inside = [r for r in records if b.holds(r.prompt_len)]
        ok = [r for r in inside if r.success]
        row = {"bucket": b.label, "low": b.low, "high": b.high, "num_requests": len(inside),
               "completed": len(ok), "failed": len(inside) - len(ok),
               "good_requests": sum(meets_slos(r, slos) for r in ok) if slos else None}
        row.update(latency_stats(inside, percentiles))
        out.append(row)
    return out


def error_summary(records: list[RequestRecord]) -> list[dict]:
    """Failures grouped by message, most frequent first."""
    counts = Counter(r.error for r in records if not r.success)
    return [{"error": e, "count": n} for e, n in counts.most_common()]


def max_concurrency(records: list[RequestRecord]) -> int:
    """The most requests in flight at once, from their send and end times."""
    edges = []
    for r in records:
        edges += [(r.sent_s, 1), (max(r.end_s, r.sent_s), -1)]
    live = peak = 0
    for _, d in sorted(edges, key=lambda e: (e[0], e[1])):  # ends before starts at the same instant
        live += d
        peak = max(peak, live)
    return peak
