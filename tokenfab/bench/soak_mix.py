"""The request mix of a soak (`tokenfab bench soak`): what each request is, drawn from a seeded RNG.

Each request independently is:
- structured (`structured_fraction`): a chat request with `response_format` json_schema, whose
  finished output must parse as the schema's object; otherwise chat (`chat_fraction`) or completions;
- streamed (`stream_fraction`) or not; a streamed one is cut by the client (`abort_fraction`) after a
  random number of content chunks, from 0 (right after the headers, while the prompt is still in
  prefill) to half the tokens asked for;
- short or long, as the `mixed` dataset (datasets.py) draws them: a `long_fraction` share of prompts of
  `long_input_len` tokens among prompts of `input_len`.

Prompts come from datasets.py in batches, fresh ones for every batch (seed + batch number), so the
server's prefix cache sees new prompts all run long, as it would from real users.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field, replace

from tokenfab.bench.client import Endpoint
from tokenfab.bench.datasets import BenchRequest, DatasetConfig, build_dataset
from tokenfab.bench.tokens import TokenCounter

# Short enough that the model finishes it within a few dozen tokens; `enum` keeps the grammar small.
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no", "maybe"]}},
          "required": ["answer"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "soak_answer", "schema": SCHEMA, "strict": True}}
STRUCTURED_MIN_TOKENS = 32           # room for the object whatever --output-len says
BATCH = 32                           # prompts built at a time, per endpoint


@dataclass(frozen=True, slots=True)
class SoakMix:
    chat_fraction: float = 0.5
    stream_fraction: float = 0.75
    abort_fraction: float = 0.1        # of streamed requests
    structured_fraction: float = 0.1
    long_fraction: float = 0.1
    input_len: str = "128"
    long_input_len: str = "1024"
    output_len: str = "64"

    def validate(self) -> None:
        for name in ("chat_fraction", "stream_fraction", "abort_fraction", "structured_fraction", "long_fraction"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"--{name.replace('_', '-')} {v}: a share, between 0 and 1")


@dataclass(slots=True)
class SoakRequest:
    """One request of the mix: its prompt, where it goes, and how the client treats it."""
    req: BenchRequest
    endpoint: Endpoint
    stream: bool
    hang_up_after: int | None = None   # content chunks before the client hangs up (None: it never does)
    structured: bool = False

    @property
    def kind(self) -> str:
        """e.g. "chat/stream/short", "completions/plain/long", "structured/stream/short/abort"."""
        parts = ["structured" if self.structured else self.endpoint.kind, "stream" if self.stream else "plain",
                 self.req.tag]
        return "/".join(parts + (["abort"] if self.hang_up_after is not None else []))


@dataclass(slots=True)
class SoakWorkload:
    """Draws requests for the mix; prompts are built a batch at a time (`counter` measures them)."""
    mix: SoakMix
    counter: TokenCounter
    endpoints: dict[str, Endpoint]     # "completions", "chat", "structured"
    seed: int = 0
    rng: random.Random = field(init=False)
    _pools: dict[str, list[BenchRequest]] = field(init=False, default_factory=dict)
    _batches: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def next(self) -> SoakRequest:
        m, rng = self.mix, self.rng
        structured = rng.random() < m.structured_fraction
        kind = "chat" if structured or rng.random() < m.chat_fraction else "completions"
        stream = rng.random() < m.stream_fraction
        req = self._prompt(kind)
        hang_up = None
        if stream and rng.random() < m.abort_fraction:
            hang_up = rng.randint(0, max(req.output_len // 2, 1))
        if structured:
            req = replace(req, output_len=max(req.output_len, STRUCTURED_MIN_TOKENS))
        return SoakRequest(req, self.endpoints["structured" if structured else kind], stream, hang_up, structured)

    def _prompt(self, kind: str) -> BenchRequest:
        pool = self._pools.setdefault(kind, [])
        if not pool:
            self._batches += 1
            cfg = DatasetConfig(name="mixed", endpoint=kind, input_len=self.mix.input_len,
                                output_len=self.mix.output_len, long_fraction=self.mix.long_fraction,
                                long_input_len=self.mix.long_input_len)
            pool.extend(reversed(build_dataset(cfg, self.counter, BATCH, self.seed * 100_003 + self._batches)))
        return pool.pop()


def make_endpoints(base: Endpoint) -> dict[str, Endpoint]:
    """The three endpoints of a mix from one (URL, model, key, usage and timeout settings)."""
    structured_body = {**base.extra_body, "response_format": RESPONSE_FORMAT}
    return {"completions": replace(base, kind="completions"),
            "chat": replace(base, kind="chat"),
            # ignore_eos would keep generating past the closed object: the grammar must be let finish
            "structured": replace(base, kind="chat", ignore_eos=False, extra_body=structured_body)}


def structured_error(text: str, finish_reason: str | None) -> str | None:
    """Why a structured answer breaks its schema, or None. Only a finished answer (`stop`) is judged:
    one cut at max_tokens is a prefix of a valid object, as it should be."""
    if finish_reason != "stop":
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return f"structured output is not JSON ({e.msg} at {e.pos}): {text[:60]!r}"
    if not isinstance(obj, dict) or obj.get("answer") not in SCHEMA["properties"]["answer"]["enum"] \
            or set(obj) != {"answer"}:
        return f"structured output breaks its schema: {text[:60]!r}"
    return None

