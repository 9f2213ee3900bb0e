"""Admission by predicted TTFT (server/slo.py): a tiny step-cost model and a queue decide 429 or admit."""
from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

from tokenfab.plan.step_table import MeasuredStepCost
from tokenfab.server.app import build_app
from tokenfab.server.config import ServerConfig
from tokenfab.server.errors import APIError
from tokenfab.server.launch import ServerThread
from tokenfab.server.slo import QueueSnapshot, SloAdmission, predict_ttft

pytestmark = pytest.mark.timeout(300)

# 1 ms per token in a step, nothing else: a step of 512 tokens costs 0.512 s.
TINY = MeasuredStepCost(knots=(0.0, 1000.0), values=(0.0, 1.0),
                        coef={"num_seqs": 0.0, "attn_pairs": 0.0, "kv_tokens": 0.0})
QUEUE = QueueSnapshot(time=0.0, interactive_prefill=3000)          # 3000 prompt tokens ahead


def admission(ttft_ms: float, snapshot: QueueSnapshot = QUEUE) -> SloAdmission:
    online = SimpleNamespace(cost=TINY, snapshot=snapshot, budget=512)
    return SloAdmission(online, ttft_ms / 1e3, None)


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
    online = SimpleNamespace(cost=None, snapshot=QUEUE, budget=512)
    SloAdmission(online, 0.001, 0.001).admit(10_000, "interactive")


@pytest.fixture(scope="module")
def server(bundled_llm):
    engine = bundled_llm.engine
    before = engine.step_observer
    app = build_app(engine, ServerConfig(access_log=False, ui=False, slo_ttft_ms=1000))
    try:
        with ServerThread(app) as srv:
            yield srv, app.state.tokenfab.slo
    finally:
        engine.step_observer = before
    assert engine.block_manager.num_used_blocks() == 0


def test_server_sheds_interactive_with_429_and_runs_flex(server):
    srv, slo = server
    slo.online.cost = TINY
    slo.online.snapshot = QueueSnapshot(time=1e18, interactive_prefill=3000)   # newer than any admission
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
