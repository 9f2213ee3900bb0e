"""`bench compare A.json B.json …`: runs side by side, with each one's ratio to the first.

Serve results are compared on throughput, goodput and latency (overall and per prompt-length
bucket); offline results on prefill and decode tok/s per batch size. A ratio is B/A for the
metric itself, coloured green when B is better (higher throughput, lower latency).
"""
from __future__ import annotations

import os

from rich.table import Table

from tokenfab.bench.aggregate import METRICS, pkey
from tokenfab.bench.report import NAMES, num
from tokenfab.bench.schema import OFFLINE_SCHEMA


def _serve_rows(run: dict, result: dict) -> list[tuple[str, float | None, bool]]:
    """(label, value, higher_is_better) for one run."""
    s = run["summary"]
    top = pkey(max(result["config"]["percentiles"]))
    rows = [("Completed requests", s["completed"], True), ("Failed requests", s["failed"], False),
            ("Request throughput (req/s)", s["request_throughput"], True),
            ("Output throughput (tok/s)", s["output_throughput"], True),
            ("Total token throughput (tok/s)", s["total_token_throughput"], True)]
    if s.get("request_goodput") is not None:
        rows.append(("Goodput (req/s)", s["request_goodput"], True))
    for m in METRICS:
        for stat in ("mean", "median", top):
            rows.append((f"{NAMES[m]} {stat.upper() if stat == top else stat} (ms)", s.get(f"{stat}_{m}_ms"), False))
    rows.append(("Mean send lag (ms)", s["mean_send_lag_ms"], False))
    sat = result.get("sweep", {}).get("saturation_request_rate")
    if sat is not None:
        rows.append(("Saturation rate (req/s)", sat, True))
    for b in run["buckets"]:
        if b["completed"]:
            for m in ("ttft", "e2el"):
                rows.append((f"{NAMES[m].split()[0]} {top.upper()} · prompt {b['bucket']} (ms)", b[f"{top}_{m}_ms"], False))
    return rows


def _offline_rows(result: dict) -> list[tuple[str, float | None, bool]]:
    rows = []
    for r in result["runs"]:
        rows.append((f"Prefill tok/s · batch {r['batch_size']}", r["prefill_tok_s"], True))
        rows.append((f"Decode tok/s · batch {r['batch_size']}", r["decode_tok_s"], True))
    return rows


def compare_table(results: list[dict], labels: list[str], run_index: int = 0) -> Table:
    kinds = {r["schema"] for r in results}
    if len(kinds) != 1:
        raise ValueError("compare serve results with serve results and offline with offline; got a mix")
    if kinds == {OFFLINE_SCHEMA}:
        per_file = [_offline_rows(r) for r in results]
    else:
        per_file = []
        for res, label in zip(results, labels):
            if not -len(res["runs"]) <= run_index < len(res["runs"]):
                raise ValueError(f"{label} has {len(res['runs'])} run(s); --run {run_index} does not exist")
            per_file.append(_serve_rows(res["runs"][run_index], res))
    values = [{name: (v, hib) for name, v, hib in rows} for rows in per_file]
    order = list(dict.fromkeys(name for rows in per_file for name, _, _ in rows))

    t = Table(title="Comparison" + (f" (run {run_index} of each file)" if kinds != {OFFLINE_SCHEMA} else ""),
              title_justify="left")
    t.add_column("Metric", style="bold")
    for i, label in enumerate(labels):
        t.add_column(label, justify="right")
        if i:
            t.add_column(f"{label} / {labels[0]}", justify="right")
    for name in order:
        base = values[0].get(name, (None, True))[0]
        cells = []
        for i, v in enumerate(values):
            value, hib = v.get(name, (None, True))
            cells.append(num(value))
            if i:
                cells.append(_ratio(value, base, hib))
        t.add_row(name, *cells)
    return t


def _ratio(value, base, higher_is_better: bool) -> str:
    if value is None or base is None or base == 0:
        return "–"
    r = value / base
    better = r > 1.02 if higher_is_better else r < 0.98
    worse = r < 0.98 if higher_is_better else r > 1.02
    colour = "green" if better else "red" if worse else "white"
    return f"[{colour}]{r:.2f}×[/{colour}]"


def default_labels(paths: list[str]) -> list[str]:
    stems = [os.path.splitext(os.path.basename(p))[0] for p in paths]
    return stems if len(set(stems)) == len(stems) else [f"{i}:{s}" for i, s in enumerate(stems)]
