"""Human output for `tokenfab plan`: rich tables built from the commands' result dicts."""
from __future__ import annotations

import math

from rich import box
from rich.console import Console
from rich.table import Table

console = Console()


def _gb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e9:,.2f}"


def _ms(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x * 1e3:,.1f}" if x * 1e3 >= 10 else f"{x * 1e3:,.2f}"


def _num(x: float | None, fmt: str = ",.1f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _si(x: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:,.2f} {unit}"
    return f"{x:,.0f}"


def _model_line(m: dict) -> str:
    moe = f", MoE {m['experts']}×(top {m['experts_per_token']})" if m["experts"] > 1 else ""
    d = f" | weights {m['weight_dtype']} {_gb(m['weight_bytes'])} GB, KV {m['kv_dtype']} " \
        f"{m['kv_bytes_per_token'] / 1024:,.0f} KiB/token, activations {m['act_dtype']}" if "weight_dtype" in m else ""
    return f"[bold]{m['name']}[/]: {m['params'] / 1e9:.2f}B params ({m['active_params'] / 1e9:.2f}B active{moe}){d}"


def roofline(r: dict) -> None:
    console.print(_model_line(r["model"]))
    e = r["efficiency"]
    console.print(f"on [bold]{r['hardware']}[/] ×{r['tp']}: peak {_si(r['peak_flops'])}FLOP/s, "
                  f"{r['bandwidth'] / 1e9:,.0f} GB/s; efficiency bw {e['bandwidth']:.0%}, compute {e['compute']:.0%}, "
                  f"overhead {e['step_overhead_ms']:.2f} ms ({e['source']}); ridge {r['ridge_intensity']:,.0f} FLOPs/byte")
    console.print(f"[dim]{r['label']}[/]")
    p = r["prefill"]
    # Light borders and short headers: the table fits an 80-column terminal without wrapping cells.
    t = Table(title=f"phases (decode at {r['decode'][0]['context']} tokens of context per sequence)",
              box=box.SIMPLE_HEAD, pad_edge=False)
    for c in ("phase", "FLOPs", "bytes", "FLOP/B", "bound", "ms", "result"):
        t.add_column(c, justify="right" if c not in ("phase", "bound") else "left", no_wrap=True)
    t.add_row(f"prefill {p['prompt_len']}", _si(p["flops"]), _si(p["bytes"]), _num(p["intensity"]),
              p["bound"], _ms(p["step_s"]), f"TTFT {_ms(p['ttft_s'])} ms")
    for d in r["decode"]:
        t.add_row(f"decode b={d['batch']}", _si(d["flops"]), _si(d["bytes"]),
                  _num(d["intensity"]), d["bound"], _ms(d["step_s"]), f"{d['tok_s']:,.0f} tok/s")
    console.print(t)
    for ctx, b in r["crossover_batch"].items():
        when = f"at batch {b}" if b else "at no batch size (KV reads grow with the batch too)"
        console.print(f"with {ctx} tokens of context, decode turns compute-bound {when}")


def memory(r: dict) -> None:
    console.print(_model_line(r["model"]))
    p = r["plan"]
    s = r["settings"]
    t = Table(title=f"{r['hardware']}: memory per device at {s['context']} tokens of context")
    t.add_column("item")
    t.add_column("GB", justify="right")
    for label, key in (("device memory", "capacity"), (f"usable ({s['memory_utilization']:.0%})", "usable"),
                       ("weights", "weights"), (f"activations ({s['max_num_batched_tokens']}-token step)", "activations"),
                       ("runtime overhead", "overhead"), ("KV pool", "kv_budget")):
        t.add_row(label, _gb(p[key]))
    t.add_row("KV per token", f"{p['kv_per_token'] / 2**10:,.1f} KiB")
    t.add_row("KV per request", _gb(p["kv_per_request"]))
    console.print(t)
    colour = "green" if p["fits"] else "red"
    console.print(f"[{colour}]{'fits' if p['fits'] else 'does not fit'}[/]: {p['reason']} "
                  f"({r['kv_blocks']:,} blocks of {s['block_size']})")
    for w in r["warnings"]:
        console.print(f"[yellow]warning:[/] {w}")
    t = Table(title="tensor-parallel options")
    for c in ("TP", "weights/dev GB", "KV pool/dev GB", "max seqs", "fits", "batch", "step ms", "comm ms",
              "tok/s", "1-stream tok/s"):
        t.add_column(c, justify="right")
    for o in r["tp_options"]:
        m = o["memory"]
        t.add_row(str(o["tp"]), _gb(m["weights"]), _gb(m["kv_budget"]), f"{m['max_seqs']:,}", "yes" if m["fits"] else "no",
                  str(o["batch"]), _ms(o["step_s"]), _ms(o["comm_s"]), _num(o["tok_s"], ",.0f"),
                  _num(o["single_stream_tok_s"], ",.1f"))
    console.print(t)


def compare(r: dict) -> None:
    console.print(_model_line(r["model"]))
    w = r["workload"]
    t = Table(title=f"prompt {w['prompt']}, output {w['output']} tokens; throughput of one saturated replica")
    for c in ("hardware", "TP", "max conc.", "TTFT ms", "1-stream tok/s", "out tok/s", "tok/s/W", "$/h",
              "$/M out", "$/M total"):
        t.add_column(c, justify="left" if c == "hardware" else "right")
    misfits = []
    for row in r["rows"]:
        if not row["fits"]:
            t.add_row(row["hardware"], "[red]no fit[/]", *["-"] * 8)
            misfits.append(f"{row['hardware']} does not fit: {row['reason']}")
            continue
        t.add_row(row["hardware"], str(row["tp"]), str(row["max_concurrent"]), _ms(row["ttft_s"]),
                  _num(row["single_stream_tok_s"]), _num(row["tok_s"], ",.0f"), _num(row.get("tok_s_per_w"), ",.2f"),
                  _num(row.get("usd_per_hour"), ",.2f") + (f" {row['pricing']}" if row.get("pricing") else ""),
                  _num(row.get("usd_per_m_output"), ",.3f"), _num(row.get("usd_per_m_total"), ",.3f"))
    console.print(t)
    for line in misfits:
        console.print(f"[red]{line}[/]")
    a = r["assumptions"]
    console.print(f"[dim]assumptions: {a['years']:g} years amortization, utilization {a['utilization']:.0%}, "
                  f"${a['usd_per_kwh']}/kWh, PUE {a['pue']}, extra ${a['extra_usd_per_hour']}/h per device, "
                  f"pricing {a['pricing']}; power at TDP; {a['throughput']}[/]")


def capacity(r: dict) -> None:
    console.print(_model_line(r["model"]))
    tr = r["traffic"]
    console.print(f"{tr['rate']:g} req/s, prompt {tr['prompt_len']}, output {tr['output_len']}, offline share "
                  f"{tr['offline_share']:.0%}; SLO {r['slo']}; {r['hardware']} ×{r['tp']} per replica; "
                  f"cost model: {r['cost_model']['kind']}")
    console.print(f"one replica saturates at {r['saturation_rate_per_replica']:,.2f} req/s; "
                  f"unloaded TTFT p50 {_ms(r['unloaded']['ttft']['p50'])} ms, TPOT p50 {_ms(r['unloaded']['tpot']['p50'])} ms")
    t = Table(title="replica counts tried (online requests)")
    for c in ("replicas", "req/s each", "utilization", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "meets SLO"):
        t.add_column(c, justify="right")
    for e in r["evaluations"]:
        o = e["online"]
        get = lambda m, p: _ms(o[m][p]) if o else "-"  # noqa: E731
        t.add_row(str(e["replicas"]), _num(e["rate_per_replica"], ",.2f"), f"{e['utilization']:.2f}",
                  get("ttft", "p50"), get("ttft", "p99"), get("tpot", "p50"), get("tpot", "p99"),
                  "[green]yes[/]" if e["meets_slo"] else f"[red]no[/] {'; '.join(e['violations'])}")
    console.print(t)
    if r["replicas"] is None:
        console.print("[red]no replica count up to the limit meets the SLO[/] (latency floor above the target?)")
        return
    console.print(f"[bold green]{r['replicas']} replicas[/] ({r['devices']} devices), utilization {r['utilization']:.2f}")
    c = r.get("cost", {})
    if "unavailable" in c:
        console.print(f"[yellow]cost unavailable:[/] {c['unavailable']}")
    elif c:
        console.print(f"cost: ${c['total']:,.2f}/h ({c['pricing']}) → ${c['usd_per_m_output']:,.3f} per million output "
                      f"tokens, ${c['usd_per_m_total']:,.3f} per million total; {c['note']}")
    if sp := r.get("separate_pools"):
        console.print(f"separate pools would need {sp['online_replicas']} online + {sp['offline_replicas']} offline = "
                      f"{sp['total']} replicas; combined: {sp['combined']}")
    if r.get("emitted"):
        console.print(f"Ray Serve config written to {r['emitted']}: run it with `tokenfab serve --config {r['emitted']}`")


def models(r: dict) -> None:
    t = Table(title="model presets (published config.json numbers)")
    for c in ("name", "params", "active", "layers", "hidden", "heads/kv", "head_dim", "ffn", "vocab", "ctx",
              "KV KiB/tok fp16"):
        t.add_column(c, justify="left" if c == "name" else "right")
    for m in r["presets"]:
        kv = 2 * m["layers"] * m["kv_heads"] * m["head_dim"] * 2 / 1024
        t.add_row(m["name"], f"{m['params'] / 1e9:.2f}B", f"{m['active_params'] / 1e9:.2f}B", str(m["layers"]),
                  str(m["hidden"]), f"{m['heads']}/{m['kv_heads']}", str(m["head_dim"]), str(m["intermediate"]),
                  f"{m['vocab']:,}", f"{m['context_length']:,}", f"{kv:,.0f}")
    console.print(t)


def hardware(r: dict) -> None:
    t = Table(title="hardware catalog")
    for c in ("name", "kind", "GiB", "GB/s", "fp16 TFLOPS", "TDP W", "price $", "$/h", "calibrated", "from"):
        t.add_column(c, justify="left" if c in ("name", "kind", "from") else "right")
    for e in r["entries"]:
        tf = e.get("tflops", {})
        t.add_row(e["name"], e.get("kind", ""), _num(e["memory_gib"], ",.0f"), _num(e["bandwidth_gb_s"], ",.0f"),
                  _num(tf.get("fp16") or tf.get("bf16"), ",.1f") if (tf.get("fp16") or tf.get("bf16")) else
                  f"fp32 {_num(tf.get('fp32'), ',.3f')}", _num(e.get("tdp_w"), ",.0f"), _num(e.get("price_usd"), ",.0f"),
                  _num(e.get("usd_per_hour"), ",.2f"), "yes" if e.get("efficiency") else "",
                  e["origin"].rsplit("/", 1)[-1])
    console.print(t)


def probe(r: dict) -> None:
    e = r["entry"]
    console.print(f"[bold]{r['name']}[/]: {e['bandwidth_gb_s']:,.1f} GB/s read, "
                  + ", ".join(f"{k} {v:,.3f} TFLOPS" for k, v in e["tflops"].items()) + f", {e['memory_gib']} GiB")
    console.print(f"[dim]{e['source']}[/]")
    console.print(f"written to {r['written']}" if r["written"] else "not written (--dry-run)")


def calibrate(r: dict) -> None:
    console.print(_model_line(r["model"]))
    t = Table(title=f"engine timings on {r['hardware']} ({r['engine']['dtype']})")
    for c in ("phase", "batch", "tokens", "measured ms", "fitted ms", "error", "bound"):
        t.add_column(c, justify="right")
    for row in r["rows"]:
        t.add_row(row["phase"], str(row["batch"]), str(row["num_tokens"]), _ms(row["step_s"]), _ms(row["predicted_s"]),
                  f"{row['predicted_s'] / row['step_s'] - 1:+.1%}", row["bound"])
    console.print(t)
    f = r["fit"]
    console.print(f"fit: bandwidth efficiency {f['bandwidth_efficiency']:.1%}, compute efficiency "
                  f"{f['compute_efficiency']:.1%}, overhead {f['step_overhead_ms']:.2f} ms/step; "
                  f"mean |error| {f['mean_abs_rel_error']:.1%}")
    if v := r.get("validation"):
        console.print(f"held-out mixed batch ({len(v['prompt_lens'])} prompts, {v['output_len']} tokens each): "
                      f"measured {v['measured_s']:.3f} s, simulated {v['predicted_s']:.3f} s ({v['error']:+.1%})")
    for w in r.get("warnings", []):
        console.print(f"[yellow]warning:[/] {w}")
    if r.get("written"):
        console.print(f"written to {r['written']}")


def validate(r: dict) -> None:
    from tokenfab.plan.validate import METRICS
    con = console
    cm = r["cost_model"]
    con.print(f"[bold]{r['bench']}[/] run {r['run']}: {r['requests']} requests replayed through the simulator "
              f"with the step table {cm['file']} ({cm['rows']} rows, fit error {cm['mean_abs_rel_error']:.0%})")
    if n := cm.get("noise"):
        con.print(f"{r['replicates']} replays with the table's step scatter (measured/fitted P10-P90 "
                  f"{n['ratio_p10']:.2f}-{n['ratio_p90']:.2f}, lag-1 correlation {n['lag1_corr']:.2f}); "
                  "predicted = their mean")
    band = r.get("predicted_p10_p90") or {}
    t = Table()
    for col in ("metric", "measured", "predicted", *(("replays P10-P90",) if band else ()), "error"):
        t.add_column(col, justify="left" if col == "metric" else "right")
    for key, label in METRICS:
        err = r["relative_error"][key]
        extra = (f"{_num(band[key][0])}-{_num(band[key][1])}",) if band else ()
        t.add_row(label, _num(r["measured"][key]), _num(r["predicted"][key]), *extra, f"{err:+.1%}")
    con.print(t)
