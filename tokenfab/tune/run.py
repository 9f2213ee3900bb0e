"""`tokenfab tune`'s handler: flags to a search, the search to a table, a plot, a config and a verdict.

Exit status: 0 when a configuration meets every target and passes validation; 1 when none meets
them (the message names each failing target and the best any point reached) or validation fails;
2 for a usage mistake (cli.py prints it).
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, SpinnerColumn, TextColumn
from rich.text import Text

from tokenfab.tune.search import PointResult, Scorer, Tuner, choose, nearest_misses
from tokenfab.tune.space import Axes, baseline, default_threads, default_weights
from tokenfab.tune.targets import Targets


class _TimeLeft(ProgressColumn):
    def render(self, task) -> Text:
        left = max(0.0, task.fields["deadline"] - time.monotonic())
        return Text(f"{left:,.0f} s left", style="cyan")


class _Display:
    """A live line: what runs now, points measured and predicted, the budget used and the time left."""

    def __init__(self, console: Console, budget_s: float, enabled: bool):
        self.console, self.enabled = console, enabled
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                 TextColumn("{task.fields[counts]}"), _TimeLeft(), console=console)
        self.t0 = time.monotonic()
        self.task = self.progress.add_task("starting", total=budget_s, deadline=self.t0 + budget_s,
                                           counts="")

    def __enter__(self):
        if self.enabled:
            self.progress.start()
        return self

    def __exit__(self, *exc):
        self.progress.stop()

    def say(self, msg: str) -> None:
        self.progress.update(self.task, description=msg, completed=time.monotonic() - self.t0)
        if not self.enabled:
            self.console.print(msg)

    def tick(self, measured: int, predicted: int) -> None:
        self.progress.update(self.task, counts=f"{measured} measured · {predicted} predicted",
                             completed=time.monotonic() - self.t0)


def _model(args) -> tuple[str | None, bool]:
    from tokenfab.files.bundled import resolve_model_path
    path = resolve_model_path(args.model)
    return (args.model and path), path.endswith(".gguf")


def _scorer(args) -> Scorer:
    cores = os.cpu_count() or 1
    if not args.hardware:
        return Scorer(None, cores)
    from tokenfab.plan.hardware import get_hardware, load_catalog
    hw = get_hardware(args.hardware, load_catalog())
    if not hw.usd_per_hour:
        raise ValueError(f"--hardware {args.hardware} has no usd_per_hour in the catalogue; add it to the entry "
                         "(docs/plan.md) or leave --hardware out to rank by goodput per core")
    return Scorer(hw.usd_per_hour, cores)


def tune_command(args) -> int:
    from tokenfab.tune.results import Results
    from tokenfab.tune.workload import parse_workload

    targets = Targets(args.p99_ttft_ms, args.p99_tpot_ms, args.max_kl, args.min_top1)
    targets.validate()
    if args.budget <= 0 or args.validation_runs < 0 or args.ctx < 2 or args.max_windows < 1:
        raise ValueError("--budget must be positive, --validation-runs 0 or more, --ctx at least 2 and "
                         "--max-windows at least 1")
    if args.text and not os.path.isfile(args.text):
        raise ValueError(f"--text {args.text}: no such file")
    model, is_gguf = _model(args)
    scorer = _scorer(args)
    workload = parse_workload(args.workload, targets.slos(), tokenizer=model)
    axes = Axes(args.weights or default_weights(is_gguf), args.kv_cache_dtypes, args.threads or default_threads(),
                args.max_num_seqs, args.max_num_batched_tokens, args.chunked_prefill, args.speculative)
    base = baseline(model, is_gguf)
    points = axes.points()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = Results(out_dir / "results.jsonl", {"model": model, "workload": list(workload.flags)})
    err = Console(stderr=True, soft_wrap=True)      # messages stay one line each, whatever the width
    out = Console() if sys.stdout.isatty() else Console(width=200)
    err.print(f"tune: {len(points)} points; workload: {' '.join(workload.flags)}; budget {args.budget:g} s"
              + (f"; resuming {results.resumed} measured points from {results.path}" if results.resumed else ""))
    tuner = Tuner(model, is_gguf, points if base in points else [base, *points], base, targets, workload, out_dir,
                  args.budget, scorer, {"text": args.text, "ctx": args.ctx, "max_windows": args.max_windows})
    with _Display(err, args.budget, not args.no_progress) as display:
        tuner.say, tuner.on_tick = display.say, display.tick
        found = tuner.run(results)
    chosen = choose(found)
    base_result = next((r for r in found if r.point == base), None)
    out.print(_table(found, scorer, chosen, base_result))
    summary = _summary(found, chosen, base_result, tuner, targets)
    from tokenfab.tune.report import plot_design_space
    plot = plot_design_space(found, targets, chosen, out_dir / "tune.png", scorer)
    err.print(f"measured {summary['measured_now']} points now, {summary['resumed']} from the results file; "
              f"predicted {summary['predicted']}; plot: {plot}")
    if chosen is None:
        _say_impossible(err, found)
        _write_summary(out_dir, summary)
        return 1
    rc = _finish(args, chosen, base_result, model, workload, targets, out_dir, err, summary)
    _write_summary(out_dir, summary)
    return rc


def _table(found, scorer, chosen, base_result):
    from tokenfab.tune.report import design_table
    return design_table(found, scorer, chosen, base_result)


def _say_impossible(err: Console, found: list[PointResult]) -> None:
    misses = nearest_misses(found)
    err.print("[red]no configuration meets the targets.[/] The nearest each target came:")
    if not misses:      # each target met somewhere, never all at once: the best point's shortfall
        best = min((r for r in found if r.source == "measured" and r.checks),
                   key=lambda r: max(c.excess for c in r.checks), default=None)
        misses = best.failing() if best else []
        if best:
            err.print(f"  (every target is met by some point, none meets all; nearest: {best.point.label()})")
    for c in misses:
        err.print(f"  {c.describe()}")
    if not misses:
        err.print("  nothing was measured within the budget; raise --budget")


def _finish(args, chosen: PointResult, base_result: PointResult | None, model, workload, targets: Targets,
            out_dir: Path, err: Console, summary: dict) -> int:
    from tokenfab.tune.report import write_serve_config
    from tokenfab.tune.validate import validate
    m = chosen.metrics
    line = f"chosen: {chosen.point.label()}: goodput {m['goodput']:.3f} req/s on {chosen.point.num_threads} threads"
    if base_result is not None and base_result.source == "measured" and base_result is not chosen:
        b = base_result.metrics["goodput"]
        ratio = f" ({m['goodput'] / b:.2f}x)" if b else " (the default met no request's targets)"
        line += f", against the default configuration's {b:.3f} req/s{ratio}"
    err.print(line)
    comment = (f"written by `tokenfab tune`: {chosen.point.label()}\nworkload: {' '.join(workload.flags)}\n"
               f"targets: {json.dumps(targets.as_dict())}\nmeasured: P99 TTFT {m['p99_ttft_ms']:.1f} ms, "
               f"P99 TPOT {m['p99_tpot_ms']:.2f} ms, goodput {m['goodput']:.3f} req/s\n"
               "run it with: tokenfab serve --config THIS_FILE")
    path = write_serve_config(out_dir / "serve.yaml", chosen, model, comment)
    err.print(f"wrote {path} (tokenfab serve --config {path})")
    if args.validation_runs == 0:
        err.print("validation skipped (--validation-runs 0)")
        return 0
    runs = validate(path, workload, targets, args.validation_runs, out_dir, err.print)
    summary["validation"] = [{"metrics": r["metrics"], "ok": all(c.ok for c in r["checks"])} for r in runs]
    for i, r in enumerate(runs, 1):
        vm = r["metrics"]
        err.print(f"  run {i}: P99 TTFT {vm['p99_ttft_ms']:.1f} ms, P99 TPOT {_ms(vm['p99_tpot_ms'])}, goodput "
                  f"{vm['goodput']:.3f} req/s, {vm['failed']} failed: "
                  + ("meets every target" if all(c.ok for c in r["checks"])
                     else "; ".join(c.describe() for c in r["checks"] if not c.ok)))
    if len(runs) == args.validation_runs and all(all(c.ok for c in r["checks"]) for r in runs):
        err.print(f"[green]validated:[/] {len(runs)} consecutive runs of {path} met every target")
        return 0
    err.print(f"[red]not validated:[/] run {len(runs)} of {args.validation_runs} missed; the search's measurement "
              "was not repeatable at these targets (raise the workload's --num-prompts, or loosen the targets)")
    return 1


def _ms(v) -> str:
    return "-" if v is None else f"{v:.2f} ms"


def _summary(found, chosen, base_result, tuner, targets) -> dict:
    def row(r: PointResult) -> dict:
        return {"point": json.loads(r.point.key()), "source": r.source, "metrics": r.metrics, "quality": r.quality,
                "meets": r.meets, "failing": [c.describe() for c in r.failing()], "note": r.note,
                "score": r.score if math.isfinite(r.score) else None}
    return {"targets": targets.as_dict(), "chosen": row(chosen) if chosen else None,
            "baseline": row(base_result) if base_result else None,
            "measured_now": len(tuner.measured_now), "resumed": tuner.results.resumed,
            "predicted": sum(r.source == "predicted" for r in found), "points": [row(r) for r in found]}


def _write_summary(out_dir: Path, summary: dict) -> None:
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
