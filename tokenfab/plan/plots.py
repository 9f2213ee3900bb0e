"""PNG charts for `tokenfab plan ... --plot PATH` (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

import numpy as np


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _plt().close(fig)
    return path


def roofline_plot(path: str, title: str, peak: float, bw: float, eff_compute: float, eff_bw: float,
                  points: list[tuple[str, float, float]], batches: list[int], tok_s: list[float],
                  step_ms: list[float]) -> str:
    """Left: the roofline (spec and with efficiencies) with each phase at its arithmetic intensity
    and attained FLOP/s. Right: decode tok/s and step time against batch size."""
    plt = _plt()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    xs = [p[1] for p in points]
    lo, hi = min(xs + [1.0]) / 4, max(xs + [peak / bw]) * 8
    x = np.geomspace(lo, hi, 200)
    ax.loglog(x, np.minimum(peak, bw * x) / 1e12, "k--", lw=1, label="spec-sheet roof")
    ax.loglog(x, np.minimum(peak * eff_compute, bw * eff_bw * x) / 1e12, "k-", lw=2,
              label=f"ceiling (bw {eff_bw:.0%}, compute {eff_compute:.0%})")
    for label, intensity, flops_s in points:
        ax.loglog([intensity], [flops_s / 1e12], "o", ms=7, label=label)
    ax.set_xlabel("arithmetic intensity (FLOPs / byte)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    ax2.plot(batches, tok_s, "o-", color="tab:blue")
    ax2.set_xscale("log", base=2)
    ax2.xaxis.set_major_formatter(_plt().matplotlib.ticker.ScalarFormatter())
    ax2.set_xlabel("decode batch size")
    ax2.set_ylabel("decode tok/s (ceiling)", color="tab:blue")
    ax3 = ax2.twinx()
    ax3.plot(batches, step_ms, "s--", color="tab:red")
    ax3.set_ylabel("step time (ms)", color="tab:red")
    ax2.grid(True, alpha=0.3)
    ax2.set_title("decode: throughput and step time against batch", fontsize=10)
    return _save(fig, path)


def memory_plot(path: str, title: str, options: list[dict]) -> str:
    """Stacked per-device memory for each tensor-parallel degree against the device's capacity."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = [f"TP={o['tp']}" for o in options]
    parts = [("weights", "tab:blue"), ("activations", "tab:orange"), ("overhead", "tab:gray"),
             ("kv_budget", "tab:green")]
    bottom = np.zeros(len(options))
    for key, color in parts:
        vals = np.array([o[key] / 1e9 for o in options])
        ax.bar(labels, vals, bottom=bottom, color=color, label=key.replace("_", " "))
        bottom += vals
    if options:
        ax.axhline(options[0]["capacity"] / 1e9, color="k", ls="--", lw=1, label="device memory")
    ax.set_ylabel("GB per device")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, path)


def compare_plot(path: str, title: str, rows: list[dict]) -> str:
    """Bars per hardware: output tok/s, tok/s per W, and $ per million output tokens."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    names = [r["hardware"] for r in rows]
    for ax, key, label in zip(axes, ("tok_s", "tok_s_per_w", "usd_per_m_output"),
                              ("output tok/s", "tok/s per W", "$ per million output tokens")):
        vals = [r.get(key) for r in rows]
        ax.bar(names, [v or 0.0 for v in vals], color="tab:blue")
        for i, v in enumerate(vals):
            if v is None:       # no price or TDP in the catalog: say so rather than draw a zero
                ax.text(i, 0, "n/a", ha="center", va="bottom", fontsize=8, color="gray")
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="x", rotation=45, labelsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def capacity_plot(path: str, title: str, evals: list[dict], slo: dict[tuple[str, float], float],
                  chosen: int | None) -> str:
    """Online P-latencies against replica count, with the SLO targets and the chosen count."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    simulated = [e for e in evals if e["online"]]
    for (metric, pct), target in slo.items():
        key = f"p{pct:g}"
        xs = [e["replicas"] for e in simulated]
        ys = [e["online"][metric][key] * 1e3 for e in simulated]
        line, = ax.plot(xs, ys, "o-", label=f"{metric} {key}")
        ax.axhline(target * 1e3, color=line.get_color(), ls=":", lw=1)
    if chosen:
        ax.axvline(chosen, color="k", ls="--", lw=1, label=f"chosen: {chosen}")
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(_plt().matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("replicas")
    ax.set_ylabel("latency (ms)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)
