"""`tokenfab bench serve | soak | compare | offline`: the argument parsers and their handlers
(`bench soak`'s handler is soak_cli.py).

Registering the parsers imports nothing heavy; each handler imports what it needs.
"""
from __future__ import annotations

import argparse
import os


def _csv(kind):
    def parse(text: str):
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {kind.__name__}s") from None
    return parse


def add_parser(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmark a server (serve), soak-test it (soak), compare results, "
                                  "or the engine (offline)",
                                  description="Benchmark an OpenAI-compatible server or the in-process engine.")
    subs = bench.add_subparsers(dest="bench_command", metavar="SUBCOMMAND")
    bench.set_defaults(func=lambda args: (bench.print_help(), 2)[1])
    _serve_parser(subs)
    _soak_parser(subs)
    _compare_parser(subs)
    _offline_parser(subs)


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" unless the help already says its default, or there is none to say."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "(default" in text or action.default is None:
            return text
        return super()._get_help_string(action)


def _serve_parser(subs) -> None:
    p = subs.add_parser("serve", help="load-test an OpenAI-compatible endpoint",
                        formatter_class=_DefaultsFormatter,
                        description="Load-test an OpenAI-compatible endpoint and report TTFT, TPOT, ITL, E2E, "
                                    "throughput and goodput as vLLM's `bench serve` defines them. See docs/bench.md.")
    g = p.add_argument_group("target")
    g.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000 (with or without /v1)")
    g.add_argument("--model", help="model name to send; default: the first one /v1/models lists")
    g.add_argument("--endpoint", choices=["completions", "chat"],
                   help="(default: chat for --dataset agent, else completions)")
    g.add_argument("--api-key", help="bearer token (default: $OPENAI_API_KEY if set)")
    g.add_argument("--tokenizer", help="tokenizer of the served model (a .gguf or HF folder) for exact token "
                                       "counts; default: the bundled model's; 'none' for approximate counts")
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset", default="random", help="random | shared-prefix | mixed | agent | jsonl:PATH")
    g.add_argument("--num-prompts", type=int, default=200)
    g.add_argument("--input-len", default="256", help="prompt tokens: N (see --range-ratio), uniform:LO:HI, "
                                                      "normal:MEAN:STD or lognormal:MEDIAN:SIGMA")
    g.add_argument("--output-len", default="128", help="max_tokens per request, same forms as --input-len")
    g.add_argument("--range-ratio", type=float, default=0.0, help="plain lengths are drawn from [N(1-r), N(1+r)]")
    g.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct system prompts (K)")
    g.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: tokens per system prompt (L)")
    g.add_argument("--long-fraction", type=float, default=0.05, help="mixed: share of very long prompts")
    g.add_argument("--long-input-len", default="4096", help="mixed: length of the long prompts")
    g = p.add_argument_group("agent sessions (--dataset agent; docs/bench.md, \"The agent workload\")")
    g.add_argument("--num-sessions", type=int, default=16, help="sessions in a run (they arrive at --request-rate)")
    g.add_argument("--turns", default="4", help="turns per session: N or a distribution, e.g. uniform:2:8")
    g.add_argument("--system-len", default="1024", help="tokens of the system prompt all sessions share")
    g.add_argument("--user-len", default="64", help="tokens of each new user message")
    g.add_argument("--tool-len", default="256", help="tokens of a turn's tool results, answering its tool calls")
    g.add_argument("--num-tools", type=int, default=4, help="function tools sent with every turn")
    g.add_argument("--think-time", default="exp:1", help="seconds between a reply and the next turn: N (fixed) "
                                                         "or exp:MEAN (exponential)")
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", default="inf", help="requests/s (Poisson/gamma arrivals; sessions/s with "
                                                         "--dataset agent) or inf (all at once)")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 = Poisson, <1 burstier")
    g.add_argument("--max-concurrency", type=int, help="cap on requests in flight (sessions with --dataset agent)")
    g.add_argument("--sweep", help="comma-separated request rates, or 'auto' to find the saturation rate")
    g.add_argument("--warmup", type=int, default=1, help="uncounted requests sent first")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("request")
    g.add_argument("--stream-usage", choices=["continuous", "final", "off"], default="continuous",
                   help="ask for usage on every chunk (exact tokens per chunk), only at the end, or not at all")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask the server to generate exactly max_tokens")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    g.add_argument("--extra-body", help="JSON object merged into every request body")
    g = p.add_argument_group("report")
    g.add_argument("--goodput", nargs="+", metavar="METRIC:MS", help="SLOs, e.g. ttft:500 tpot:50 e2el:10000")
    g.add_argument("--buckets", type=_csv(int), default=[128, 512, 2048, 8192], help="prompt-length bucket edges")
    g.add_argument("--percentiles", type=_csv(float), default=[50.0, 90.0, 95.0, 99.0])
    g.add_argument("--out", help="write the JSON result here")
    g.add_argument("--plot", metavar="DIR", help="write PNG plots into DIR")
    g.add_argument("--no-requests", action="store_true", help="leave per-request records out of the JSON")
    g.add_argument("--no-progress", action="store_true", help="no live progress display")
    p.set_defaults(func=serve_command)


