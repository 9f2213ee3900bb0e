"""What the engine returns per request, shaped like vLLM's RequestOutput / CompletionOutput."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    decoded_token: str | None = None
    rank: int | None = None                 # 1 = the most likely token (prompt logprobs set it)


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str                               # cumulative text emitted so far
    token_ids: list[int]                    # cumulative generated token ids
    finish_reason: str | None = None        # stop | length | abort | error
    stop_reason: int | str | None = None    # the stop string or stop token id that ended it
    # Per generated token: {token_id: Logprob} holding the chosen token and the top-n.
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs: None for the first prompt token, then per prompt token
    # {token_id: Logprob} holding that token and the top-n (as vLLM); filled in as the prefill runs.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: RequestMetrics | None = None
    error: str | None = None                # set when the request failed inside the engine
    extra: dict = field(default_factory=dict)
