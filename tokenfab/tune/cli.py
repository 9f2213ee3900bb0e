"""`tokenfab tune [MODEL]`: the serve configuration that meets latency targets and a quality floor on
a workload, at the highest goodput per core (or the lowest cost per million tokens), measured on this
machine, written as a `tokenfab serve --config` file, and validated by consecutive runs.

Registering the parser imports nothing heavy; the handler (run.py) does. docs/tune.md.
"""
from __future__ import annotations

import argparse


def _csv(kind, choices: tuple | None = None):
    def parse(text: str):
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError("expected a comma-separated list")
        try:
            values = [kind(x) for x in items]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {kind.__name__}s") from None
        if choices is not None:
            bad = [x for x in items if x not in choices]
            if bad:
                raise argparse.ArgumentTypeError(f"{', '.join(bad)}: choose from {', '.join(choices)}")
        if kind is int and any(v < 1 for v in values):
            raise argparse.ArgumentTypeError(f"{text!r}: each must be a positive integer")
        return values
    return parse


def _on_off(text: str) -> list[bool]:
    return [x == "on" for x in _csv(str, ("on", "off"))(text)]


def _spec(text: str) -> list[bool]:
    return [x == "ngram" for x in _csv(str, ("off", "ngram"))(text)]


def add_parser(subs) -> None:
    from tokenfab.tune.space import KV_DTYPES, WEIGHT_FORMATS
    p = subs.add_parser(
        "tune", help="find the serve configuration that meets latency targets and a quality floor, measured",
        description="Explore weight format, KV dtype, threads, max-num-seqs, token budget, chunking and "
                    "speculative decoding on this machine: quality by `quant eval`, speed by short bench runs "
                    "against real servers, the rest predicted by the calibrated planner. Writes the best "
                    "configuration as a `tokenfab serve --config` file and validates it. docs/tune.md.")
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="a .gguf file or HF folder (default: the bundled SmolLM2-135M-Instruct)")
    t = p.add_argument_group("targets")
    t.add_argument("--p99-ttft-ms", type=float, default=None, metavar="MS", help="P99 time to first token")
    t.add_argument("--p99-tpot-ms", type=float, default=None, metavar="MS", help="P99 time per output token")
    q = t.add_mutually_exclusive_group()
    q.add_argument("--max-kl", type=float, default=None, metavar="NATS",
                   help="quality floor: mean KL divergence against the full-precision model at most this")
    q.add_argument("--min-top1", type=float, default=None, metavar="PCT",
                   help="quality floor: same top-1 token as the full-precision model at least this %% of the time")
    t.add_argument("--text", default=None, metavar="FILE",
                   help="calibration text for the quality floor (default: the bundled text quant eval scores)")
    t.add_argument("--ctx", type=int, default=256, metavar="N", help="quality: tokens per window (default: 256)")
    t.add_argument("--max-windows", type=int, default=2, metavar="N", help="quality: windows scored (default: 2)")
    w = p.add_argument_group("workload and budget")
    w.add_argument("--workload", default="--dataset mixed --num-prompts 40 --input-len 128 --output-len 32 "
                                         "--long-input-len 1024 --long-fraction 0.1 --request-rate 2",
                   help="`bench serve` flags (quoted), or a `bench serve --out` JSON result to replay "
                        "(default: a mixed chat load, 40 prompts at 2 req/s)")
    w.add_argument("--budget", type=float, default=600.0, metavar="SECONDS",
                   help="time for the search; validation runs after it (default: 600)")
    w.add_argument("--hardware", default=None, metavar="NAME",
                   help="rank by cost per million good output tokens at this catalogue entry's usd_per_hour "
                        "(`tokenfab plan hardware`), shared by the threads a point uses (default: goodput per core)")
    w.add_argument("--validation-runs", type=int, default=3, metavar="N",
                   help="consecutive bench runs the chosen configuration must pass (default: 3; 0: none)")
    w.add_argument("--out-dir", default="tune-out", metavar="DIR",
                   help="results.jsonl (resumed when present), serve.yaml, tune.png, bench runs and step logs "
                        "(default: tune-out)")
    w.add_argument("--no-progress", action="store_true", help="no live progress display")
    s = p.add_argument_group("design space (comma-separated values per axis)")
    s.add_argument("--weights", type=_csv(str, WEIGHT_FORMATS), default=None,
                   help="weight formats (default: gguf,none,int8,int4-g32,int4-g128; gguf only for GGUF files)")
    s.add_argument("--kv-cache-dtypes", type=_csv(str, KV_DTYPES), default=list(KV_DTYPES),
                   help="KV cache dtypes (default: auto,int8)")
    s.add_argument("--threads", type=_csv(int), default=None, help="thread counts (default: 1, half, all cores)")
    s.add_argument("--max-num-seqs", type=_csv(int), default=[4, 16, 64], help="(default: 4,16,64)")
    s.add_argument("--max-num-batched-tokens", type=_csv(int), default=[256, 2048], help="(default: 256,2048)")
    s.add_argument("--chunked-prefill", type=_on_off, default=[True, False], help="on,off (default: both)")
    s.add_argument("--speculative", type=_spec, default=[False, True],
                   help="off,ngram: speculative decoding by prompt lookup (default: both)")
    p.set_defaults(func=_tune_command)


def _tune_command(args) -> int:
    from tokenfab.tune.run import tune_command
    return tune_command(args)
