"""Request sets for `bench serve`: random, shared-prefix, mixed, and jsonl.

Every request carries its exact prompt length as the server will count it (see tokens.py)
and the number of tokens to ask for. The sets:

- random: prompt and output lengths drawn from the given distributions.
- shared-prefix: an agent-style load. K system prompts of L tokens, each shared by M requests
  (M = num_prompts // K), each request adding its own question; the order is shuffled.
- mixed: mostly short chats, plus a fixed share of very long prompts. This is the tail-latency
  case, where one long prefill slows every short request batched with it.
- jsonl: one JSON object per line, ``{"prompt": "..."}`` or ``{"messages": [...]}``, optionally
  with ``"max_tokens"``; lines are used in order and cycled when more prompts are asked for.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

import numpy as np

from tokenfab.bench.lengths import parse_length
from tokenfab.bench.tokens import TokenCounter

DATASETS = ("random", "shared-prefix", "mixed", "jsonl", "agent")   # agent: sessions, see agent.py


@dataclass(slots=True)
class BenchRequest:
    prompt: str | None            # completions endpoint
    messages: list[dict] | None   # chat endpoint
    prompt_len: int               # tokens the server will see (exact with a tokenizer)
    output_len: int               # max_tokens asked for
    tag: str = ""                 # where it came from: "short"/"long", "prefix-3", "line-12", "s3-t2"
    tools: list[dict] | None = None   # chat: function tools sent with the request (the agent workload)


@dataclass(slots=True)
class DatasetConfig:
    name: str = "random"               # random | shared-prefix | mixed | jsonl
    path: str | None = None            # jsonl only
    endpoint: str = "completions"      # completions | chat: decides how prompts are counted
    input_len: str = "256"             # see lengths.py; shared-prefix: the per-request part
    output_len: str = "128"
    range_ratio: float = 0.0
    num_prefixes: int = 4              # shared-prefix: K
    prefix_len: int = 512              # shared-prefix: L
    long_fraction: float = 0.05        # mixed: share of long prompts
    long_input_len: str = "4096"       # mixed: their length

    @staticmethod
    def parse_name(spec: str) -> tuple[str, str | None]:
        """``random`` … or ``jsonl:PATH`` → (name, path)."""
        name, _, path = spec.partition(":")
        if name not in DATASETS:
            raise ValueError(f"unknown dataset {spec!r}: choose random, shared-prefix, mixed, agent or jsonl:PATH")
        if name == "jsonl" and not path:
            raise ValueError("the jsonl dataset needs a file: --dataset jsonl:PATH")
        return name, path or None


def build_dataset(cfg: DatasetConfig, counter: TokenCounter, num_prompts: int, seed: int) -> list[BenchRequest]:
    if num_prompts < 1:
        raise ValueError(f"num_prompts is {num_prompts}; ask for at least 1")
    if cfg.name == "agent":
        raise ValueError("the agent dataset is sessions, not independent requests: build it with agent.build_sessions")
    builder = {"random": _random, "shared-prefix": _shared_prefix, "mixed": _mixed, "jsonl": _jsonl}[cfg.name]
    return builder(cfg, counter, num_prompts, seed)


def _measure(cfg: DatasetConfig, counter: TokenCounter, system: str | None = None):
    """How the server counts a prompt whose variable part is `text`."""
    if cfg.endpoint == "chat":
        def chat(texts: list[str]) -> list[int]:
            return counter.count_chats([_chat(t, system) for t in texts])
        return chat
    return counter.count_prompts


def _chat(user: str, system: str | None) -> list[dict]:
    head = [{"role": "system", "content": system}] if system is not None else []
    return head + [{"role": "user", "content": user}]


def _make(cfg: DatasetConfig, text: str, n: int, out: int, tag: str, system: str | None = None) -> BenchRequest:
    if cfg.endpoint == "chat":
        return BenchRequest(None, _chat(text, system), n, out, tag)
    return BenchRequest((system or "") + text, None, n, out, tag)


def _random(cfg, counter, n, seed, tag="random"):
    np_rng, rng = np.random.default_rng(seed), random.Random(seed)
    ins = parse_length(cfg.input_len, cfg.range_ratio).sample(np_rng, n)
    outs = parse_length(cfg.output_len, cfg.range_ratio).sample(np_rng, n)
    texts = counter.texts_of_length(rng, ins, _measure(cfg, counter))
    return [_make(cfg, t, m, o, tag) for (t, m), o in zip(texts, outs)]


def _shared_prefix(cfg, counter, n, seed):
    k = cfg.num_prefixes
    if k < 1 or n < k:
        raise ValueError(f"shared-prefix needs 1 <= num_prefixes ({k}) <= num_prompts ({n})")
    if cfg.prefix_len < 1:
        raise ValueError(f"prefix_len is {cfg.prefix_len}; it must be at least 1 token")
    per = n // k
    np_rng, rng = np.random.default_rng(seed), random.Random(seed)
    prefixes = [t for t, _ in counter.texts_of_length(rng, [cfg.prefix_len] * k, counter.count_text)]
    suffix_lens = parse_length(cfg.input_len, cfg.range_ratio).sample(np_rng, k * per)
    outs = parse_length(cfg.output_len, cfg.range_ratio).sample(np_rng, k * per)
    requests = []
    for g, prefix in enumerate(prefixes):
        lens = suffix_lens[g * per:(g + 1) * per]
        # The suffix is measured in place, after its prefix, so prompt_len is the whole prompt.
        full = _measure(cfg, counter, system=prefix if cfg.endpoint == "chat" else None)
        glue = "" if cfg.endpoint == "chat" else prefix
        base = full([glue])[0]  # the prompt with an empty question: BOS or template, plus the prefix
        texts = counter.texts_of_length(rng, [base + m for m in lens], full, prefix=glue)
        for (text, measured), out in zip(texts, outs[g * per:(g + 1) * per]):
            requests.append(_make(cfg, text, measured, out, f"prefix-{g}", system=prefix))
    rng.shuffle(requests)
    return requests


def _mixed(cfg, counter, n, seed):
    if not 0.0 <= cfg.long_fraction <= 1.0:
        raise ValueError(f"long_fraction {cfg.long_fraction} must be between 0 and 1")
    n_long = round(cfg.long_fraction * n)
    short = _random(cfg, counter, n - n_long, seed, tag="short")
    long_cfg = DatasetConfig(**{**_fields(cfg), "input_len": cfg.long_input_len})
    long = _random(long_cfg, counter, n_long, seed + 1, tag="long")
    # Fixed count, random places: the tail case is reproducible run to run.
    where = set(random.Random(seed).sample(range(n), n_long))
    out, s, l = [], iter(short), iter(long)
    for i in range(n):
        out.append(next(l) if i in where else next(s))
    return out


def _fields(cfg: DatasetConfig) -> dict:
    return {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}


def _jsonl(cfg, counter, n, seed):
    rows = []
    with open(cfg.path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{cfg.path} line {lineno} is not JSON: {e}") from None
            if not isinstance(row, dict) or not (isinstance(row.get("prompt"), str) or isinstance(row.get("messages"), list)):
                raise ValueError(f"{cfg.path} line {lineno}: expected an object with \"prompt\" (a string) "
                                 "or \"messages\" (a list of {role, content})")
            if "messages" in row and cfg.endpoint != "chat":
                raise ValueError(f"{cfg.path} line {lineno} holds chat messages; use --endpoint chat")
            rows.append((lineno, row))
    if not rows:
        raise ValueError(f"{cfg.path} has no prompts")
    outs = parse_length(cfg.output_len, cfg.range_ratio).sample(np.random.default_rng(seed), n)
    picked = [rows[i % len(rows)] for i in range(n)]
    requests = []
    for (lineno, row), out in zip(picked, outs):
        out = int(row.get("max_tokens") or row.get("output_len") or out)
        if cfg.endpoint == "chat":
            msgs = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
            requests.append(BenchRequest(None, msgs, 0, out, f"line-{lineno}"))
        else:
            requests.append(BenchRequest(row["prompt"], None, 0, out, f"line-{lineno}"))
    if cfg.endpoint == "chat":
        lens = counter.count_chats([r.messages for r in requests])
    else:
        lens = counter.count_prompts([r.prompt for r in requests])
    for r, m in zip(requests, lens):
        r.prompt_len = m
    return requests
