"""`tokenfab batch run INPUT -o OUTPUT`: an OpenAI batch file through the engine, no server.

It lives with the server because the lines run through the server's own routes (batch_dispatch.py);
tokenfab.batch keeps the resumable runner.

Registering the parser imports neither torch nor FastAPI; the handler does, once it runs.
"""
from __future__ import annotations

import argparse
import sys

from tokenfab.engine_args import add_engine_args


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("batch", help="run an OpenAI batch file (JSON lines) offline",
                              description="Run OpenAI Batch API files without a server (docs/batch.md).")
    subs = p.add_subparsers(dest="batch_command", metavar="COMMAND", required=True)
    r = subs.add_parser(
        "run", help="run INPUT.jsonl into OUTPUT.jsonl (resumes after an interruption)",
        description="Run each line of an OpenAI batch file ({custom_id, method, url, body}; url "
                    "/v1/completions or /v1/chat/completions) and write one output line per input line. "
                    "Killed and run again with the same arguments, it runs only the lines not yet done "
                    "(progress is kept in OUTPUT.progress/). With no --model, the bundled SmolLM2-135M-Instruct.")
    r.add_argument("input", metavar="INPUT.jsonl", help="the batch file")
    r.add_argument("-o", "--output", required=True, metavar="OUTPUT.jsonl", help="where to write the results")
    r.add_argument("--concurrency", type=int, default=None, metavar="N",
                   help="lines in the engine at once (default: --max-num-seqs)")
    r.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    add_engine_args(r, positional_model=False)
    r.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tokenfab.cli_errors import CLIError
    from tokenfab.engine_args import engine_config_from_args
    if not Path(args.input).is_file():
        raise CLIError(f"{args.input}: no such file")
    if args.concurrency is not None and args.concurrency < 1:
        raise CLIError(f"--concurrency must be >= 1, got {args.concurrency}")
    config = engine_config_from_args(args)
    from tokenfab.batch.offline import run_file
    from tokenfab.engine.engine import LLMEngine
    from tokenfab.server.batch_dispatch import offline_routes
    engine = LLMEngine(config)
    summary = run_file(offline_routes(engine), args.input, args.output, args.concurrency or config.max_num_seqs,
                       show_progress=args.progress and sys.stderr.isatty())
    resumed = f" ({summary['resumed']} done by an earlier run)" if summary["resumed"] else ""
    print(f"{summary['total']} lines{resumed}: {summary['completed']} succeeded, {summary['failed']} failed "
          f"-> {args.output}", file=sys.stderr)
    return 0
