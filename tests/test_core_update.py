"""The scheduler's post-step bookkeeping, `update_from_output`, on a bare BlockManager: no model runs."""
from __future__ import annotations

from tokenfab.engine.kv_cache import BlockManager
from tokenfab.engine.sampler import SampledToken
from tokenfab.engine.scheduler import Scheduler
from tokenfab.engine.sequence import Sequence, SequenceStatus
from tokenfab.engine.update import ModelOutput
from tokenfab.sampling import SamplingParams

BLOCK = 4
EOS = 2


def sched(blocks: int = 16, seqs: int = 8, budget: int = 64, **kw) -> Scheduler:
    return Scheduler(BlockManager(blocks, BLOCK), seqs, budget, eos_token_ids=[EOS], **kw)


def seq(rid: str, n: int, max_tokens: int = 8, **params) -> Sequence:
    base = 1000 * (sum(map(ord, rid)) % 97)          # distinct prompts: no accidental prefix hits
    return Sequence(rid, 0, [base + k for k in range(n)], SamplingParams(**params), max_tokens=max_tokens)


def step(s: Scheduler, tokens: dict[str, list[int]]):
    """Schedule a step, and hand back `tokens` for the sequences named (the rest sample nothing)."""
    batch = s.schedule()
    out = ModelOutput([(q, [SampledToken(t, None, None) for t in tokens[q.request_id]])
                       for q in batch.seqs if q.request_id in tokens])
    return batch, s.update_from_output(batch, out)


def test_a_finished_prefill_appends_its_token_and_caches_its_full_blocks():
    s = sched()
    a = seq("a", 9)
    s.add(a)
    batch, up = step(s, {"a": [5]})
    assert batch.num_new_tokens == [9]
    assert a.num_computed_tokens == 9 and a.token_ids[-1] == 5 and a.num_output_tokens == 1
    assert len(a.block_hashes) == 2 and len(s.bm.hash_to_block) == 2    # 9 tokens: two full blocks of 4
    assert up.new_tokens == [(a, [5])] and list(up.request_ids) == ["a"] and not up.finished
    assert s.num_generation_tokens == 1 and a.first_token_time is not None


def test_a_partial_prefill_chunk_advances_and_caches_but_samples_nothing():
    s = sched(budget=6)
    a = seq("a", 10)
    s.add(a)
    batch, up = step(s, {})
    assert batch.num_new_tokens == [6]
    assert a.num_computed_tokens == 6 and a.num_output_tokens == 0
    assert len(a.block_hashes) == 1 and not up.new_tokens and not up.request_ids
    batch, up = step(s, {"a": [5]})
    assert batch.num_new_tokens == [4] and a.num_computed_tokens == 10 and a.token_ids[-1] == 5


def test_max_tokens_finishes_with_length_and_frees_every_block():
    s = sched()
    a = seq("a", 5, max_tokens=2)
    s.add(a)
    step(s, {"a": [5]})
    _, up = step(s, {"a": [6]})
    assert up.finished == [a] and a.status is SequenceStatus.FINISHED_LENGTH and a.finish_reason == "length"
    assert a.output_token_ids == [5, 6] and not s.has_work() and s.bm.num_used_blocks() == 0


def test_eos_finishes_stopped_but_not_before_min_tokens_nor_with_ignore_eos():
    s = sched()
    a, b, c = seq("a", 5), seq("b", 5, min_tokens=2), seq("c", 5, ignore_eos=True)
    for q in (a, b, c):
        s.add(q)
    _, up = step(s, {"a": [EOS], "b": [EOS], "c": [EOS]})
    assert up.finished == [a] and a.status is SequenceStatus.FINISHED_STOPPED and a.stop_reason is None
    assert b.status is c.status is SequenceStatus.RUNNING
    _, up = step(s, {"b": [EOS], "c": [EOS]})
    assert up.finished == [b] and c.num_output_tokens == 2


def test_a_stop_token_id_is_the_stop_reason():
    s = sched()
    a = seq("a", 5, stop_token_ids=[9])
    s.add(a)
    _, up = step(s, {"a": [9]})
    assert up.finished == [a] and a.stop_reason == 9 and a.finish_reason == "stop"


