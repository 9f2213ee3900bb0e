"""`tokenfab bench drills`'s handler: flags to a DrillConfig, the drills one after another with a line as
each ends, the table, the files, and the exit code (0: every drill that ran passed; 1: one did not). The
parser is in cli.py with the others."""
from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table


def drills_config(args: argparse.Namespace, workdir: Path):
    """DrillConfig from parsed arguments, validated (ValueError says what to change)."""
    from tokenfab.bench.drill_cases import DRILLS
    from tokenfab.bench.drills import DrillConfig

    unknown = [n for n in args.only if n not in DRILLS]
    if unknown or not args.only:
        raise ValueError(f"--only {','.join(args.only)}: no drill named {', '.join(unknown) or '(none given)'}; "
                         f"choose from {','.join(DRILLS)}")
    if args.slow_readers < 1 or args.batch_lines < 1:
        raise ValueError("--slow-readers and --batch-lines need at least 1")
    cfg = DrillConfig(workdir=workdir, concurrency=args.concurrency, load_s=args.load_seconds,
                      idle_connections=args.idle_connections, slow_readers=args.slow_readers,
                      batch_lines=args.batch_lines, seed=args.seed, extra_serve_flags=shlex.split(args.serve_flags or ""))
    cfg.validate()
    return cfg


def results_table(results) -> Table:
    from tokenfab.bench.drills import COLUMNS, row
    table = Table(title="fault drills under load")
    for c in COLUMNS:
        table.add_column(c, justify="left" if c in ("fault", "result") else "right")
    for r in results:
        table.add_row(*row(r), style=None if r.passed or r.skipped else "red")
    return table


def drills_command(args: argparse.Namespace, out: Console) -> int:
    from tokenfab.bench.drill_cases import run_drills
    from tokenfab.bench.drills import DrillContext, check_lines, markdown_table
    from tokenfab.bench.tokens import load_counter

    err = Console(stderr=True)
    with contextlib.ExitStack() as stack:
        workdir = Path(args.workdir) if args.workdir else Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="tokenfab-drills-")))
        cfg = drills_config(args, workdir)
        counter = load_counter(None)
        err.print(f"{len(args.only)} drills, {cfg.concurrency} background requests in flight; logs in {workdir}")

        def show(r) -> None:
            err.print(f"{r.name}: {r.verdict} in {r.seconds:.1f} s"
                      + (f" ({r.skipped})" if r.skipped else ""))

        results = run_drills(DrillContext(cfg, counter), list(args.only), show)
    out.print(results_table(results))
    for line in check_lines(results):
        out.print(line, markup=False, highlight=False)
    if args.out:
        Path(args.out).write_text(json.dumps([r.as_dict() for r in results], indent=2) + "\n")
        err.print(f"wrote {args.out}")
    if args.markdown:
        Path(args.markdown).write_text(markdown_table(results) + "\n\n"
                                       + "\n".join(f"- {x}" for x in check_lines(results)) + "\n")
        err.print(f"wrote {args.markdown}")
    return 0 if all(r.passed or r.skipped for r in results) else 1
