"""What a person sees: the live progress display and the result tables (rich)."""
from __future__ import annotations

import math

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from tokenfab.bench.aggregate import METRICS, pkey

NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E latency"}


def fmt_rate(rate) -> str:
    return "inf" if rate == "inf" or (isinstance(rate, float) and math.isinf(rate)) else f"{float(rate):g}"


def num(v, digits: int = 2) -> str:
    if v is None:
        return "–"
    if isinstance(v, int):
        return f"{v:,}"
    return f"{v:,.{digits}f}"


class LiveProgress:
    """One progress bar per run, with the count of failures so far."""

    def __init__(self, console: Console):
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TextColumn("[red]{task.fields[failed]} failed"),
                                 TimeElapsedColumn(), console=console)
        self._failed: dict = {}

    def __enter__(self):
        self.progress.start()
        return self

    def __exit__(self, *exc):
        self.progress.stop()

    def start_run(self, rate: float, total: int):
        return self.progress.add_task(f"rate {fmt_rate(rate)} req/s", total=total, failed=0)

    def advance(self, task, raw) -> None:
        self._failed[task] = self._failed.get(task, 0) + (raw.error is not None)
        self.progress.update(task, advance=1, failed=self._failed[task])


def run_tables(run: dict, percentiles: list[float], slos: dict) -> list[Table]:
    """Summary, latency, per-bucket and error tables for one run (its JSON form)."""
    s = run["summary"]
    title = (f"Serving benchmark · rate {fmt_rate(run['request_rate'])} req/s · burstiness {run['burstiness']:g}"
             f" · max concurrency {run['max_concurrency'] or '∞'}")
    summary = Table(title=title, show_header=False, title_justify="left")
    summary.add_column(style="bold")
    summary.add_column(justify="right")
    rows = [
        ("Requests completed / failed", f"{s['completed']} / {s['failed']}"),
        ("Duration (s)", num(s["duration_s"])),
        ("Input / output tokens", f"{s['total_input_tokens']:,} / {s['total_output_tokens']:,}"),
        ("Request throughput (req/s)", num(s["request_throughput"])),
        ("Output token throughput (tok/s)", num(s["output_throughput"])),
        ("Total token throughput (tok/s)", num(s["total_token_throughput"])),
    ]
    if slos:
        what = " ".join(f"{k}:{v:g}" for k, v in slos.items())
        rows.append((f"Goodput, {what} ms (req/s)", f"{num(s['request_goodput'])}  ({s['good_requests']} good)"))
    rows += [
        ("Max concurrent requests", str(s["max_concurrent_requests"])),
        ("Send lag mean / P99 / max (ms)",
         f"{num(s['mean_send_lag_ms'])} / {num(s['p99_send_lag_ms'])} / {num(s['max_send_lag_ms'])}"),
        ("  of which client lag mean / max (ms)", f"{num(s['mean_client_lag_ms'])} / {num(s['max_client_lag_ms'])}"),
    ]
    if run.get("warmup_failed"):
        rows.append(("Warm-up requests failed", str(run["warmup_failed"])))
    for name, value in rows:
        summary.add_row(name, value)

    lat = Table(title="Latency (ms)", title_justify="left")
    lat.add_column("Metric", style="bold")
    for col in ["Mean"] + [pkey(p).upper() for p in percentiles]:
        lat.add_column(col, justify="right")
    for m in METRICS:
        lat.add_row(NAMES[m], num(s[f"mean_{m}_ms"]), *[num(s[f"{pkey(p)}_{m}_ms"]) for p in percentiles])

    tables = [summary, lat, bucket_table(run["buckets"], percentiles)]
    if run["errors"]:
        err = Table(title="Failures", title_justify="left")
        err.add_column("Count", justify="right")
        err.add_column("Error")
        for e in run["errors"]:
            err.add_row(str(e["count"]), e["error"])
        tables.append(err)
    return tables


def bucket_table(buckets: list[dict], percentiles: list[float]) -> Table:
    ps = sorted({min(percentiles), max(percentiles)})
    t = Table(title="Per prompt-length bucket (ms)", title_justify="left")
    t.add_column("Prompt tokens", style="bold", no_wrap=True)
    t.add_column("Requests", justify="right")
    t.add_column("Failed", justify="right")
    for m in ("ttft", "tpot", "e2el"):
        for p in ps:
            t.add_column(f"{NAMES[m].split()[0]} {pkey(p).upper()}", justify="right")
    for b in buckets:
        if b["num_requests"]:
            t.add_row(b["bucket"], str(b["num_requests"]), str(b["failed"]),
                      *[num(b[f"{pkey(p)}_{m}_ms"]) for m in ("ttft", "tpot", "e2el") for p in ps])
    return t


def sweep_table(result: dict) -> Table:
    p = max(result["config"]["percentiles"])
    k = pkey(p)
    t = Table(title=f"Sweep ({result['sweep']['mode']})", title_justify="left")
    for col in ["Offered req/s", "Achieved req/s", "Output tok/s", "Goodput req/s", f"TTFT {k.upper()}",
                f"TPOT {k.upper()}", f"E2E {k.upper()}", "Failed", "Mean send lag"]:
        t.add_column(col, justify="right")
    for run in result["runs"]:
        s = run["summary"]
        t.add_row(fmt_rate(run["request_rate"]), num(s["request_throughput"]), num(s["output_throughput"], 1),
                  num(s["request_goodput"]), num(s[f"{k}_ttft_ms"], 1), num(s[f"{k}_tpot_ms"], 1),
                  num(s[f"{k}_e2el_ms"], 1), str(s["failed"]), num(s["mean_send_lag_ms"], 1))
    sat = result["sweep"].get("saturation_request_rate")
    if sat is not None:
        t.caption = f"saturation: {sat:.2f} req/s (the most requests/s any run completed)"
    return t


def print_result(console: Console, result: dict) -> None:
    cfg = result["config"]
    for run in result["runs"]:
        for table in run_tables(run, cfg["percentiles"], cfg["goodput"]):
            console.print(table)
        console.print()
    if len(result["runs"]) > 1:
        console.print(sweep_table(result))
    spec = result.get("spec_decode")
    if spec:
        per_pos = ", ".join(f"{a:.2f}" for a in spec["acceptance_rate_per_pos"] if a is not None)
        console.print(f"speculative decoding (server /metrics): acceptance rate {spec['acceptance_rate']:.3f} "
                      f"({spec['num_accepted_tokens']} of {spec['num_draft_tokens']} draft tokens), "
                      f"mean accepted length {num(spec['mean_accepted_length'])}"
                      + (f", per position {per_pos}" if per_pos else ""))