def test_max_model_len_finishes_with_length():
    s = sched(max_model_len=7)
    a = seq("a", 5, max_tokens=100)
    s.add(a)
    step(s, {"a": [5]})
    _, up = step(s, {"a": [6]})
    assert up.finished == [a] and a.num_tokens == 7 and a.finish_reason == "length"


def test_a_prompt_only_sequence_finishes_once_its_prompt_is_scored():
    s = sched()
    a = seq("a", 6, max_tokens=0)
    s.add(a)
    _, up = step(s, {})
    assert up.finished == [a] and list(up.request_ids) == ["a"] and a.num_output_tokens == 0
    assert s.bm.num_used_blocks() == 0


def test_accepted_drafts_advance_the_kv_and_a_rejected_drafts_block_is_freed():
    s = sched()
    a, b = seq("a", 5), seq("b", 5)
    s.add(a)
    s.add(b)
    step(s, {"a": [5], "b": [5]})                      # 6 tokens each, 5 computed, 2 blocks
    a.spec_tokens, b.spec_tokens = [10, 11, 12], [10, 11, 12]
    batch, up = step(s, {"a": [10, 11, 12, 13], "b": [99]})
    assert batch.num_new_tokens == [4, 4]              # each ran its last token and 3 drafts: 3 blocks
    assert a.output_token_ids == [5, 10, 11, 12, 13] and a.num_computed_tokens == 9 and len(a.block_table) == 3
    assert b.output_token_ids == [5, 99] and b.num_computed_tokens == 6 and len(b.block_table) == 2
    assert len(a.block_hashes) == 2 and a.spec_tokens == b.spec_tokens == []
    assert up.new_tokens == [(a, [10, 11, 12, 13]), (b, [99])] and s.num_generation_tokens == 7


def test_a_draft_that_stops_the_sequence_ends_the_append_there():
    s = sched()
    a = seq("a", 5)
    s.add(a)
    step(s, {"a": [5]})
    a.spec_tokens = [EOS, 11]
    _, up = step(s, {"a": [EOS, 11, 12]})
    assert a.output_token_ids == [5, EOS] and up.finished == [a] and s.bm.num_used_blocks() == 0


def test_a_failing_update_ends_its_sequence_with_an_error_and_not_the_batch():
    class Broken:
        def step(self, ids):
            raise UnicodeDecodeError("utf-8", b"", 0, 1, "bad byte")

    s = sched()
    a, b = seq("a", 5), seq("b", 5)
    a.detokenizer = Broken()
    s.add(a)
    s.add(b)
    _, up = step(s, {"a": [5], "b": [5]})
    assert a.status is SequenceStatus.FINISHED_ERROR and "UnicodeDecodeError" in up.errors["a"]
    assert up.finished == [a] and b.status is SequenceStatus.RUNNING and list(up.request_ids) == ["a", "b"]


def test_a_preempted_sequence_keeps_its_tokens_and_the_update_skips_it_until_readmitted():
    # 4 blocks of 4 tokens: two 7-token prompts fill the pool once each has a token to decode past 8.
    s = sched(blocks=4)
    a, b = seq("a", 7, max_tokens=3), seq("b", 7)
    s.add(a)
    s.add(b)
    step(s, {"a": [5], "b": [5]})
    step(s, {"a": [6], "b": [6]})                      # 9 tokens each, 8 computed: 2 blocks each
    batch, up = step(s, {"a": [7]})                    # a needs a third block: b, the newest, is preempted
    assert batch.preempted == [b] and batch.seqs == [a] and up.finished == [a]
    assert b.status is SequenceStatus.WAITING and b.output_token_ids == [5, 6] and b.num_computed_tokens == 0
    batch, up = step(s, {"b": [8]})                    # readmitted: recomputes what it lost, then samples
    assert batch.seqs == [b] and b.output_token_ids == [5, 6, 8] and b.num_computed_tokens == 9
