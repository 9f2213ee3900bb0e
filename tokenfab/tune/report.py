"""What `tokenfab tune` shows and writes: the design-space table, its plot, and the serve config file."""
from __future__ import annotations

import math
from pathlib import Path

from rich.table import Table

from tokenfab.tune.search import PointResult, Scorer
from tokenfab.tune.targets import Targets

MAX_ROWS = 40


def _num(v, digits: int = 1) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:,.{digits}f}"


def verdict(r: PointResult) -> str:
    if r.metrics is None and not r.checks:
        return r.note
    bad = r.failing()
    if not bad:
        return "[green]meets all[/]" if r.metrics is not None else r.note
    return "[red]" + ", ".join(f"{c.name} +{c.excess:.0%}" if math.isfinite(c.excess) else c.name
                               for c in bad) + "[/]"


def design_table(results: list[PointResult], scorer: Scorer, chosen: PointResult | None,
                 baseline: PointResult | None) -> Table:
    cost = scorer.usd_per_hour is not None
    t = Table(title="Design space: measured and predicted points (best first)", title_justify="left")
    for col in ("weights", "KV", "threads", "seqs", "budget", "chunk", "spec", "source", "mean KL", "top-1 %",
                "P99 TTFT ms", "P99 TPOT ms", "goodput req/s", "$ / M tok" if cost else "goodput / core", "verdict"):
        t.add_column(col, justify="left" if col in ("weights", "KV", "source", "verdict") else "right")
    ranked = sorted(results, key=lambda r: (r.metrics is None, not r.meets, -r.score))
    shown = ranked[:MAX_ROWS] + [r for r in (chosen, baseline) if r is not None and r not in ranked[:MAX_ROWS]]
    for r in shown:
        p, m, q = r.point, r.metrics or {}, r.quality or {}
        mark = " ★" if r is chosen else (" (default)" if r is baseline else "")
        value = (_num(scorer.cost_per_mtok(p, m), 3) if cost else _num(scorer(p, m), 3)) if r.metrics else "-"
        t.add_row(p.weights + mark, p.kv_cache_dtype, str(p.num_threads), str(p.max_num_seqs),
                  str(p.max_num_batched_tokens), "on" if p.enable_chunked_prefill else "off",
                  "ngram" if p.speculative else "off", r.source,
                  "-" if "kl_mean" not in q else f"{q['kl_mean']:.2e}", _num(q.get("same_top1_pct"), 1),
                  _num(m.get("p99_ttft_ms")), _num(m.get("p99_tpot_ms"), 2), _num(m.get("goodput"), 3), value,
                  verdict(r))
    if len(ranked) > MAX_ROWS:
        t.caption = f"{len(ranked) - MAX_ROWS} more points in the results file"
    return t


def plot_design_space(results: list[PointResult], targets: Targets, chosen: PointResult | None, path: str | Path,
                      scorer: Scorer) -> str:
    """Two panels: P99 TTFT against P99 TPOT with the latency targets, and quality against the score
    with the quality floor; measured points filled, predicted ones hollow, the chosen one starred."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5))
    colors = {"meets": "#2a9d4b", "latency": "#d1495b", "quality": "#8a5cb8"}
    for r in results:
        if r.metrics is None:
            continue
        names = {c.name for c in r.failing()}
        kind = "meets" if not names else ("quality" if names <= {"mean KL", "same top-1"} else "latency")
        filled = r.source == "measured"
        style = dict(s=36, edgecolors=colors[kind], facecolors=colors[kind] if filled else "none")
        ttft, tpot = r.metrics.get("p99_ttft_ms"), r.metrics.get("p99_tpot_ms")
        if ttft is not None and tpot is not None:
            ax1.scatter(ttft, tpot, **style)
        q = r.quality or {}
        y = q.get("same_top1_pct") if targets.min_top1 is not None else q.get("kl_mean")
        if y is not None:
            x = -r.score if scorer.usd_per_hour is not None else r.score
            ax2.scatter(x, y, **style)
    if chosen is not None and chosen.metrics:
        ax1.scatter(chosen.metrics["p99_ttft_ms"], chosen.metrics["p99_tpot_ms"], marker="*", s=260,
                    color="#f4a259", edgecolors="black", zorder=5, label=f"chosen: {chosen.point.label()}")
    if targets.p99_ttft_ms is not None:
        ax1.axvline(targets.p99_ttft_ms, color="gray", linestyle="--", label="P99 TTFT target")
    if targets.p99_tpot_ms is not None:
        ax1.axhline(targets.p99_tpot_ms, color="gray", linestyle=":", label="P99 TPOT target")
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax1.set_xlabel("P99 TTFT (ms)")
    ax1.set_ylabel("P99 TPOT (ms)")
    ax1.set_title("latency: green meets every target, red misses one; hollow = predicted")
    for name, c in colors.items():
        ax1.scatter([], [], color=c, label={"meets": "meets all", "latency": "misses latency",
                                            "quality": "below the quality floor"}[name])
    ax1.legend(fontsize=7, loc="best")
    floor = targets.min_top1 if targets.min_top1 is not None else targets.max_kl
    if floor is not None:
        ax2.axhline(floor, color="gray", linestyle="--", label="quality floor")
        ax2.legend(fontsize=7)
    ax2.set_xlabel("$ per million good output tokens" if scorer.usd_per_hour is not None else "goodput per core (req/s)")
    ax2.set_ylabel("same top-1 (%)" if targets.min_top1 is not None else "mean KL vs full precision")
    ax2.set_title("quality against what a point delivers")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def write_serve_config(path: str | Path, result: PointResult, model: str | None, comment: str) -> str:
    """The point as a `tokenfab serve --config` file (server/config_file.py reads it)."""
    import yaml
    flags = ({"model": model} if model else {}) | result.point.serve_flags()
    header = "".join(f"# {line}\n" for line in comment.splitlines())
    Path(path).write_text(header + yaml.safe_dump(flags, sort_keys=False, default_flow_style=False))
    return str(path)
