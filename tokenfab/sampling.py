"""SamplingParams: how one request is decoded, with vLLM's field names and meanings.

Validated here, at the boundary; the engine trusts these values afterwards.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from tokenfab.structured_output import StructuredOutputParams


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16          # None: up to max_model_len
    min_tokens: int = 0
    temperature: float = 1.0             # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1                      # -1 or 0: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None          # number of top logprobs per generated token (0: only the chosen one)
    prompt_logprobs: int | None = None   # top logprobs per prompt token (0: only the prompt token's own)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling, in [-100, 100]
    skip_special_tokens: bool = True
    structured_output: StructuredOutputParams | None = None   # a schema/regex/choice/grammar the output matches
    speculative: bool = True             # False: never draft for this request (when the engine speculates)

    def __post_init__(self) -> None:
        self.structured_output = StructuredOutputParams.coerce(self.structured_output)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self) -> None:
        def bad(name: str, value, want: str) -> ValueError:
            return ValueError(f"{name} must be {want}, got {value!r}")

        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise bad("n", self.n, "an integer >= 1")
        # max_tokens 0 scores the prompt only (with prompt_logprobs): it finishes after the prefill.
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 0):
            raise bad("max_tokens", self.max_tokens, "an integer >= 0 (or None)")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        # Bounded so that logits / temperature stays finite in float32 (inf or NaN logits draw garbage).
        if not _is_number(self.temperature) or not 0 <= self.temperature <= 1e4:
            raise bad("temperature", self.temperature, "a number >= 0 (and at most 1e4)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise bad("top_k", self.top_k, "-1 (disabled) or an integer >= 0")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", self.min_p, "in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2 <= v <= 2:
                raise bad(name, v, "in [-2, 2]")
        if not _is_number(self.repetition_penalty) or not 0.01 <= self.repetition_penalty <= 100:
            raise bad("repetition_penalty", self.repetition_penalty, "a number in [0.01, 100]")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad("seed", self.seed, "an integer or None")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", self.stop, "a list of non-empty strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "a list of token ids >= 0")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", self.logprobs, "an integer in [0, 20]")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= 20):
            raise bad("prompt_logprobs", self.prompt_logprobs, "an integer in [0, 20]")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", self.logit_bias, "a dict of token id -> bias")
            for t, b in self.logit_bias.items():
                if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                    raise bad("logit_bias", t, "keyed by token ids >= 0")
                if not _is_number(b) or not -100 <= b <= 100:
                    raise bad("logit_bias", b, f"a bias in [-100, 100] (token {t})")
        if not isinstance(self.speculative, bool):
            raise bad("speculative", self.speculative, "true or false")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "SamplingParams":
        """Build from keyword arguments, rejecting unknown names with a clear message."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)


def _is_number(v) -> bool:
    """A finite int or float (JSON bodies can carry NaN and Infinity; Python's json reads them)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and (isinstance(v, int) or math.isfinite(v))