def parse_serve_flags(argv: list[str]) -> argparse.Namespace:
    """`bench serve`'s flags parsed on their own, for a tool that runs the benchmark itself (`tokenfab
    tune`); a bad flag raises ValueError with argparse's message instead of exiting."""
    parser = argparse.ArgumentParser(prog="tokenfab")
    _serve_parser(parser.add_subparsers())
    serve = parser._subparsers._group_actions[0].choices["serve"]

    def refuse(message: str):
        raise ValueError(message)

    serve.error = parser.error = refuse
    return parser.parse_args(["serve", *argv])


def _soak_parser(subs) -> None:
    # The defaults are drift.Thresholds' and soak_mix.SoakMix's, written out so that registering the parser
    # imports neither (numpy, httpx); tests/test_bench_soak.py holds them equal.
    mix = argparse.Namespace(input_len="128", long_input_len="1024", long_fraction=0.1, output_len="64",
                             chat_fraction=0.5, stream_fraction=0.75, abort_fraction=0.1, structured_fraction=0.1)
    th = argparse.Namespace(warmup_windows=1, consecutive=3, max_rss_slope_mib_per_hour=6.0, max_p99_regression=0.1,
                            max_leaked_blocks=0, max_error_rate=0.0, max_5xx=0, max_fd_growth=16, max_thread_growth=8)
    p = subs.add_parser("soak", help="a long mixed load, in windows, judged for drift (memory, latency, KV leaks)",
                        formatter_class=_DefaultsFormatter,
                        description="Run a mixed workload against an OpenAI-compatible server for --duration, in "
                                    "windows; after each, sample the idle server's RSS, threads, descriptors and KV "
                                    "blocks. Judge the drift against thresholds: exit 0 when the run holds, 1 when "
                                    "it does not. See docs/bench.md.")
    g = p.add_argument_group("target")
    g.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000 (with or without /v1)")
    g.add_argument("--model", help="model name to send; default: the first one /v1/models lists")
    g.add_argument("--api-key", help="bearer token, also for /metrics (default: $OPENAI_API_KEY if set)")
    g.add_argument("--tokenizer", help="tokenizer of the served model for exact prompt lengths; default: the "
                                       "bundled model's; 'none' for approximate counts")
    g.add_argument("--pid", type=int, help="the server's process id, when local: RSS, threads and descriptors "
                                           "from /proc instead of /metrics")
    g = p.add_argument_group("time")
    g.add_argument("--duration", default="1h", help="total load time: seconds, or 90s, 30m, 2h")
    g.add_argument("--window", default="5m", help="load time per window (a window also waits for its last "
                                                  "requests, then samples the idle server)")
    g.add_argument("--warmup-windows", type=int, default=th.warmup_windows,
                   help="first windows left out of the RSS fit and the judging; the next is the latency baseline")
    g.add_argument("--consecutive", type=int, default=th.consecutive, help="the last N windows must all hold")
    g.add_argument("--idle-timeout", type=float, default=60.0,
                   help="seconds a window's end waits for the server to have nothing running")
    g = p.add_argument_group("load and mix")
    g.add_argument("--max-concurrency", type=int, default=4, help="requests in flight (closed loop at --request-rate inf)")
    g.add_argument("--request-rate", default="inf", help="requests/s (Poisson arrivals) under the concurrency cap")
    g.add_argument("--input-len", default=mix.input_len, help="short prompt tokens (same forms as bench serve)")
    g.add_argument("--long-input-len", default=mix.long_input_len, help="long prompt tokens")
    g.add_argument("--long-fraction", type=float, default=mix.long_fraction, help="share of long prompts")
    g.add_argument("--output-len", default=mix.output_len, help="max_tokens per request")
    g.add_argument("--chat-fraction", type=float, default=mix.chat_fraction, help="share sent to chat (else completions)")
    g.add_argument("--stream-fraction", type=float, default=mix.stream_fraction, help="share streamed")
    g.add_argument("--abort-fraction", type=float, default=mix.abort_fraction,
                   help="share of streamed requests the client hangs up on mid-stream (or mid-prefill)")
    g.add_argument("--structured-fraction", type=float, default=mix.structured_fraction,
                   help="share of chat requests with response_format json_schema, whose answers are checked")
    g.add_argument("--stream-usage", choices=["continuous", "final", "off"], default="continuous",
                   help="as for bench serve")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("thresholds")
    g.add_argument("--max-rss-slope", type=float, default=th.max_rss_slope_mib_per_hour,
                   help="idle RSS growth after warm-up, MiB per hour (least-squares fit)")
    g.add_argument("--max-p99-regression", type=float, default=th.max_p99_regression,
                   help="P99 TTFT and TPOT may rise this share above the baseline window's (0.1 = 10 %%)")
    g.add_argument("--max-leaked-blocks", type=int, default=th.max_leaked_blocks,
                   help="KV blocks in use when idle, above the count before the soak")
    g.add_argument("--max-error-rate", type=float, default=th.max_error_rate,
                   help="failed / sent (hang-ups not counted), per window and overall")
    g.add_argument("--max-5xx", type=int, default=th.max_5xx, help="5xx responses, per window and overall")
    g.add_argument("--max-fd-growth", type=int, default=th.max_fd_growth, help="open descriptors above the baseline")
    g.add_argument("--max-thread-growth", type=int, default=th.max_thread_growth, help="threads above the baseline")
    g = p.add_argument_group("report")
    g.add_argument("--percentiles", type=_csv(float), default=[50.0, 90.0, 99.0], help="P99 is always added")
    g.add_argument("--out", help="write the JSON result here")
    g.add_argument("--plot", metavar="DIR", help="write soak.png (the windows against time) into DIR")
    g.add_argument("--no-progress", action="store_true", help="no live progress display")
    p.set_defaults(func=_soak_command)


