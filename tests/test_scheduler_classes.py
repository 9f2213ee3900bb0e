"""Service classes and prefill lanes in the scheduler (engine/lanes.py), on a bare BlockManager: no model."""
from __future__ import annotations

from tokenfab.engine.kv_cache import BlockManager
from tokenfab.engine.scheduler import Scheduler
from tokenfab.engine.sequence import Sequence
from tokenfab.sampling import SamplingParams

from tests.scheduler_steps import run_step

BLOCK = 4


def seq(rid: str, n: int, cls: str = "interactive", tokens: list[int] | None = None) -> Sequence:
    base = 1000 * (sum(map(ord, rid)) % 97)          # distinct prompts: no accidental prefix hits
    tokens = tokens or [base + k for k in range(n)]
    return Sequence(rid, 0, tokens, SamplingParams(), max_tokens=8, service_class=cls)


def sched(blocks: int = 64, seqs: int = 8, budget: int = 64, **kw) -> Scheduler:
    return Scheduler(BlockManager(blocks, BLOCK, enable_prefix_caching=True), seqs, budget, **kw)


def test_interactive_request_is_queued_ahead_of_waiting_batch_work():
    s = sched(seqs=1)
    s.add(seq("b1", 8, "batch"))
    s.add(seq("b2", 8, "batch"))
    s.add(seq("i1", 8))
    assert [q.request_id for q in s.waiting] == ["i1", "b1", "b2"]


def test_interactive_arrival_preempts_batch_when_sequence_slots_are_full():
    s = sched(seqs=2)
    s.add(seq("b1", 8, "batch"))
    s.add(seq("b2", 8, "batch"))
    assert set(run_step(s)) == {"b1", "b2"}
    s.add(seq("i1", 8))
    step = run_step(s)
    assert "i1" in step and step["i1"] == 8
    assert s.num_preemptions == 1
    assert [q.request_id for q in s.waiting] == ["b2"]          # the newest batch sequence went back


def test_interactive_arrival_preempts_batch_when_blocks_are_short_and_keeps_its_prefix_cached():
    s = sched(blocks=6, seqs=8)
    s.add(seq("b1", 16, "batch"))
    run_step(s)
    run_step(s)                                                  # its first decode: 5 blocks of 6 held
    s.add(seq("i1", 8))                                          # needs 2 blocks: only 1 is free
    step = run_step(s)
    assert "i1" in step and "b1" not in step
    (b1,) = s.waiting
    assert b1.request_id == "b1" and b1.num_preemptions == 1
    # Once the interactive request is gone, the batch sequence comes back through the prefix cache.
    (i1,) = s.running
    s.remove(i1)
    assert run_step(s) == {"b1": 18 - 16}                        # its 4 full blocks were still cached


def test_batch_is_never_preempted_for_another_batch_sequence_nor_starved_when_interactive_is_idle():
    s = sched(seqs=2, budget=64, batch_prefill_share=0.25)
    for i in range(4):
        s.add(seq(f"b{i}", 40, "batch"))
    done = set()
    for _ in range(40):
        for rid, n in run_step(s).items():
            assert n <= 16                                       # the batch share: 64 * 0.25
        for q in list(s.running):
            if q.num_output_tokens >= 1:                     # its prefill is done and it sampled
                done.add(q.request_id)
                s.remove(q)
        if not s.has_work():
            break
    assert done == {"b0", "b1", "b2", "b3"} and s.num_preemptions == 0


def test_batch_prefill_leaves_the_rest_of_the_step_to_an_interactive_prompt():
    s = sched(budget=64, batch_prefill_share=0.25)
    s.add(seq("b1", 60, "batch"))
    s.add(seq("i1", 40))
    step = run_step(s)
    assert step == {"i1": 40, "b1": 16}


def test_long_prompts_obey_their_prefill_cap_and_short_ones_pass_them():
    s = sched(blocks=128, budget=64, long_prompt_threshold=32, max_long_prefill_tokens=16)
    s.add(seq("long1", 100))
    s.add(seq("long2", 50))
    s.add(seq("short", 10))
    step = run_step(s)
    assert step["short"] == 10
    assert step.get("long1", 0) + step.get("long2", 0) <= 16
    total_long = 0
    for _ in range(20):
        step = run_step(s)
        long_tokens = sum(n for rid, n in step.items() if rid.startswith("long") and n > 1)
        assert long_tokens <= 16
        total_long += long_tokens
    assert total_long >= 100 + 50 - 16                            # they still finish their prefill
