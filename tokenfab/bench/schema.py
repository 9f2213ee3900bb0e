"""The JSON result of `bench serve`: a stable, documented layout (docs/bench.md, "JSON output").

The layout only changes with `SCHEMA_VERSION`; tests pin every key. Summary keys follow vLLM's
`bench serve` result names (`request_throughput`, `p99_ttft_ms`, …) so existing tooling ports.
Infinite rates are written as the string "inf" (JSON has no infinity), as vLLM does.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import sys

from tokenfab.bench.serving import RunResult, ServeConfig
from tokenfab.bench.tokens import TokenCounter

SCHEMA = "tokenfab.bench.serve"
SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)   # 2 added config.agent and runs[].sessions, null for the other datasets
OFFLINE_SCHEMA = "tokenfab.bench.offline"


def rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def rate_value(rate: float | str) -> float:
    return math.inf if rate == "inf" else float(rate)


def config_json(cfg: ServeConfig) -> dict:
    d = cfg.dataset
    return {
        "base_url": cfg.base_url, "model": cfg.model, "endpoint": cfg.endpoint,
        "dataset": d.name, "dataset_path": d.path, "num_prompts": cfg.num_prompts,
        "input_len": d.input_len, "output_len": d.output_len, "range_ratio": d.range_ratio,
        "num_prefixes": d.num_prefixes, "prefix_len": d.prefix_len,
        "long_fraction": d.long_fraction, "long_input_len": d.long_input_len,
        "request_rate": rate_json(cfg.request_rate), "burstiness": cfg.burstiness,
        "max_concurrency": cfg.max_concurrency,
        "sweep": cfg.sweep if cfg.sweep in (None, "auto") else [rate_json(r) for r in cfg.sweep],
        "warmup": cfg.warmup, "goodput": dict(cfg.slos), "buckets": list(cfg.buckets),
        "percentiles": list(cfg.percentiles), "seed": cfg.seed, "stream_usage": cfg.stream_usage,
        "ignore_eos": cfg.ignore_eos, "temperature": cfg.temperature, "timeout_s": cfg.timeout_s,
        "extra_body": dict(cfg.extra_body),
        "agent": dataclasses.asdict(cfg.agent) if cfg.agent is not None else None,
    }  # the API key is never written


def run_json(run: RunResult, include_requests: bool = True) -> dict:
    return {
        "request_rate": rate_json(run.request_rate),
        "burstiness": run.burstiness,
        "max_concurrency": run.max_concurrency,
        "warmup_failed": run.warmup_failed,
        "summary": dict(run.summary),
        "buckets": [dict(b) for b in run.buckets],
        "errors": [dict(e) for e in run.errors],
        "requests": [dataclasses.asdict(r) for r in run.records] if include_requests else [],
        "sessions": run.sessions,
    }


def result_header(config: dict, counter: TokenCounter, schema: str = SCHEMA, version: int = SCHEMA_VERSION) -> dict:
    """What every bench result file opens with (bench serve's and bench soak's): the schema, the versions,
    when and how it ran, the settings and the token counter."""
    from tokenfab.version import __version__
    return {
        "schema": schema,
        "schema_version": version,
        "tokenfab_version": __version__,
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv) if sys.argv and sys.argv[0] else None,
        "config": config,
        "tokenizer": {"source": counter.source, "exact": counter.exact},
    }


def build_result(cfg: ServeConfig, counter: TokenCounter, runs: list[RunResult], sweep: dict,
                 include_requests: bool = True) -> dict:
    return {
        **result_header(config_json(cfg), counter),
        "sweep": {"mode": sweep["mode"], "rates": [rate_json(r) for r in sweep["rates"]],
                  "saturation_request_rate": sweep["saturation_request_rate"]},
        "runs": [run_json(r, include_requests) for r in runs],
    }


def write_result(path: str, result: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, allow_nan=False)
        f.write("\n")


def load_result(path: str) -> dict:
    """A result file of `bench serve` or `bench offline`, checked for its schema and version."""
    try:
        with open(path, encoding="utf-8") as f:
            result = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON ({e}); expected a file written by `tokenfab bench ... --out`") from None
    kind = result.get("schema") if isinstance(result, dict) else None
    if kind not in (SCHEMA, OFFLINE_SCHEMA):
        raise ValueError(f"{path} is not a tokenfab bench result (schema {kind!r}, expected {SCHEMA!r} "
                         f"or {OFFLINE_SCHEMA!r})")
    if result.get("schema_version") not in READABLE_VERSIONS:
        raise ValueError(f"{path} has schema_version {result.get('schema_version')}; this tokenfab reads "
                         f"versions {', '.join(map(str, READABLE_VERSIONS))}")
    return result