def _soak_command(args) -> int:
    from tokenfab.bench.soak_cli import soak_command
    return soak_command(args, _stdout_console())


def _compare_parser(subs) -> None:
    p = subs.add_parser("compare", help="bench results side by side, with ratios to the first")
    p.add_argument("results", nargs="+", metavar="RESULT.json")
    p.add_argument("--labels", type=_csv(str), help="column names, comma-separated (default: file names)")
    p.add_argument("--run", type=int, default=0, help="which run of each file (sweeps hold several; -1 = last)")
    p.add_argument("--plot", metavar="DIR", help="write overlaid latency CDFs into DIR")
    p.set_defaults(func=compare_command)


def _offline_parser(subs) -> None:
    p = subs.add_parser("offline", help="prefill and decode tok/s of the in-process engine",
                        formatter_class=_DefaultsFormatter)
    p.add_argument("--model", help="a .gguf file or HF folder (default: the bundled model)")
    p.add_argument("--batch-sizes", type=_csv(int), default=[1, 4, 16])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, help="engine cap on running sequences (default: largest batch)")
    p.add_argument("--max-num-batched-tokens", type=int, help="engine token budget per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--out", help="write the JSON result here")
    p.set_defaults(func=offline_command)


def _stdout_console():
    """Rich console for the result tables; piped output gets room for the wide tables."""
    import sys

    from rich.console import Console
    return Console() if sys.stdout.isatty() else Console(width=160)


