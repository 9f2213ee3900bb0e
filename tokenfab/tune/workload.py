"""The workload `tokenfab tune` measures with: `bench serve` flags, or a bench result to replay.

    --workload "--dataset mixed --num-prompts 40 --input-len 128 --output-len 32 --request-rate 2"
    --workload result.json        # a `tokenfab bench serve --out` file: its dataset, rate and lengths

Either way it ends as `bench serve` flags, checked by bench's own parser and validation before
anything starts. A replayed result gives its settings, not its recorded prompts: each run draws
fresh prompts from the same distributions (bench's seed + run number), as a sweep does.
"""
from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass

# What a tune run sets itself, so a workload must not.
_OWNED = {"--base-url": "tune starts its own servers", "--goodput": "the targets are the SLOs",
          "--sweep": "each measurement is one run at the workload's rate", "--out": "tune keeps the results",
          "--plot": "tune writes its own plot", "--model": "tune asks its servers"}


@dataclass(frozen=True, slots=True)
class Workload:
    flags: tuple[str, ...]          # bench serve flags
    source: str                     # what the user gave

    def bench_flags(self, base_url: str, slos: dict[str, float], seed: int | None = None) -> list[str]:
        flags = list(self.flags)
        if seed is not None:
            flags += ["--seed", str(seed)]
        goodput = [f"{k}:{v:g}" for k, v in slos.items()]
        return ["--base-url", base_url, *flags, *(["--goodput", *goodput] if goodput else []),
                "--no-progress", "--no-requests"]

    def config(self, slos: dict[str, float]):
        """bench's ServeConfig for these flags (ValueError says what is wrong)."""
        from tokenfab.bench.cli import parse_serve_flags, serve_config
        return serve_config(parse_serve_flags(self.bench_flags("http://127.0.0.1:1", slos)))


def _from_result(path: str) -> list[str]:
    from tokenfab.bench.schema import SCHEMA, load_result
    result = load_result(path)
    if result["schema"] != SCHEMA:
        raise ValueError(f"--workload {path} is a `bench offline` result; tune replays `bench serve` results")
    c = result["config"]
    dataset = f"jsonl:{c['dataset_path']}" if c.get("dataset") == "jsonl" else c.get("dataset", "random")
    flags = ["--dataset", dataset, "--endpoint", c["endpoint"], "--num-prompts", str(c["num_prompts"]),
             "--input-len", str(c["input_len"]), "--output-len", str(c["output_len"]),
             "--range-ratio", str(c["range_ratio"]), "--num-prefixes", str(c["num_prefixes"]),
             "--prefix-len", str(c["prefix_len"]), "--long-fraction", str(c["long_fraction"]),
             "--long-input-len", str(c["long_input_len"]), "--request-rate", str(c["request_rate"]),
             "--burstiness", str(c["burstiness"]), "--warmup", str(c["warmup"]), "--seed", str(c["seed"]),
             "--stream-usage", c["stream_usage"], "--temperature", str(c["temperature"]),
             "--ignore-eos" if c["ignore_eos"] else "--no-ignore-eos"]
    if c.get("max_concurrency"):
        flags += ["--max-concurrency", str(c["max_concurrency"])]
    if c.get("extra_body"):
        flags += ["--extra-body", json.dumps(c["extra_body"])]
    agent = c.get("agent")
    if agent:
        for key in ("num_sessions", "turns", "system_len", "user_len", "tool_len", "num_tools", "think_time"):
            flags += ["--" + key.replace("_", "-"), str(agent[key])]
    return flags


def parse_workload(spec: str, slos: dict[str, float], tokenizer: str | None = None) -> Workload:
    """The workload for `--workload SPEC`, validated; `tokenizer` (the served model's) unless given."""
    if spec.endswith(".json") and os.path.isfile(spec):
        flags = _from_result(spec)
    elif spec.endswith(".json"):
        raise ValueError(f"--workload {spec}: no such file (a `bench serve --out` result)")
    else:
        flags = shlex.split(spec)
    for f in flags:
        name = f.split("=", 1)[0]
        if name in _OWNED:
            raise ValueError(f"--workload must not set {name}: {_OWNED[name]}")
    if tokenizer and not any(f.split("=", 1)[0] == "--tokenizer" for f in flags):
        flags += ["--tokenizer", tokenizer]
    workload = Workload(tuple(flags), spec)
    workload.config(slos)
    return workload
