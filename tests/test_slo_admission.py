"""Admission by predicted TTFT (server/slo.py): a tiny step-cost model and a queue decide 429 or admit."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import httpx
import pytest

from tokenfab.costmodel.measured import MeasuredStepCost
from tokenfab.engine.async_engine import cached_prompt_tokens, queue_snapshot
from tokenfab.engine.kv_cache import BlockManager
from tokenfab.engine.lanes import service_class_of
from tokenfab.engine.sequence import Sequence
from tokenfab.sampling import SamplingParams
from tokenfab.server.app import build_app
from tokenfab.server.config import ServerConfig
from tokenfab.server.errors import APIError
from tokenfab.server.launch import ServerThread
from tokenfab.server.slo import LoadSnapshot, QueueSnapshot, SloAdmission, predict_ttft

pytestmark = pytest.mark.timeout(300)

# 1 ms per token in a step, nothing else: a step of 512 tokens costs 0.512 s.
TINY = MeasuredStepCost(knots=(0.0, 1000.0), values=(0.0, 1.0),
                        coef={"num_seqs": 0.0, "attn_pairs": 0.0, "kv_tokens": 0.0})
QUEUE = QueueSnapshot(time=0.0, interactive_prefill=3000)          # 3000 prompt tokens ahead


def admission(ttft_ms: float, snapshot: QueueSnapshot = QUEUE) -> SloAdmission:
    return SloAdmission(lambda: LoadSnapshot(snapshot, TINY), 512, ttft_ms / 1e3, None)


def test_predicted_ttft_is_the_steps_that_clear_the_queue_ahead_and_the_prompt():
    assert predict_ttft(TINY, QUEUE, 100, 512) == pytest.approx(3.1)
    # Running decodes and a batch chunk ride along in every step, and take budget from the prefill.
    busy = QueueSnapshot(interactive_prefill=0, decodes=12, mean_context=100, batch_chunk=100)
    assert predict_ttft(TINY, busy, 400, 512) == pytest.approx(0.512)


def test_predicted_ttft_over_the_target_is_429_with_retry_after():
    with pytest.raises(APIError) as e:
        admission(1000).admit(100, "interactive")
    err = e.value
    assert err.status == 429 and err.code == "slo_unattainable"
    assert int(err.headers["Retry-After"]) == 3                     # 3.1 s predicted - 1 s target, rounded up
    assert "3100 ms" in err.message


def test_predicted_ttft_under_the_target_is_admitted_and_counts_toward_the_next_prediction():
    slo = admission(3500)
    slo.admit(100, "interactive")                                   # 3.1 s < 3.5 s
    slo.admit(300, "interactive")                                   # 3000 + 100 + 300: 3.4 s, still under
    with pytest.raises(APIError):
        slo.admit(200, "interactive")                               # 3000 + 400 admitted + 200: 3.6 s
    assert slo.shed == 1


def test_batch_requests_are_never_shed():
    slo = admission(1)
    for _ in range(5):
        slo.admit(1000, "batch")
    assert slo.shed == 0


def test_uncalibrated_server_admits_everything():
    SloAdmission(lambda: LoadSnapshot(QUEUE, None), 512, 0.001, 0.001).admit(10_000, "interactive")


@pytest.fixture(scope="module")
def server(bundled_llm):
    engine = bundled_llm.engine
    app = build_app(engine, ServerConfig(access_log=False, ui=False, slo_ttft_ms=1000))
    with ServerThread(app) as srv:
        yield srv, app.state.tokenfab.slo
    assert engine.block_manager.num_used_blocks() == 0


def overloaded() -> LoadSnapshot:
    """3000 interactive prompt tokens queued, newer than any admission: an interactive request is shed."""
    return LoadSnapshot(QueueSnapshot(time=1e18, interactive_prefill=3000), TINY)


def test_server_sheds_interactive_with_429_and_runs_flex(server):
    srv, slo = server
    slo.load = overloaded
    body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0}
    with httpx.Client(base_url=srv.url, timeout=120) as http:
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "slo_unattainable" and r.json()["error"]["type"] == "rate_limit_error"
        r = http.post("/v1/completions", json={**body, "service_tier": "flex"})
        assert r.status_code == 200
        bad = http.post("/v1/completions", json={**body, "service_tier": "turbo"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "service_tier"
        metrics = http.get("/metrics").text
    assert 'tokenfab:slo_requests_finished_total{service_class="batch"} 1.0' in metrics
    assert 'tokenfab:slo_requests_shed_total 1.0' in metrics
    assert 'tokenfab:slo_ttft_p99_seconds{kind="predicted",service_class="interactive"}' in metrics


def test_a_request_waiting_for_a_sequence_slot_waits_for_the_earliest_finishes():
    # 4 interactive sequences decode with 10, 20, 30, 40 tokens left; max_num_seqs 4: the next one waits
    # 10 decode steps (4 tokens each: 4 ms), then its 100-token prefill rides with the 4 decodes (104 ms).
    full = QueueSnapshot(decodes=4, mean_context=100, interactive_seqs=4, max_num_seqs=4,
                         slot_free_steps=(10, 20, 30, 40))
    assert full.slot_wait_steps() == 10
    assert predict_ttft(TINY, full, 100, 512) == pytest.approx(10 * 0.004 + 0.104)
    # One more queued ahead of it: the second slot to free is its own.
    ahead = replace(full, interactive_seqs=5)
    assert ahead.slot_wait_steps() == 20
    assert predict_ttft(TINY, ahead, 100, 512) == pytest.approx(20 * 0.004 + 0.104)
    # A free slot, or no cap: no wait.
    for snap in (replace(full, max_num_seqs=5), replace(full, max_num_seqs=None)):
        assert snap.slot_wait_steps() == 0 and predict_ttft(TINY, snap, 100, 512) == pytest.approx(0.104)


def test_the_queue_ahead_runs_while_a_request_waits_for_its_slot():
    # 600 prefill tokens ahead take 2 steps (508 + 92 beside 4 decodes); the slot frees after 3 steps.
    snap = QueueSnapshot(interactive_prefill=600, decodes=4, mean_context=100, interactive_seqs=4,
                         max_num_seqs=4, slot_free_steps=(3,))
    assert predict_ttft(TINY, snap, 100, 512) == pytest.approx(0.512 + 0.096 + 0.004 + 0.104)


def test_snapshot_counts_interactive_slots_and_their_steps_left_but_not_batch_ones():
    def s(cls, computed, tokens, out, max_tokens):
        return SimpleNamespace(service_class=cls, num_computed_tokens=computed, num_tokens=tokens,
                               num_output_tokens=out, max_tokens=max_tokens)
    running = [s("interactive", 50, 51, 5, 30), s("interactive", 70, 71, 2, 10), s("batch", 40, 41, 1, 100)]
    waiting = [s("interactive", 0, 20, 0, 16), s("batch", 0, 300, 0, 16)]
    sched = SimpleNamespace(running=running, waiting=waiting, batch_prefill_share=1.0, max_num_seqs=3)
    snap = queue_snapshot(sched, 512)
    assert (snap.interactive_seqs, snap.max_num_seqs, snap.slot_free_steps) == (3, 3, (8, 25))
    assert (snap.decodes, snap.batch_decodes, snap.interactive_prefill, snap.batch_chunk) == (3, 1, 20, 300)
    assert snap.slot_wait_steps() == 8


def test_prefix_cache_hits_are_not_counted_as_prefill():
    assert predict_ttft(TINY, QUEUE, 100, 512, cached_tokens=64) == pytest.approx(3.036)
    slo = admission(3050)
    with pytest.raises(APIError):
        slo.admit(100, "interactive")                               # 3.1 s > 3.05 s
    slo.admit(100, "interactive", cached_tokens=64)                 # 3.036 s: admitted


def test_cached_prompt_tokens_are_the_leading_full_blocks_the_block_manager_holds():
    bm = BlockManager(num_blocks=16, block_size=4)
    first = Sequence("a", 0, list(range(10)), SamplingParams(), max_tokens=4)
    assert bm.allocate(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    bm.cache_full_blocks(first)                                     # blocks [0..3] and [4..7] are full
    bm.free_seq(first)
    assert cached_prompt_tokens(bm, [list(range(12))]) == 8
    assert cached_prompt_tokens(bm, [list(range(8))]) == 4          # at least one token is computed
    assert cached_prompt_tokens(bm, [[0, 1, 2, 3, 9, 9, 9, 9, 9]], n=2) == 8
    assert cached_prompt_tokens(bm, [[7] * 12]) == 0
    assert bm.num_used_blocks() == 0


def test_priority_picks_the_class_when_service_tier_leaves_it_to_the_server():
    assert service_class_of(None, 0) == service_class_of("auto", -5) == "interactive"
    assert service_class_of(None, 1) == service_class_of("auto", 100) == "batch"     # vLLM: larger is later
    assert service_class_of("default", 100) == "interactive" and service_class_of("flex", -5) == "batch"
    assert service_class_of(None, 7, batch_priority=10) == "interactive"
    assert service_class_of(None, 10, batch_priority=10) == "batch"
    assert service_class_of(None, 10**6, batch_priority=None) == "interactive"


def test_server_routes_priority_to_the_batch_class_and_never_sheds_it(server):
    srv, slo = server
    slo.load = overloaded
    body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0}
    before = dict(slo.finished)
    with httpx.Client(base_url=srv.url, timeout=120) as http:
        assert http.post("/v1/completions", json={**body, "priority": 1}).status_code == 200      # batch: waits
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "priority": 5}
        assert http.post("/v1/chat/completions", json=chat).status_code == 200
        r = http.post("/v1/completions", json={**body, "priority": 5, "service_tier": "default"})
        assert r.status_code == 429                                  # an explicit tier wins: interactive, shed
        r = http.post("/v1/completions", json={**body, "priority": -1})
        err = r.json()["error"]                                      # FCFS: no order within a class to give it
        assert r.status_code == 400 and (err["param"], err["code"]) == ("priority", "unsupported")
    assert slo.finished["batch"] == before["batch"] + 2
    assert slo.finished["interactive"] == before["interactive"]


def test_with_a_step_budget_batch_work_counts_only_as_far_as_the_budget_lets_it_into_a_step():
    from tokenfab.engine.step_budget import StepBudget
    from tokenfab.server.slo import predict_tpot
    relative = StepBudget(SimpleNamespace(cost=TINY), None, slack=0.2)
    absolute = StepBudget(SimpleNamespace(cost=TINY), 0.050)
    # 2 interactive and 10 batch sequences decode, and a 100-token batch chunk waits.
    snap = QueueSnapshot(decodes=12, batch_decodes=10, mean_context=100, batch_chunk=100)
    assert predict_tpot(TINY, snap) == pytest.approx(0.113)          # no budget: all of it in every step
    assert predict_tpot(TINY, snap, relative) == pytest.approx(0.003 + 0.2 * 0.001)  # + the slack of one decode
    assert predict_tpot(TINY, snap, absolute) == pytest.approx(0.050)
    # A waiting prompt makes every step before its first token TTFT-critical: no batch work in them.
    assert predict_ttft(TINY, snap, 400, 512) == pytest.approx(0.512)
    assert predict_ttft(TINY, snap, 400, 512, step_budget=relative) == pytest.approx(0.402)


def test_a_tpot_target_does_not_shed_for_batch_work_the_step_budget_holds_back():
    from tokenfab.engine.step_budget import StepBudget
    snap = QueueSnapshot(decodes=12, batch_decodes=10, mean_context=100, batch_chunk=100)
    budgeted = LoadSnapshot(snap, TINY, StepBudget(SimpleNamespace(cost=TINY), 0.050))
    SloAdmission(lambda: budgeted, 512, None, 0.050).admit(16, "interactive")   # 3 interactive rows: 3 ms, batch to 50 ms
    unbudgeted = LoadSnapshot(snap, TINY, None)                                   # --no-enable-step-time-budget
    with pytest.raises(APIError):
        SloAdmission(lambda: unbudgeted, 512, None, 0.050).admit(16, "interactive")   # 13 rows + 100 batch tokens: 113 ms