def serve_config(args):
    """ServeConfig from parsed arguments, validated (ValueError says what to change)."""
    import json
    import math

    from tokenfab.bench.agent import AgentConfig
    from tokenfab.bench.aggregate import make_buckets, parse_slos
    from tokenfab.bench.arrivals import parse_rate
    from tokenfab.bench.client import normalize_base_url
    from tokenfab.bench.datasets import DatasetConfig
    from tokenfab.bench.lengths import parse_length
    from tokenfab.bench.serving import ServeConfig

    name, path = DatasetConfig.parse_name(args.dataset)
    if path is not None and not os.path.isfile(path):
        raise ValueError(f"dataset file {path} does not exist")
    endpoint = args.endpoint or ("chat" if name == "agent" else "completions")
    agent = None
    if name == "agent":
        if endpoint != "chat":
            raise ValueError("--dataset agent sends conversations: use --endpoint chat (or leave --endpoint out)")
        if args.sweep and args.sweep.strip() == "auto":
            raise ValueError("--sweep auto is for requests; with --dataset agent give session rates, e.g. --sweep 0.5,1,2")
        agent = AgentConfig(num_sessions=args.num_sessions, turns=args.turns, system_len=args.system_len,
                            user_len=args.user_len, tool_len=args.tool_len, output_len=args.output_len,
                            think_time=args.think_time, num_tools=args.num_tools, range_ratio=args.range_ratio)
        agent.validate()
    dataset = DatasetConfig(name=name, path=path, endpoint=endpoint, input_len=args.input_len,
                            output_len=args.output_len, range_ratio=args.range_ratio, num_prefixes=args.num_prefixes,
                            prefix_len=args.prefix_len, long_fraction=args.long_fraction,
                            long_input_len=args.long_input_len)
    for spec in (args.input_len, args.output_len, args.long_input_len):
        parse_length(spec, args.range_ratio)
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts {args.num_prompts}: need at least 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency {args.max_concurrency}: need at least 1 (or leave it out for no cap)")
    if args.warmup < 0:
        raise ValueError(f"--warmup {args.warmup}: need 0 or more")
    if not args.percentiles or not all(0 < p <= 100 for p in args.percentiles):
        raise ValueError(f"--percentiles {args.percentiles}: each must be in (0, 100]")
    make_buckets(args.buckets)
    sweep = None
    if args.sweep:
        sweep = "auto" if args.sweep.strip() == "auto" else [parse_rate(x) for x in args.sweep.split(",") if x.strip()]
        if sweep != "auto" and not sweep:
            raise ValueError("--sweep needs rates (e.g. 1,2,4,8) or 'auto'")
    extra = {}
    if args.extra_body:
        try:
            extra = json.loads(args.extra_body)
        except json.JSONDecodeError as e:
            raise ValueError(f"--extra-body is not JSON ({e}); e.g. '{{\"top_k\": 1}}'") from None
        if not isinstance(extra, dict):
            raise ValueError("--extra-body must be a JSON object")
    rate = parse_rate(args.request_rate)
    if args.burstiness <= 0 or math.isnan(args.burstiness):
        raise ValueError(f"--burstiness {args.burstiness} must be positive (1 = Poisson)")
    return ServeConfig(base_url=normalize_base_url(args.base_url), model=args.model, endpoint=endpoint,
                       dataset=dataset, num_prompts=args.num_prompts, request_rate=rate, burstiness=args.burstiness,
                       max_concurrency=args.max_concurrency, sweep=sweep, warmup=args.warmup,
                       slos=parse_slos(args.goodput), buckets=list(args.buckets),
                       percentiles=list(args.percentiles), seed=args.seed, tokenizer=args.tokenizer,
                       api_key=args.api_key or os.environ.get("OPENAI_API_KEY"), stream_usage=args.stream_usage, ignore_eos=args.ignore_eos,
                       temperature=args.temperature, timeout_s=args.timeout, extra_body=extra, agent=agent)


