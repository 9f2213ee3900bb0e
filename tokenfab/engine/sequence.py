"""A request's state as the engine sees it: tokens, progress, KV blocks, status."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from tokenfab.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"   # queued; its prefix blocks are on their way (kv_connector.py)
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")


_seq_counter = itertools.count()


@dataclass(eq=False)
class Sequence:
    request_id: str
    index: int                          # which of the request's n samples this is
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int                     # params.max_tokens, clamped to what max_model_len leaves
    priority: int = 0                   # lower runs first under the priority policy (as vLLM)
    service_class: str = "interactive"  # interactive | batch (engine/lanes.py)
    arrival_time: float = field(default_factory=time.monotonic)
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    token_ids: list[int] = field(default_factory=list)   # prompt + output
    num_computed_tokens: int = 0        # tokens whose K/V are in the cache
    num_cached_tokens: int = 0          # of the prompt, served by the prefix cache at admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hash chain of the full blocks registered so far
    sliding_start: int = 0              # first block_table entry whose sliding-layer block it holds (sliding_kv.py)
    status: SequenceStatus = SequenceStatus.WAITING
    stop_reason: int | str | None = None
    generator: torch.Generator | None = None
    detokenizer: object | None = None
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)  # entries for prompt tokens 1.. (prompt_logprobs.py)
    first_token_time: float | None = None
    scheduled_time: float | None = None  # first time it was scheduled (queue time ends)
    num_preemptions: int = 0
    grammar: object | None = None        # structured output: this sample's llguidance matcher (engine/structured.py)
    spec_tokens: list[int] = field(default_factory=list)  # this step's draft tokens (engine/spec), not yet output
    spec_state: object | None = None    # engine/spec/policy.SeqSpecState once it has speculated

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Some prompt token still lacks the logprob this sequence must report (only sample 0 reports)."""
        return (self.params.prompt_logprobs is not None and self.index == 0
                and len(self.prompt_logprobs) < self.num_prompt_tokens - 1)

    @property
    def finish_reason(self) -> str | None:
        """stop | length | abort | error, or None while unfinished."""
        return self.status.value if self.status.finished else None
