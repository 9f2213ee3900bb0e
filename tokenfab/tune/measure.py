"""Speed: a short `bench serve` run against a `tokenfab serve` started with one point's flags.

Each measurement starts its own server process (flags on its command line, or `--config FILE` for
validation), waits for /health, runs the workload once through bench's own code, and stops the
server. The server writes a step log (`--step-log`), the planner's measured step table for that
build (predict.py). A measurement keeps its requests' TTFT, TPOT and output length, so its metrics
and goodput can be computed again for other targets when a results file is resumed.
"""
from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import numpy as np

from tokenfab.bench import local_server


_COUNTERS: dict = {}


@contextlib.contextmanager
def serving(model: str | None, flags: list[str], log_path: str | Path, step_log: str | Path | None = None,
            timeout_s: float = 300.0):
    """`tokenfab serve` for one point (bench/local_server.py), with its step log; yields its base URL."""
    with local_server.serving([*([model] if model else []), "--no-ui", *flags,
                               *(["--step-log", str(step_log)] if step_log else [])], log_path, timeout_s) as url:
        yield url


def _counter(tokenizer: str | None):
    from tokenfab.bench.tokens import load_counter
    if tokenizer not in _COUNTERS:
        _COUNTERS[tokenizer] = load_counter(tokenizer)
    return _COUNTERS[tokenizer]


def bench_once(url: str, workload, slos: dict[str, float], seed: int | None = None) -> dict:
    """One `bench serve` run of the workload against `url`: bench's JSON result, requests included."""
    from tokenfab.bench.agent_run import run_agent
    from tokenfab.bench.cli import parse_serve_flags, serve_config
    from tokenfab.bench.client import Endpoint
    from tokenfab.bench.schema import build_result
    from tokenfab.bench.serving import discover_model, run_serve

    cfg = serve_config(parse_serve_flags(workload.bench_flags(url, slos, seed)))
    counter = _counter(cfg.tokenizer)
    cfg.model = asyncio.run(discover_model(cfg.base_url, cfg.api_key))
    endpoint = Endpoint(base_url=cfg.base_url, model=cfg.model, kind=cfg.endpoint, api_key=cfg.api_key,
                        stream_usage=cfg.stream_usage, ignore_eos=cfg.ignore_eos, temperature=cfg.temperature,
                        extra_body=cfg.extra_body, timeout_s=cfg.timeout_s)
    runs, sweep = (run_agent if cfg.agent else run_serve)(cfg, counter, endpoint, None, None)
    return build_result(cfg, counter, runs, sweep)


def compact_run(result: dict) -> dict:
    """What a results line keeps of a bench result: each completed request's (TTFT ms, TPOT ms or None,
    output tokens), the failures and the run's duration."""
    run = result["runs"][0]
    ok = [r for r in run["requests"] if r["success"]]
    return {"requests": [[round(r["ttft_ms"], 3), None if r["tpot_ms"] is None else round(r["tpot_ms"], 4),
                          r["output_len"]] for r in ok],
            "failed": run["summary"]["failed"], "duration_s": run["summary"]["duration_s"],
            "errors": [e["error"] for e in run["errors"][:3]]}


def run_metrics(run: dict, slos: dict[str, float]) -> dict:
    """P99 TTFT and TPOT, throughput and goodput (requests/s, and output tokens/s, of requests meeting
    every SLO, as bench counts goodput) of a compact run."""
    reqs, dur = run["requests"], max(run["duration_s"], 1e-9)
    ttft = [r[0] for r in reqs]
    tpot = [r[1] for r in reqs if r[1] is not None]

    def good(r) -> bool:
        return r[0] <= slos.get("ttft", np.inf) and (r[1] or 0.0) <= slos.get("tpot", np.inf)

    good_reqs = [r for r in reqs if good(r)]
    return {"completed": len(reqs), "failed": run["failed"], "duration_s": run["duration_s"],
            "p99_ttft_ms": float(np.percentile(ttft, 99)) if ttft else None,
            "p99_tpot_ms": float(np.percentile(tpot, 99)) if tpot else None,
            "request_throughput": len(reqs) / dur, "output_throughput": sum(r[2] for r in reqs) / dur,
            "goodput": len(good_reqs) / dur, "good_output_tok_s": sum(r[2] for r in good_reqs) / dur}