def serve_command(args) -> int:
    import asyncio

    from rich.console import Console

    from tokenfab.bench.agent_run import run_agent
    from tokenfab.bench.client import Endpoint
    from tokenfab.bench.report import LiveProgress, print_result, run_tables
    from tokenfab.bench.schema import build_result, run_json, write_result
    from tokenfab.bench.serving import discover_model, run_serve
    from tokenfab.bench.tokens import load_counter

    cfg = serve_config(args)
    err, out = Console(stderr=True), _stdout_console()
    counter = load_counter(cfg.tokenizer)
    if counter.warning:
        err.print(f"[yellow]warning:[/yellow] {counter.warning}")
    cfg.model = cfg.model or asyncio.run(discover_model(cfg.base_url, cfg.api_key))
    endpoint = Endpoint(base_url=cfg.base_url, model=cfg.model, kind=cfg.endpoint, api_key=cfg.api_key,
                        stream_usage=cfg.stream_usage, ignore_eos=cfg.ignore_eos, temperature=cfg.temperature,
                        extra_body=cfg.extra_body, timeout_s=cfg.timeout_s)
    what = f"{cfg.agent.num_sessions} sessions" if cfg.agent else f"{cfg.num_prompts} prompts"
    err.print(f"benchmarking {endpoint.url} (model {cfg.model}), dataset {cfg.dataset.name}, {what}, "
              f"tokenizer: {counter.source}")
    runner = run_agent if cfg.agent else run_serve

    def show(run):  # each run's tables as soon as it ends, so a long sweep shows progress
        if cfg.sweep is not None:
            for table in run_tables(run_json(run, False), cfg.percentiles, cfg.slos)[:2]:
                err.print(table)

    from tokenfab.bench import spec_metrics
    spec_before = spec_metrics.scrape(cfg.base_url, cfg.api_key)
    if args.no_progress:
        runs, sweep = runner(cfg, counter, endpoint, None, show)
    else:
        with LiveProgress(err) as progress:
            runs, sweep = runner(cfg, counter, endpoint, progress, show)
    result = build_result(cfg, counter, runs, sweep, include_requests=not args.no_requests)
    spec = spec_metrics.acceptance(spec_before, spec_metrics.scrape(cfg.base_url, cfg.api_key))
    if spec is not None:           # the server speculates: its acceptance over these runs (warm-up included)
        result["spec_decode"] = spec
    print_result(out, result)
    if args.out:
        write_result(args.out, result)
        err.print(f"wrote {args.out}")
    if args.plot:
        from tokenfab.bench.plots import plot_result
        full = result if not args.no_requests else build_result(cfg, counter, runs, sweep)
        for path in plot_result(full, args.plot):
            err.print(f"wrote {path}")
    return 0 if any(r.summary["completed"] for r in runs) else 1


def compare_command(args) -> int:
    from rich.console import Console

    from tokenfab.bench.compare import compare_table, default_labels
    from tokenfab.bench.schema import load_result

    results = [load_result(p) for p in args.results]
    labels = args.labels or default_labels(args.results)
    if len(labels) != len(results):
        raise ValueError(f"--labels has {len(labels)} names for {len(results)} files")
    _stdout_console().print(compare_table(results, labels, args.run))
    if args.plot:
        from tokenfab.bench.plots import plot_compare
        runs = [(label, r["runs"][args.run]) for label, r in zip(labels, results) if r["schema"].endswith("serve")]
        for path in plot_compare(runs, args.plot):
            Console(stderr=True).print(f"wrote {path}")
    return 0


def offline_command(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from tokenfab.bench.offline import OfflineConfig, run_offline
    from tokenfab.bench.report import num
    from tokenfab.bench.schema import write_result

    cfg = OfflineConfig(model=args.model, batch_sizes=list(args.batch_sizes), input_len=args.input_len,
                        output_len=args.output_len, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed, warmup=not args.no_warmup)
    err = Console(stderr=True)
    with err.status("running the engine…"):
        result = run_offline(cfg, on_run=lambda r: err.print(f"batch {r.batch_size}: prefill "
                                                             f"{num(r.prefill_tok_s, 1)} tok/s, decode "
                                                             f"{num(r.decode_tok_s, 1)} tok/s"))
    t = Table(title=f"Offline engine · input {cfg.input_len} · output {cfg.output_len} tokens", title_justify="left")
    for col in ("Batch", "Prefill tok/s", "Decode tok/s", "Decode tok/s per seq", "Total tok/s", "Prefill s", "Total s"):
        t.add_column(col, justify="right")
    for r in result["runs"]:
        t.add_row(str(r["batch_size"]), num(r["prefill_tok_s"], 1), num(r["decode_tok_s"], 1),
                  num(r["decode_tok_s_per_seq"], 1), num(r["total_tok_s"], 1), num(r["prefill_s"], 3),
                  num(r["total_s"], 3))
    _stdout_console().print(t)
    if args.out:
        write_result(args.out, result)
        err.print(f"wrote {args.out}")
    return 0
