"""`tokenfab bench soak`'s handler: flags to a SoakConfig, the run with its live display, the verdict, the
files, and the exit code (0: the run holds; 1: it does not). The parser is in cli.py with the others."""
from __future__ import annotations

import argparse
import os
import re

from rich.console import Console

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str, flag: str) -> float:
    """``"90"``, ``"90s"``, ``"30m"``, ``"1.5h"`` → seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smh]?)\s*", text)
    if not m:
        raise ValueError(f"{flag} {text!r}: expected seconds or a number with s, m or h (e.g. 90s, 30m, 2h)")
    seconds = float(m.group(1)) * _UNITS[m.group(2)]
    if seconds <= 0:
        raise ValueError(f"{flag} {text!r}: must be positive")
    return seconds


def soak_config(args: argparse.Namespace):
    """SoakConfig from parsed arguments, validated (ValueError says what to change)."""
    from tokenfab.bench.arrivals import parse_rate
    from tokenfab.bench.client import normalize_base_url
    from tokenfab.bench.drift import Thresholds
    from tokenfab.bench.lengths import parse_length
    from tokenfab.bench.probe import check_pid
    from tokenfab.bench.soak import SoakConfig
    from tokenfab.bench.soak_mix import SoakMix

    for flag, spec in (("--input-len", args.input_len), ("--long-input-len", args.long_input_len),
                       ("--output-len", args.output_len)):
        try:
            parse_length(spec, 0.0)
        except ValueError as e:
            raise ValueError(f"{flag}: {e}") from None
    mix = SoakMix(chat_fraction=args.chat_fraction, stream_fraction=args.stream_fraction,
                  abort_fraction=args.abort_fraction, structured_fraction=args.structured_fraction,
                  long_fraction=args.long_fraction, input_len=args.input_len, long_input_len=args.long_input_len,
                  output_len=args.output_len)
    th = Thresholds(max_rss_slope_mib_per_hour=args.max_rss_slope, max_p99_regression=args.max_p99_regression,
                    max_leaked_blocks=args.max_leaked_blocks, max_error_rate=args.max_error_rate,
                    max_5xx=args.max_5xx, max_fd_growth=args.max_fd_growth, max_thread_growth=args.max_thread_growth,
                    warmup_windows=args.warmup_windows, consecutive=args.consecutive)
    cfg = SoakConfig(base_url=normalize_base_url(args.base_url), model=args.model,
                     api_key=args.api_key or os.environ.get("OPENAI_API_KEY"), tokenizer=args.tokenizer,
                     duration_s=parse_duration(args.duration, "--duration"),
                     window_s=parse_duration(args.window, "--window"), max_concurrency=args.max_concurrency,
                     request_rate=parse_rate(args.request_rate), mix=mix, stream_usage=args.stream_usage,
                     temperature=args.temperature, timeout_s=args.timeout, idle_timeout_s=args.idle_timeout,
                     pid=args.pid, percentiles=list(args.percentiles), seed=args.seed, thresholds=th)
    cfg.validate()
    if cfg.pid is not None:
        check_pid(cfg.pid)
    return cfg


def soak_command(args: argparse.Namespace, out: Console) -> int:
    import asyncio
    import dataclasses

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from tokenfab.bench.client import Endpoint
    from tokenfab.bench.drift import judge
    from tokenfab.bench.report import soak_tables, window_line
    from tokenfab.bench.schema import write_result
    from tokenfab.bench.serving import discover_model
    from tokenfab.bench.soak import result_json, run_soak
    from tokenfab.bench.soak_mix import SoakWorkload, make_endpoints
    from tokenfab.bench.tokens import load_counter

    cfg = soak_config(args)
    err = Console(stderr=True)
    counter = load_counter(cfg.tokenizer)
    if counter.warning:
        err.print(f"[yellow]warning:[/yellow] {counter.warning}")
    cfg.model = cfg.model or asyncio.run(discover_model(cfg.base_url, cfg.api_key))
    base = Endpoint(base_url=cfg.base_url, model=cfg.model, api_key=cfg.api_key, stream_usage=cfg.stream_usage,
                    temperature=cfg.temperature, timeout_s=cfg.timeout_s)
    workload = SoakWorkload(cfg.mix, counter, make_endpoints(base), seed=cfg.seed)
    err.print(f"soaking {cfg.base_url} (model {cfg.model}) for {cfg.num_windows} windows of {cfg.window_s:g} s, "
              f"max concurrency {cfg.max_concurrency}, tokenizer: {counter.source}")

    progress = None if args.no_progress else Progress(
        TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed:.0f}/{task.total:.0f} s"),
        TextColumn("[red]{task.fields[failed]} failed"), TimeElapsedColumn(), console=err)
    state = {"failed": 0, "task": None}

    def on_request(raw) -> None:
        state["failed"] += raw.error is not None
        if progress is not None:
            progress.update(state["task"], failed=state["failed"])

    def on_window(w) -> None:
        err.print(window_line(dataclasses.asdict(w), cfg.num_windows))
        if progress is not None:
            progress.update(state["task"], completed=(w.index + 1) * cfg.window_s,
                            description=f"window {min(w.index + 2, cfg.num_windows)}/{cfg.num_windows}")

    if progress is not None:
        with progress:
            state["task"] = progress.add_task(f"window 1/{cfg.num_windows}", total=cfg.num_windows * cfg.window_s,
                                              failed=0)
            run = asyncio.run(run_soak(cfg, workload, counter, on_window, on_request))
    else:
        run = asyncio.run(run_soak(cfg, workload, counter, on_window, on_request))
    if run.start.source == "none":
        err.print("[yellow]warning:[/yellow] the server has no /metrics and no --pid was given: RSS, threads, "
                  "descriptors and KV blocks were not measured, so they were not judged")
    verdict = judge([w.stats() for w in run.windows], run.start.kv_used_blocks, cfg.thresholds)
    result = result_json(cfg, counter, run, verdict)
    for table in soak_tables(result):
        out.print(table)
    if args.out:
        write_result(args.out, result)
        err.print(f"wrote {args.out}")
    if args.plot:
        from tokenfab.bench.plots import soak_windows
        os.makedirs(args.plot, exist_ok=True)
        path = soak_windows(result, os.path.join(args.plot, "soak.png"))
        if path:
            err.print(f"wrote {path}")
    return 0 if verdict.passed else 1
