"""The design space `tokenfab tune` explores: one `Point` per combination of serve settings.

The axes, each a serve flag:
- weights (`--quantization`): none (float), gguf (the file's own blocks), int8, int4 at group sizes;
- KV cache dtype (`--kv-cache-dtype`): auto, int8;
- threads (`--num-threads`);
- `--max-num-seqs`, `--max-num-batched-tokens`, `--enable-chunked-prefill`;
- speculative decoding (ngram prompt lookup, which needs no draft model) on or off.

A point's *engine build* (weights, KV dtype, threads, speculation) decides what one engine step costs;
its *scheduler settings* (sequences, token budget, chunking) decide which steps run. The planner
replays a measured run of one build under other scheduler settings (predict.py), so a build needs one
measurement before its other points can be predicted.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields

from tokenfab.config import EngineConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
WEIGHT_FORMATS = ("none", "gguf", "int8", "int4-g32", "int4-g64", "int4-g128")
KV_DTYPES = ("auto", "int8")


@dataclass(frozen=True, slots=True)
class Point:
    weights: str                    # --quantization
    kv_cache_dtype: str
    num_threads: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    speculative: bool               # ngram prompt lookup, NGRAM

    def key(self) -> str:
        """A stable identity, for the results file."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "Point":
        return cls(**{f.name: d[f.name] for f in fields(cls)})

    def build(self) -> tuple:
        """What one step costs depends on these alone."""
        return (self.weights, self.kv_cache_dtype, self.num_threads, self.speculative)

    def quality_key(self) -> tuple[str, str]:
        return (self.weights, self.kv_cache_dtype)

    def serve_flags(self) -> dict:
        """The point as `tokenfab serve` flags (a config file's keys)."""
        flags = {"quantization": self.weights, "kv_cache_dtype": self.kv_cache_dtype,
                 "num_threads": self.num_threads, "max_num_seqs": self.max_num_seqs,
                 "max_num_batched_tokens": self.max_num_batched_tokens,
                 "enable_chunked_prefill": self.enable_chunked_prefill}
        if self.speculative:
            flags["speculative_config"] = dict(NGRAM)
        return flags

    def argv(self) -> list[str]:
        out = []
        for k, v in self.serve_flags().items():
            flag = "--" + k.replace("_", "-")
            if isinstance(v, bool):
                out.append(flag if v else "--no-" + flag[2:])
            else:
                out += [flag, json.dumps(v) if isinstance(v, dict) else str(v)]
        return out

    def label(self) -> str:
        return (f"{self.weights} kv:{self.kv_cache_dtype} t{self.num_threads} seqs {self.max_num_seqs} "
                f"budget {self.max_num_batched_tokens}{'' if self.enable_chunked_prefill else ' nochunk'}"
                f"{' ngram' if self.speculative else ''}")


@dataclass(slots=True)
class Axes:
    weights: list[str]
    kv_cache_dtypes: list[str]
    threads: list[int]
    max_num_seqs: list[int]
    max_num_batched_tokens: list[int]
    chunked_prefill: list[bool]
    speculative: list[bool]

    def points(self) -> list[Point]:
        return [Point(w, kv, t, s, b, c, sp) for w in self.weights for kv in self.kv_cache_dtypes
                for t in self.threads for sp in self.speculative for s in self.max_num_seqs
                for b in self.max_num_batched_tokens for c in self.chunked_prefill]


def default_threads(cores: int | None = None) -> list[int]:
    cores = cores or os.cpu_count() or 1
    return sorted({1, max(1, cores // 2), cores})


def default_weights(is_gguf: bool) -> list[str]:
    return ["gguf", "none", "int8", "int4-g32", "int4-g128"] if is_gguf else ["none", "int8", "int4-g32", "int4-g128"]


def baseline(model: str | None, is_gguf: bool, cores: int | None = None) -> Point:
    """The engine's defaults as a point: what `tokenfab serve` runs with no flags."""
    d = EngineConfig()
    return Point("gguf" if is_gguf else "none", d.kv_cache_dtype, cores or os.cpu_count() or 1, d.max_num_seqs,
                 d.max_num_batched_tokens, d.enable_chunked_prefill, False)


def check_point(point: Point, model: str | None, is_gguf: bool) -> str | None:
    """Why the engine would refuse this point, or None."""
    if point.weights == "gguf" and not is_gguf:
        return "gguf weights need a GGUF file"
    config = EngineConfig(model=model, **{k: v for k, v in point.serve_flags().items() if k != "quantization"},
                          quantization=point.weights)
    try:
        config.validate()
    except ValueError as e:
        return str(e)
    if point.enable_chunked_prefill is False and point.max_num_batched_tokens < 2:
        return "too small a token budget"
    return None
