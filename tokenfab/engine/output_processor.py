"""A request's way out: the requests in flight (their sequences, prompt text and errors), each step's
`RequestOutput` of a request that progressed (text, tokens, logprobs, prompt logprobs, timings), and the
request's removal once every sequence of it has finished.
"""
from __future__ import annotations

import time

import torch

from tokenfab.engine import prompt_logprobs
from tokenfab.engine.sequence import Sequence
from tokenfab.outputs import CompletionOutput, RequestMetrics, RequestOutput


class OutputProcessor:
    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.requests: dict[str, list[Sequence]] = {}
        self.prompts: dict[str, str | None] = {}
        self.errors: dict[str, str] = {}      # request id -> why it failed, until its output is returned

    def add(self, request_id: str, prompt: str | list[int], seqs: list[Sequence]) -> None:
        self.requests[request_id] = seqs
        self.prompts[request_id] = prompt if isinstance(prompt, str) else None

    def pop(self, request_id: str) -> list[Sequence] | None:
        """Forget a request (an abort): its sequences, or None when it is unknown or finished."""
        self.prompts.pop(request_id, None)
        self.errors.pop(request_id, None)
        return self.requests.pop(request_id, None)

    def record_prompt_logprobs(self, logits: torch.Tensor, runs: list[tuple[Sequence, int, int]]) -> None:
        """The prompt logprobs of each (sequence, first, last position) run, from its rows of `logits`."""
        row = 0
        for seq, lo, hi in runs:
            assert lo == len(seq.prompt_logprobs), (lo, len(seq.prompt_logprobs))
            seq.prompt_logprobs.extend(prompt_logprobs.entries(
                logits[row:row + hi - lo], seq.prompt_token_ids[lo + 1:hi + 1], seq.params.prompt_logprobs,
                self.vocab_size))
            row += hi - lo

    def output(self, request_id: str) -> RequestOutput:
        """The request's output so far; a finished request is removed, with its error if it failed."""
        seqs = self.requests[request_id]
        finished = all(s.status.finished for s in seqs)
        outs = []
        for s in seqs:
            lps = s.logprobs if s.params.logprobs is not None else None
            cum = sum(d[t].logprob for d, t in zip(s.logprobs, s.output_token_ids)) if lps else None
            outs.append(CompletionOutput(s.index, s.detokenizer.text, s.output_token_ids, s.finish_reason,
                                         s.stop_reason, lps, cum))
        s0 = seqs[0]
        first_tok = min((s.first_token_time for s in seqs if s.first_token_time), default=None)
        out = RequestOutput(request_id, self.prompts.get(request_id), s0.prompt_token_ids, outs, finished,
                            num_cached_tokens=s0.num_cached_tokens,
                            prompt_logprobs=[None, *s0.prompt_logprobs] if s0.params.prompt_logprobs is not None else None,
                            metrics=RequestMetrics(s0.arrival_time, s0.scheduled_time, first_tok,
                                                   time.monotonic() if finished else None))
        if finished:
            del self.requests[request_id]
            self.prompts.pop(request_id, None)
            out.error = self.errors.pop(request_id, None)
        return out
