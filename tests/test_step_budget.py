"""The step-time budget (engine/step_budget.py) in the scheduler, with a fake step-cost model: no model runs."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from tokenfab.config import EngineConfig
from tokenfab.costmodel.measured import MeasuredStepCost
from tokenfab.costmodel.online import MIN_ROWS, OnlineStepModel
from tokenfab.costmodel.shape import StepShape
from tokenfab.engine.kv_cache import BlockManager
from tokenfab.engine.scheduler import Scheduler
from tokenfab.engine.sequence import Sequence
from tokenfab.engine.step_budget import StepBudget
from tokenfab.sampling import SamplingParams

from tests.scheduler_steps import run_step

BLOCK = 4
# 1 ms per token in a step, nothing else.
PER_TOKEN = MeasuredStepCost(knots=(0.0, 1000.0), values=(0.0, 1.0),
                             coef={"num_seqs": 0.0, "attn_pairs": 0.0, "kv_tokens": 0.0})


def seq(rid: str, n: int, cls: str = "interactive", max_tokens: int = 1000, at: float = 0.0) -> Sequence:
    base = 1000 * (sum(map(ord, rid)) % 97)          # distinct prompts: no accidental prefix hits
    return Sequence(rid, 0, [base + k for k in range(n)], SamplingParams(), max_tokens=max_tokens, service_class=cls,
                    arrival_time=at)


def sched(target_ms: float | None = None, slack: float = 0.2, min_tokens: int = 1, seqs: int = 16, budget: int = 256,
          **kw) -> tuple[Scheduler, SimpleNamespace]:
    """A scheduler under a step budget whose clock is `model.now` (seconds; arrivals are at 0 unless given)."""
    model = SimpleNamespace(cost=None, now=0.0)       # uncalibrated until a test sets it
    step_budget = StepBudget(model, None if target_ms is None else target_ms / 1e3, slack, min_tokens,
                             clock=lambda: model.now)
    return Scheduler(BlockManager(256, BLOCK), seqs, budget, step_budget=step_budget, **kw), model


def decoding(s: Scheduler, *specs: tuple[str, str]) -> None:
    """Bring sequences (id, class) to their decode phase while no model is calibrated (no budget)."""
    for rid, cls in specs:
        s.add(seq(rid, 8, cls))
    run_step(s)
    assert all(q.num_computed_tokens == 8 for q in s.running) and len(s.running) == len(specs)


def test_batch_rows_are_held_back_while_the_predicted_step_would_exceed_the_budget():
    s, model = sched(target_ms=5)
    decoding(s, ("i1", "interactive"), ("i2", "interactive"), ("i3", "interactive"),
             ("b1", "batch"), ("b2", "batch"), ("b3", "batch"), ("b4", "batch"))
    model.cost = PER_TOKEN
    step = run_step(s)                                # 3 interactive rows (3 ms) leave room for 2 batch rows
    assert {"i1", "i2", "i3"} <= set(step) and sum(rid.startswith("b") for rid in step) == 2
    step = run_step(s)                                # the held-back ones are still running, not preempted
    assert len(s.running) == 7 and s.num_preemptions == 0


def test_batch_rows_are_admitted_when_the_interactive_load_leaves_room():
    s, model = sched(target_ms=5)
    decoding(s, ("i1", "interactive"), ("i2", "interactive"), ("i3", "interactive"),
             ("b1", "batch"), ("b2", "batch"), ("b3", "batch"), ("b4", "batch"))
    model.cost = PER_TOKEN
    for q in [q for q in s.running if q.request_id in ("i2", "i3")]:
        s.remove(q)
    assert set(run_step(s)) == {"i1", "b1", "b2", "b3", "b4"}     # 5 rows: exactly the 5 ms
    (i1,) = [q for q in s.running if q.request_id == "i1"]
    s.remove(i1)
    s.add(seq("b5", 40, "batch"))
    model.now = 1000.0                                # and no interactive request for a long while:
    step = run_step(s)                                # no limit, the token budget rules
    assert step["b5"] == 40 and len(step) == 5


def test_without_a_target_batch_may_add_the_slack_of_one_decode_step_to_an_interactive_step():
    s, model = sched(target_ms=None, slack=2.0)
    decoding(s, ("i1", "interactive"), ("i2", "interactive"), ("i3", "interactive"), ("i4", "interactive"),
             ("b1", "batch"), ("b2", "batch"), ("b3", "batch"), ("b4", "batch"))
    model.cost = PER_TOKEN
    step = run_step(s)                                # 4 ms of interactive work + 2.0 x 1 ms
    assert sum(rid.startswith("b") for rid in step) == 2 and sum(rid.startswith("i") for rid in step) == 4


def test_long_prompt_prefill_chunks_shrink_to_fit_the_budget_and_still_finish():
    s, model = sched(target_ms=10, long_prompt_threshold=32, max_long_prefill_tokens=64)
    decoding(s, ("i1", "interactive"), ("i2", "interactive"))
    model.cost = PER_TOKEN
    s.add(seq("long", 100))
    step = run_step(s)
    assert step["long"] == 8                          # 2 decode rows + 8 prefill tokens = 10 ms
    (long,) = [q for q in s.running if q.request_id == "long"]
    for _ in range(12):
        assert run_step(s)["long"] <= 8
    assert long.num_computed_tokens >= 100            # chunk by chunk, it finishes its prefill


def test_batch_prefill_chunks_shrink_to_fit_and_short_interactive_prompts_go_first():
    s, model = sched(target_ms=20, budget=64)
    decoding(s, ("i1", "interactive"))
    model.cost = PER_TOKEN
    s.add(seq("b1", 60, "batch"))
    s.add(seq("i2", 12))
    step = run_step(s)                                # i1's decode and i2's 12-token prefill are firm: 13 ms,
    assert step == {"i1": 1, "i2": 12}                # and i2's TTFT depends on this step: no batch in it
    step = run_step(s)                                # two decodes: the batch chunk fills up to the 20 ms
    assert step == {"i1": 1, "i2": 1, "b1": 18}


def test_batch_makes_progress_over_the_budget_when_no_interactive_prompt_waits():
    s, model = sched(target_ms=1, min_tokens=1)      # the interactive decodes alone exceed the target
    decoding(s, ("i1", "interactive"), ("i2", "interactive"), ("b1", "batch"), ("b2", "batch"))
    model.cost = PER_TOKEN
    outputs = {"b1": 0, "b2": 0}
    for _ in range(10):
        step = run_step(s)
        assert {"i1", "i2"} <= set(step) and sum(n for rid, n in step.items() if rid.startswith("b")) == 1
        for rid in outputs:
            outputs[rid] += step.get(rid, 0)
    assert sum(outputs.values()) == 10                # one batch row a step: slow, never starved


def test_an_uncalibrated_model_sets_no_limit():
    s, _ = sched(target_ms=1)
    decoding(s, ("i1", "interactive"), ("b1", "batch"), ("b2", "batch"))
    assert set(run_step(s)) == {"i1", "b1", "b2"}


def test_interactive_arrival_preempts_a_running_batch_sequence_for_its_slot_under_the_budget():
    s, model = sched(target_ms=5, seqs=3)
    decoding(s, ("i1", "interactive"), ("b1", "batch"), ("b2", "batch"))
    model.cost = PER_TOKEN
    s.add(seq("i2", 4))
    step = run_step(s)
    assert step["i2"] == 4 and "i1" in step and s.num_preemptions == 1
    assert [q.request_id for q in s.waiting] == ["b2"]


def test_fit_is_the_most_tokens_within_the_limit():
    b = StepBudget(SimpleNamespace(cost=PER_TOKEN), None, slack=0.2)
    shape = StepShape()
    shape.add(10, 1, 3)                               # 3 decode rows: 3 ms
    assert b.fit(shape, 0, 100, 0.010) == 7
    assert b.fit(shape, 0, 5, 0.010) == 5
    assert b.fit(shape, 0, 100, 0.003) == 0
    assert b.limit(shape) == pytest.approx(0.003 + 0.2 * 0.001)   # the slack of one decode step (1 ms)
    assert b.limit(StepShape()) is None               # no firm work: no limit


def test_the_online_model_calibrates_after_enough_steps():
    m = OnlineStepModel()
    for i in range(MIN_ROWS):
        m.observe([(100, 1)] * (1 + i % 8), 0.010 + 0.002 * (i % 8))
    assert m.cost is not None
    one, eight = StepShape(), StepShape()
    one.add(100, 1)
    eight.add(100, 1, 8)
    assert m.cost.step_time(eight) > m.cost.step_time(one)


def test_the_refit_runs_on_one_blas_thread_with_one_controller_built_once(monkeypatch):
    threadpoolctl = pytest.importorskip("threadpoolctl")
    from tokenfab.costmodel import online as step_cost
    monkeypatch.setattr(step_cost, "_controller", None)
    seen = set()
    for _ in range(3):
        with step_cost._one_blas_thread():
            pools = threadpoolctl.threadpool_info()
        seen.add(id(step_cost._controller))
        assert pools and all(p["num_threads"] == 1 for p in pools)
    assert len(seen) == 1 and step_cost._controller is not None   # the libraries scanned once, not per refit


def test_engine_config_rejects_a_bad_step_time_budget():
    for bad in ({"step_time_budget_ms": 0}, {"step_time_slack": -0.1}, {"step_budget_min_tokens": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineConfig(**bad).validate()


def test_serve_takes_the_tpot_target_as_the_step_budget_unless_one_is_given():
    from tokenfab.server.cli import apply_slo_to_step_budget
    from tokenfab.server.config import ServerConfig
    engine = EngineConfig()
    apply_slo_to_step_budget(engine, ServerConfig(slo_tpot_ms=80))
    assert engine.step_time_budget_ms == 80
    engine = EngineConfig(step_time_budget_ms=30)
    apply_slo_to_step_budget(engine, ServerConfig(slo_tpot_ms=80))
    assert engine.step_time_budget_ms == 30
    engine = EngineConfig()
    apply_slo_to_step_budget(engine, ServerConfig())
    assert engine.step_time_budget_ms is None


# Issue 15's arrival bound: a step with no interactive work is bounded too, while interactive requests arrive.
WITH_SEQ_COST = MeasuredStepCost(knots=(0.0, 1000.0), values=(0.010, 1.010),     # 10 ms a step, 1 ms a token,
                                 coef={"num_seqs": 0.005, "attn_pairs": 0.0, "kv_tokens": 0.0})  # 5 ms a row


def test_a_step_without_interactive_work_is_bounded_while_interactive_requests_arrive():
    s, model = sched(slack=0.5)
    decoding(s, ("i1", "interactive"), ("i2", "interactive"), ("i3", "interactive"), ("i4", "interactive"))
    model.cost = PER_TOKEN
    run_step(s)                                       # the interactive steps take 4 ms
    for q in list(s.running):
        s.remove(q)
    s.add(seq("b1", 40, "batch"))
    model.now = 1.0
    assert run_step(s) == {"b1": 6}                   # an arrival now waits at most 1.5 x 4 ms
    model.now = 1000.0                                # no interactive request for a long while: no limit
    assert run_step(s) == {"b1": 34}


def test_pure_batch_work_runs_at_full_speed_when_no_interactive_request_ever_came():
    s, model = sched(slack=0.0)
    decoding(s, ("b1", "batch"), ("b2", "batch"))
    model.cost = PER_TOKEN
    s.add(seq("b3", 100, "batch"))
    assert run_step(s) == {"b1": 1, "b2": 1, "b3": 100}    # no limit: the token budget rules


def test_no_batch_work_rides_in_a_step_where_an_interactive_prompt_prefills():
    s, model = sched(slack=2.0)                       # a generous slack: 2 decode rows could take 6 ms
    decoding(s, ("i1", "interactive"), ("b1", "batch"), ("b2", "batch"))
    model.cost = PER_TOKEN
    s.add(seq("i2", 12))
    assert run_step(s) == {"i1": 1, "i2": 12}         # its time to first token is this step's time
    assert run_step(s) == {"i1": 1, "i2": 1, "b1": 1, "b2": 1}


def test_a_batch_row_dearer_than_one_steps_slack_still_runs_and_the_mean_step_stays_within_it():
    s, model = sched(slack=0.2)
    decoding(s, ("i1", "interactive"), ("b1", "batch"))
    model.cost = WITH_SEQ_COST                        # 1 row: 16 ms, 2 rows: 22 ms > 1.2 x 16 ms
    times, batch_rows = [], 0
    for _ in range(20):
        step = run_step(s)
        assert step["i1"] == 1
        batch_rows += step.get("b1", 0)
        times.append(0.010 + 0.006 * len(step))
    assert batch_rows >= 8                            # a row every other step or so: never starved
    assert sum(times) / len(times) <= 1.2 * 0.016 + 1e-9   # on average within the slack: what a TPOT sees


def test_interactive_traffic_is_about_for_ten_mean_gaps_after_the_last_arrival():
    now = [0.0]
    b = StepBudget(SimpleNamespace(cost=PER_TOKEN), None, clock=lambda: now[0])
    assert not b.interactive_about()                  # no arrival yet
    for t in (0.0, 2.0, 4.0, 4.0):                    # a request's n sequences share one arrival time
        b.note_arrival(t)
    assert b.mean_gap_s == pytest.approx(2.0)
    now[0] = 4.0 + 19.9
    assert b.interactive_about()
    now[0] = 4.0 + 20.1
    assert not b.interactive_about()


def test_the_idle_limit_is_the_slack_over_the_recent_interactive_steps_and_never_below_one_decode():
    now = [0.0]
    b = StepBudget(SimpleNamespace(cost=PER_TOKEN), None, slack=0.5, clock=lambda: now[0])
    b.note_arrival(0.0)
    assert b.limit(StepShape()) == pytest.approx(1.5 * 0.001)      # no interactive step seen: one decode row
    firm, huge = StepShape(), StepShape()
    firm.add(10, 1, 8)
    huge.add(0, 100)
    for _ in range(9):
        b.limit(firm)                                 # 8 ms interactive steps ...
    b.limit(huge)                                     # ... and one rare 100 ms prefill: their 90th percentile
    assert b.limit(StepShape()) == pytest.approx(1.5 * 0.008)
    b.target_s = 0.005
    assert b.limit(StepShape()) == pytest.approx(0.005)            # an absolute target is never exceeded
