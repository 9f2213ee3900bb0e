"""What an executed step hands back, and what its tokens do to a sequence.

The engine core loop is `schedule -> execute -> update_from_output` (engine/scheduler.py). Execution
returns a `ModelOutput`: the tokens each sampling sequence got, in order (one token, or a speculating
sequence's accepted drafts and then the target's own token). `Scheduler.update_from_output` applies it,
the one place where a step's bookkeeping is written; this module holds its per-token part:
`append_token` appends one token with its logprobs, feeds the grammar and the detokenizer, and says
whether the sequence finishes (EOS, stop_token_ids, stop strings, a completed grammar, max_tokens,
max_model_len). `finish` marks a finished sequence; the scheduler then frees its blocks.
A sequence without a detokenizer or grammar (the scheduler's unit tests, the simulators) skips them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenfab.engine.sampler import SampledToken
from tokenfab.engine.sequence import Sequence, SequenceStatus
from tokenfab.outputs import Logprob


@dataclass(slots=True)
class ModelOutput:
    """One executed step's sampled tokens: (sequence, its tokens in order) per sampling sequence, in
    logits row order. A partial prefill chunk samples nothing and is not listed."""
    sampled: list[tuple[Sequence, list[SampledToken]]] = field(default_factory=list)

    @classmethod
    def stand_in(cls, batch, token_id: int) -> ModelOutput:
        """What a model that always samples `token_id` hands back for `batch` (a ScheduledBatch): one token
        for each sequence whose chunk reaches its end. Simulators and scheduler tests run steps with it."""
        return cls([(seq, [SampledToken(token_id, None, None)]) for seq, n in zip(batch.seqs, batch.num_new_tokens)
                    if seq.num_computed_tokens + n == seq.num_tokens and seq.max_tokens > 0])


@dataclass(slots=True)
class StepUpdate:
    """What `update_from_output` did: the token ids each sequence got, the sequences that finished
    (stopped, hit a limit, or failed), why the failed ones failed, and the requests touched, in order."""
    new_tokens: list[tuple[Sequence, list[int]]] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)         # request id -> "ExceptionType: message"
    request_ids: dict[str, None] = field(default_factory=dict)   # requests that progressed or finished


Finish = tuple[SequenceStatus, "int | str | None"]


def append_token(seq: Sequence, tok: SampledToken, now: float, eos_token_ids, max_model_len: int | None
                 ) -> Finish | None:
    """Append `tok` to `seq`; returns (status, stop reason) when the sequence finishes with it."""
    seq.token_ids.append(tok.token_id)
    if seq.first_token_time is None:
        seq.first_token_time = now
    if tok.logprob is not None:
        entry = {tok.token_id: Logprob(tok.logprob)}
        for tid, lp in (tok.top_logprobs or {}).items():
            entry.setdefault(tid, Logprob(lp))
        seq.logprobs.append(entry)
    p, tid = seq.params, tok.token_id
    n_out = seq.num_output_tokens
    if n_out >= p.min_tokens and ((not p.ignore_eos and tid in eos_token_ids) or tid in p.stop_token_ids):
        # The stopping token's own text stays out of the output, as in vLLM.
        return SequenceStatus.FINISHED_STOPPED, tid if tid in p.stop_token_ids else None
    if seq.grammar is not None and not seq.grammar.consume_token(tid):
        raise RuntimeError(f"token {tid} broke the structured-output grammar: {seq.grammar.get_error()}")
    stop_str = seq.detokenizer.step([tid])[1] if seq.detokenizer is not None else None
    if stop_str is not None:
        return SequenceStatus.FINISHED_STOPPED, stop_str
    if seq.grammar is not None and seq.grammar.is_stopped():
        # The grammar is complete and allows only EOS: end now rather than spend a step sampling it.
        return SequenceStatus.FINISHED_STOPPED, None
    if n_out >= seq.max_tokens or (max_model_len is not None and seq.num_tokens >= max_model_len):
        return SequenceStatus.FINISHED_LENGTH, None
    return None


def finish(seq: Sequence, status: SequenceStatus, reason) -> None:
    """Mark `seq` finished. Its detokenizer flushes held-back text unless a stop string ended it."""
    if seq.detokenizer is not None and (status is not SequenceStatus.FINISHED_STOPPED or not isinstance(reason, str)):
        seq.detokenizer.finish()
    seq.status = status
    seq.stop_reason = reason
