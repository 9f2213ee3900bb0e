"""PNG plots of bench results: latency CDFs, per-bucket P50/P99 bars, sweep curves, and the agent
workload's TTFT by turn.

Everything is drawn from the JSON form of a result, so plots can be made again later from a
saved file (`bench compare --plot` overlays several). CDFs need the per-request records.
"""
from __future__ import annotations

import math
import os

import numpy as np

from tokenfab.bench.aggregate import pkey
from tokenfab.bench.report import NAMES, fmt_rate

_CDF_METRICS = ("ttft", "tpot", "itl", "e2el")


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt
    return plt


def _series(run: dict, metric: str) -> list[float]:
    ok = [r for r in run["requests"] if r["success"]]
    if metric == "itl":
        return [x for r in ok for x in r["itl_ms"]]
    return [r[f"{metric}_ms"] for r in ok if r[f"{metric}_ms"] is not None]


def latency_cdfs(runs: list[tuple[str, dict]], path: str) -> str | None:
    """One panel per metric, one line per (label, run)."""
    if not any(run["requests"] for _, run in runs):
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, m in zip(axes.flat, _CDF_METRICS):
        for label, run in runs:
            x = np.sort(np.asarray(_series(run, m), dtype=float))
            if x.size:
                ax.plot(x, np.arange(1, x.size + 1) / x.size, label=label, drawstyle="steps-post")
        ax.set_title(f"{NAMES[m]} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of " + ("tokens" if m == "itl" else "requests"))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def bucket_bars(run: dict, percentiles: list[float], path: str, title: str = "") -> str | None:
    """P50 and the highest percentile of TTFT, TPOT and E2E per prompt-length bucket."""
    buckets = [b for b in run["buckets"] if b["completed"]]
    if not buckets:
        return None
    plt = _pyplot()
    lo, hi = (50.0 if 50.0 in percentiles else min(percentiles)), max(percentiles)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    x = np.arange(len(buckets))
    for ax, m in zip(axes, ("ttft", "tpot", "e2el")):
        for k, (p, shift) in enumerate(((lo, -0.2), (hi, 0.2))):
            vals = [b[f"{pkey(p)}_{m}_ms"] or 0.0 for b in buckets]
            ax.bar(x + shift, vals, width=0.4, label=pkey(p).upper())
        ax.set_xticks(x, [f"{b['bucket']}\n(n={b['completed']})" for b in buckets], fontsize=8)
        ax.set_title(f"{NAMES[m]} by prompt length")
        ax.set_ylabel("ms")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def sweep_curves(result: dict, path: str) -> str | None:
    """Achieved throughput and tail latency against the offered request rate."""
    runs = [r for r in result["runs"] if r["request_rate"] != "inf"]
    if len(runs) < 2:
        return None
    plt = _pyplot()
    k = pkey(max(result["config"]["percentiles"]))
    rates = [float(r["request_rate"]) for r in runs]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    a.plot(rates, [r["summary"]["request_throughput"] or 0 for r in runs], "o-", label="achieved req/s")
    a.plot(rates, rates, ":", color="grey", label="offered")
    sat = result["sweep"].get("saturation_request_rate")
    if sat:
        a.axhline(sat, color="red", alpha=0.4, label=f"saturation {sat:.2f} req/s")
    a.set_xlabel("offered request rate (req/s)")
    a.set_ylabel("requests/s")
    tok = a.twinx()
    tok.plot(rates, [r["summary"]["output_throughput"] or 0 for r in runs], "s--", color="tab:green",
             label="output tok/s")
    tok.set_ylabel("output tokens/s")
    a.legend(loc="upper left", fontsize=8)
    tok.legend(loc="lower right", fontsize=8)
    a.set_title("Throughput against offered rate")
    for m in ("ttft", "tpot", "e2el"):
        b.plot(rates, [r["summary"][f"{k}_{m}_ms"] or math.nan for r in runs], "o-", label=f"{NAMES[m]} {k.upper()}")
    b.set_yscale("log")
    b.set_xlabel("offered request rate (req/s)")
    b.set_ylabel("ms")
    b.set_title(f"{k.upper()} latency against offered rate")
    b.legend(fontsize=8)
    b.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def ttft_by_turn(runs: list[tuple[str, dict]], percentiles: list[float], path: str) -> str | None:
    """The agent workload's TTFT against the turn index: P50 and the highest percentile, per run."""
    runs = [(label, run) for label, run in runs if run.get("sessions") and run["sessions"]["by_turn"]]
    if not runs:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    lo, hi = (50.0 if 50.0 in percentiles else min(percentiles)), max(percentiles)
    for label, run in runs:
        rows = run["sessions"]["by_turn"]
        turns = [r["turn"] for r in rows]
        for p, style in ((lo, "o-"), (hi, "s--")):
            ax.plot(turns, [r[f"{pkey(p)}_ttft_ms"] if r[f"{pkey(p)}_ttft_ms"] is not None else math.nan for r in rows],
                    style, label=f"{label} {pkey(p).upper()}")
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("TTFT by turn of a session")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_result(result: dict, out_dir: str) -> list[str]:
    """All plots of one result file into `out_dir`; returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    pcts = result["config"]["percentiles"]
    runs = result["runs"]
    written = [latency_cdfs([(f"rate {fmt_rate(r['request_rate'])}", r) for r in runs],
                            os.path.join(out_dir, "latency_cdf.png"))]
    for i, run in enumerate(runs):
        name = "buckets.png" if len(runs) == 1 else f"buckets_run{i}_rate-{fmt_rate(run['request_rate'])}.png"
        written.append(bucket_bars(run, pcts, os.path.join(out_dir, name),
                                   f"rate {fmt_rate(run['request_rate'])} req/s"))
    written.append(sweep_curves(result, os.path.join(out_dir, "sweep.png")))
    written.append(ttft_by_turn([(f"rate {fmt_rate(r['request_rate'])}", r) for r in runs], pcts,
                                os.path.join(out_dir, "ttft_by_turn.png")))
    return [p for p in written if p]


def plot_compare(labelled: list[tuple[str, dict]], out_dir: str) -> list[str]:
    """Latency CDFs of several runs (one per file) overlaid."""
    os.makedirs(out_dir, exist_ok=True)
    path = latency_cdfs(labelled, os.path.join(out_dir, "compare_latency_cdf.png"))
    return [path] if path else []


def soak_windows(result: dict, path: str) -> str | None:
    """A soak's windows against time: P99 latencies, idle RSS with its fitted slope, and threads,
    descriptors and idle KV blocks."""
    windows = result["windows"]
    if not windows:
        return None
    plt = _pyplot()
    warm = result["config"]["thresholds"]["warmup_windows"]
    t_min = [w["server"]["t_s"] / 60 for w in windows]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.2))
    for m in ("ttft", "tpot", "e2el"):
        a.plot(t_min, [w["latency"][f"p99_{m}_ms"] or math.nan for w in windows], "o-", label=f"{NAMES[m]} P99")
    a.set_yscale("log")
    a.set_ylabel("ms")
    a.set_title("P99 latency per window")
    rss = [w["server"]["rss_bytes"] for w in windows]
    if any(r is not None for r in rss):
        b.plot(t_min, [r / (1 << 20) if r is not None else math.nan for r in rss], "o-", label="idle RSS")
        slope = next((ch for ch in result["drift"]["checks"] if ch["name"] == "rss_slope"), None)
        fitted = [(t, r / (1 << 20)) for t, r in zip(t_min[warm:], rss[warm:]) if r is not None]
        if slope and slope["value"] is not None and len(fitted) >= 2:
            xs, ys = np.array([x for x, _ in fitted]), np.array([y for _, y in fitted])
            line = ys.mean() + slope["value"] / 60 * (xs - xs.mean())
            b.plot(xs, line, "--", color="tab:red", label=f"fit {slope['value']:+.2f} MiB/h")
        b.legend(fontsize=8)
    b.set_ylabel("MiB")
    b.set_title("Server RSS when idle")
    for key, label in (("threads", "threads"), ("open_fds", "open fds"), ("kv_used_blocks", "KV blocks in use")):
        vals = [w["server"][key] for w in windows]
        if any(v is not None for v in vals):
            c.plot(t_min, [v if v is not None else math.nan for v in vals], "o-", label=label)
    c.set_title("Threads, descriptors, KV blocks when idle")
    if c.get_legend_handles_labels()[0]:
        c.legend(fontsize=8)
    for ax in (a, b, c):
        ax.set_xlabel("minutes since start")
        ax.grid(alpha=0.3)
        if warm:
            ax.axvspan(0, t_min[warm - 1], color="grey", alpha=0.12)
    if a.get_legend_handles_labels()[0]:
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
