"""A doctor run as data and as text: the deployment to compare against, the findings, the rendering.

Shared by `tokenfab doctor` and the server's `/doctor` endpoint, so both say the same thing.
"""
from __future__ import annotations

import dataclasses
import os

from tokenfab.doctor.rules import Finding, Measured, diagnose
from tokenfab.doctor.scrape import Window

_FLOAT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def weight_dtype(quantization: str, dtype: str, model_default: str) -> str:
    """The plan dtype of the weights the engine runs (its --quantization and --dtype)."""
    if quantization in ("int8", "w8a8"):
        return "int8"
    if quantization.startswith("int4"):
        return quantization
    if quantization == "none":
        return _FLOAT.get(dtype, "fp32")
    return model_default                 # auto / gguf: the file's blocks as shipped


def deployment_for(hardware: str, model: str | None, config: dict, hardware_files: tuple[str, ...] = ()):
    """The roofline's Deployment for the served model on catalog hardware `hardware`."""
    from tokenfab.plan.hardware import get_hardware, load_catalog
    from tokenfab.plan.models import resolve_model
    from tokenfab.plan.roofline import Deployment
    hw = get_hardware(hardware, load_catalog(hardware_files))
    spec = resolve_model(model)
    if model is None or os.path.exists(os.path.expanduser(model)):
        # GGUF's general.name is often a training-run label; call the model what the server calls it.
        from tokenfab.files.bundled import model_display_name
        spec = dataclasses.replace(spec, name=model_display_name(model and os.path.expanduser(model)))
    act = _FLOAT.get(str(config.get("dtype", "float32")), "fp32")
    kv = {"int8": "int8", "float16": "fp16", "float32": "fp32"}.get(str(config.get("kv_cache_dtype")), act)
    w = weight_dtype(str(config.get("quantization", "auto")), str(config.get("dtype", "float32")), spec.default_dtype)
    return Deployment.make(spec, hw, weight_dtype=w, kv_dtype=kv, act_dtype=act)


def kernel_times(config: dict, batch: int) -> list | None:
    """(shape, linears, kernel, seconds) per linear shape for a step of `batch` rows, from the server's
    `linear_plans` label and its kernel table, when that file is on this machine; else None."""
    import json

    from tokenfab.kernels.select import step_time
    from tokenfab.kernels.tuning import KernelTable
    path, plans = config.get("kernel_table"), config.get("linear_plans")
    if not path or not plans or not os.path.exists(str(path)):
        return None
    try:
        by_key = json.loads(plans)
        table = KernelTable.load(str(path))
    except (ValueError, OSError):
        return None
    return step_time(table, {k: v[1] for k, v in by_key.items()}, {k: v[0] for k, v in by_key.items()}, batch)


def run(window: Window | None, bench: dict | None = None, dep=None) -> dict:
    """The `--json` document: measured numbers, the roofline used, findings in order."""
    kernels = None
    if window is not None and dep is not None:
        m = Measured.from_window(window)
        kernels = kernel_times(m.config, max(1, round(m.running)))
    findings, m = diagnose(window, bench, dep, kernels)
    return {"measured": m.to_dict() if m else None,
            "hardware": dep.hardware.name if dep else None,
            "model": dep.model.name if dep else None,
            "weight_dtype": dep.weight_dtype.name if dep else None,
            "bench": bool(bench),
            "findings": [f.to_dict() for f in findings],
            "notes": notes(window, bench, dep)}


def notes(window, bench, dep) -> list[str]:
    """What the run could not judge, so silence is not read as health."""
    out = []
    if dep is None:
        out.append("no hardware given (--hardware NAME from `tokenfab plan hardware`, or your machine after "
                   "`tokenfab plan probe`): decode bandwidth and host overhead need the roofline")
    if bench is None:
        out.append("no bench result given (--bench RESULT.json): the long-prompt tail needs per-bucket latencies")
    if window is not None:
        m = Measured.from_window(window)
        if m.first_tokens == 0 and m.generation_tok_s == 0:
            out.append("the server was idle between the scrapes: run load against it (e.g. `tokenfab bench serve`) "
                       "while the doctor watches")
    return out


def render(doc: dict, console=None) -> None:
    from rich.console import Console
    from rich.markup import escape
    c = console or Console()
    m = doc.get("measured")
    if m:
        c.print(f"[bold]measured over {m['seconds']:.1f} s:[/bold] {m['running']:.1f} running, "
                f"{m['waiting_after']:.0f} waiting, KV {m['kv_usage']:.0%}, {m['generation_tok_s']:.0f} generated "
                f"tok/s, {m['preemptions']:.0f} preemptions"
                + (f", TTFT mean {m['ttft_mean_s'] * 1e3:.0f} ms" if m["ttft_mean_s"] is not None else "")
                + (f", ITL mean {m['itl_mean_s'] * 1e3:.1f} ms" if m["itl_mean_s"] is not None else ""))
    if doc.get("hardware"):
        c.print(f"roofline: {doc['model']} ({doc['weight_dtype']} weights) on {doc['hardware']}")
    if not doc["findings"]:
        c.print("[green]no bottleneck stands out in what was measured.[/green]")
    for i, f in enumerate(doc["findings"], 1):
        c.print(f"\n[bold red]{i}. {escape(f['title'])}[/bold red]")
        for e in f["evidence"]:
            c.print(f"   - {escape(e)}")
        c.print("   [bold]change:[/bold]")
        for a in f["advice"]:
            c.print(f"   → {escape(a)}")
    for n in doc.get("notes", []):
        c.print(f"\n[dim]note: {escape(n)}[/dim]")


__all__ = ["Finding", "deployment_for", "render", "run", "weight_dtype"]
