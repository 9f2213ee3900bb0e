"""A request's way in: its prompt tokenized and checked against the limits, its sampling parameters checked
against the vocabulary, and its sequences built (one per `n`, each with its seed's generator, its incremental
detokenizer and its grammar matcher), or a ValueError that changes nothing.
"""
from __future__ import annotations

import time

import torch

from tokenfab.engine.client import tokenize_prompt
from tokenfab.engine.detokenizer import IncrementalDetokenizer
from tokenfab.engine.lanes import SERVICE_CLASSES
from tokenfab.engine.sequence import Sequence
from tokenfab.engine.structured import GrammarCompiler
from tokenfab.sampling import SamplingParams


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, pool_tokens: int,
                 structured: GrammarCompiler, device: str, step_tokens: int | None = None):
        """`pool_tokens`: the KV pool's size in tokens; `step_tokens`: the token budget of a step when chunked
        prefill is off (each is named when it is what limits max_model_len)."""
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        self.pool_tokens, self.step_tokens, self.structured, self.device = pool_tokens, step_tokens, structured, device

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return tokenize_prompt(self.tokenizer, self.vocab_size, prompt)

    def check_prompt_length(self, num_tokens: int) -> None:
        if num_tokens >= self.max_model_len:
            why = (f", limited by the token budget of {self.step_tokens} per step (chunked prefill is off)"
                   if self.max_model_len == self.step_tokens else
                   f", limited by the KV pool of {self.pool_tokens} tokens" if self.max_model_len == self.pool_tokens else "")
            raise ValueError(f"prompt has {num_tokens} tokens but max_model_len is {self.max_model_len}{why} "
                             f"(at least one token must be left to generate)")

    def sequences(self, request_id: str, prompt: str | list[int], params: SamplingParams | None, priority: int,
                  arrival_time: float | None, service_class: str) -> tuple[list[int], list[Sequence]]:
        """(prompt ids, the request's sequences); ValueError on bad input."""
        params = params or SamplingParams()
        if service_class not in SERVICE_CLASSES:
            raise ValueError(f"service_class must be one of {', '.join(SERVICE_CLASSES)}, got {service_class!r}")
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling params must be a SamplingParams")
        ids = self.tokenize(prompt)
        self.check_prompt_length(len(ids))
        bad = next((t for t in params.logit_bias or () if t >= self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"logit_bias names token id {bad}, not in [0, {self.vocab_size})")
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        grammar = self.structured.compile(params.structured_output) if params.structured_output else None
        arrival = time.monotonic() if arrival_time is None else arrival_time
        seqs = []
        for i in range(params.n):
            seq = Sequence(request_id, i, ids, params, max_tokens, priority=priority, arrival_time=arrival,
                           service_class=service_class)
            if params.seed is not None:
                seq.generator = torch.Generator(device=self.device).manual_seed(params.seed + i)
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params)
            if grammar is not None:
                seq.grammar = grammar.matcher()
            seqs.append(seq)
        return ids, seqs
