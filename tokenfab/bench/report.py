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
    unit = "sessions" if run.get("sessions") else "req"     # the agent workload's arrivals are sessions
    title = (f"Serving benchmark · rate {fmt_rate(run['request_rate'])} {unit}/s · burstiness {run['burstiness']:g}"
             f" · max concurrency {run['max_concurrency'] or '∞'}" + (" sessions" if run.get("sessions") else ""))
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


def session_tables(sessions: dict, percentiles: list[float]) -> list[Table]:
    """The agent workload's figures: TTFT by turn index, session times, tokens re-sent and new."""
    ps = [pkey(p) for p in percentiles]
    t = Table(title="TTFT by turn (ms)", title_justify="left")
    for col in ["Turn", "Requests", "Failed", "Mean prompt tok", "Mean new tok", "Mean"] + [p.upper() for p in ps]:
        t.add_column(col, justify="right")
    for row in sessions["by_turn"]:
        t.add_row(str(row["turn"]), str(row["requests"]), str(row["requests"] - row["completed"]),
                  num(row["mean_prompt_tokens"], 0), num(row["mean_new_tokens"], 0), num(row["mean_ttft_ms"]),
                  *[num(row[f"{p}_ttft_ms"]) for p in ps])
    s = Table(title="Sessions", show_header=False, title_justify="left")
    s.add_column(style="bold")
    s.add_column(justify="right")
    cache = sessions["prefix_cache"]
    share = sessions["resent_share"]
    rows = [
        ("Sessions completed / failed", f"{sessions['completed']} / {sessions['failed']}"),
        ("Session time mean / " + " / ".join(p.upper() for p in ps) + " (s)",
         " / ".join(num(v / 1e3 if v is not None else None) for v in
                    [sessions["mean_session_ms"]] + [sessions[f"{p}_session_ms"] for p in ps])),
        ("Prompt tokens sent (history re-sent included)", num(sessions["prompt_tokens"])),
        ("  of which new (not sent before in the run)", num(sessions["new_tokens"])),
        ("  re-sent share (an ideal prefix cache's hit rate)", "–" if share is None else f"{share:.1%}"),
        ("Server prefix-cache hit rate (/metrics)",
         "not reported" if cache is None or cache["hit_rate"] is None
         else f"{cache['hit_rate']:.1%}  ({cache['hits']:,} of {cache['queries']:,} tokens)"),
    ]
    if sessions["server_prompt_tokens"] is not None:
        rows.insert(3, ("  as the server counted them", num(sessions["server_prompt_tokens"])))
    for name, value in rows:
        s.add_row(name, value)
    return [t, s]


def print_result(console: Console, result: dict) -> None:
    cfg = result["config"]
    for run in result["runs"]:
        for table in run_tables(run, cfg["percentiles"], cfg["goodput"]):
            console.print(table)
        if run.get("sessions"):
            for table in session_tables(run["sessions"], cfg["percentiles"]):
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


# -- bench soak -------------------------------------------------------------------------------

def _mib(v) -> str:
    return "–" if v is None else f"{v / (1 << 20):,.1f}"


def _check_cells(c: dict) -> tuple[str, str]:
    """A drift check's value and limit, in its unit: MiB/hour, a change in %, a share in %, or a count."""
    v, limit, name = c["value"], c["limit"], c["name"]
    if name == "rss_slope":
        return ("–" if v is None else f"{v:+.2f} MiB/h"), f"{limit:g} MiB/h"
    if name in ("p99_ttft", "p99_tpot"):
        return ("–" if v is None else f"{v * 100:+.1f} %"), f"+{limit * 100:g} %"
    if name == "error_rate":
        return ("–" if v is None else f"{v * 100:.2f} %"), f"{limit * 100:g} %"
    return ("–" if v is None else f"{v:g}"), f"{limit:g}"


def _kv_part(s: dict) -> str:
    kv = s.get("kv_resident_bytes")
    return "" if kv is None else f" ({_mib(kv)} of it the KV pool's used pages)"


def window_line(w: dict, total: int) -> str:
    """One line per finished window, for the live display of a long soak."""
    lat, s = w["latency"], w["server"]
    return (f"window {w['index'] + 1}/{total}: {w['requests']} requests, {w['failed']} failed, "
            f"{w['aborted']} hung up · P99 TTFT {num(lat['p99_ttft_ms'], 1)} ms, TPOT {num(lat['p99_tpot_ms'], 1)} ms"
            f" · idle: RSS {_mib(s['rss_bytes'])} MiB{_kv_part(s)}, {s['threads'] if s['threads'] is not None else '–'} threads, "
            f"{s['open_fds'] if s['open_fds'] is not None else '–'} fds, KV blocks "
            f"{s['kv_used_blocks'] if s['kv_used_blocks'] is not None else '–'}"
            + ("" if s["idle"] is not False else " (not idle)"))


def _verdict_cell(passed) -> str:
    return "[dim]not measured[/dim]" if passed is None else "[green]holds[/green]" if passed else "[red]FAILS[/red]"


def soak_tables(result: dict) -> list[Table]:
    """The windows, the drift checks, and the failures by status, from a soak's JSON result."""
    cfg = result["config"]
    warm = cfg["thresholds"]["warmup_windows"]
    t = Table(title=f"Soak windows · {cfg['window_s']:g} s each · max concurrency {cfg['max_concurrency']} · "
                    f"rate {fmt_rate(cfg['request_rate'])} req/s", title_justify="left")
    for col in ["#", "End (s)", "Requests", "Failed", "Hung up", "TTFT P50", "TTFT P99", "TPOT P99", "E2E P99",
                "RSS MiB", "KV pages MiB", "Threads", "FDs", "KV idle", "Window"]:
        t.add_column(col, justify="right" if col != "Window" else "left")
    for w in result["windows"]:
        lat, s = w["latency"], w["server"]
        state = "warm-up" if w["index"] < warm else _verdict_cell(w["holds"])
        t.add_row(str(w["index"] + 1), num(s["t_s"], 0), str(w["requests"]), str(w["failed"]), str(w["aborted"]),
                  num(lat.get("p50_ttft_ms"), 1), num(lat["p99_ttft_ms"], 1), num(lat["p99_tpot_ms"], 1),
                  num(lat["p99_e2el_ms"], 1), _mib(s["rss_bytes"]), _mib(s.get("kv_resident_bytes")), num(s["threads"]), num(s["open_fds"]),
                  num(s["kv_used_blocks"]) + ("" if s["idle"] is not False else " (busy)"), state)
    start = result["start"]
    t.caption = (f"before the load: RSS {_mib(start['rss_bytes'])} MiB, KV blocks in use "
                 f"{num(start['kv_used_blocks'])}; server figures from {start['source']}")

    d = Table(title="Drift · " + ("[green]PASSED[/green]" if result["drift"]["passed"] else "[red]FAILED[/red]"),
              title_justify="left")
    for col in ["Check", "Value", "Limit", "Result", "Detail"]:
        d.add_column(col, justify="right" if col in ("Value", "Limit") else "left")
    for c in result["drift"]["checks"]:
        d.add_row(c["name"], *_check_cells(c), _verdict_cell(c["passed"]), c["detail"])
    tables = [t, d]
    errors: dict[str, int] = {}
    for w in result["windows"]:
        for status, n in w["errors"].items():
            errors[status] = errors.get(status, 0) + n
    if errors:
        e = Table(title="Failures by status", title_justify="left")
        e.add_column("Status")
        e.add_column("Count", justify="right")
        for status, n in sorted(errors.items(), key=lambda kv: -kv[1]):
            e.add_row(status, str(n))
        tables.append(e)
    return tables
