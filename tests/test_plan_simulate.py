"""The scheduler simulation: queueing sanity, the pure-service-time limit, and the engine's policy."""
from dataclasses import replace

import pytest

from tokenfab.plan import roofline
from tokenfab.plan.capacity import Traffic, plan_capacity, saturation_rate
from tokenfab.plan.hardware import Hardware
from tokenfab.plan.models import preset
from tokenfab.plan.roofline import Deployment, Efficiency, RooflineCost
from tokenfab.plan.simulate import SchedulerConfig, Simulator, simulate
from tokenfab.plan.workload import SLO, Request, make_requests, parse_length

HW = Hardware(name="test-gpu", memory_gib=80, bandwidth_gb_s=2000, tflops={"fp16": 300.0})
DEP = Deployment.make(preset("llama-3-8b"), HW, "fp16", eff=Efficiency(0.8, 0.5, 0.001))
COST = RooflineCost(DEP)
SCHED = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024, num_kv_blocks=4000)
PROMPT, OUTPUT = parse_length("lognormal:400:0.6"), parse_length("exp:80")


@pytest.fixture(scope="module")
def saturation():
    return saturation_rate(COST, SCHED, Traffic(1.0, PROMPT, OUTPUT, num_requests=300))


def _run(rate, n=400, sched=SCHED, **kw):
    return simulate(COST, make_requests(rate, n, PROMPT, OUTPUT, seed=3, **kw), sched)


def test_littles_law_holds_on_the_simulators_output(saturation):
    res = _run(0.7 * saturation)
    lam = len(res.requests) / res.end_s
    w = sum(r.e2e_s for r in res.requests) / len(res.requests)
    # L comes from integrating the in-system count over arrival/departure events; λW from per-request times.
    assert res.mean_in_system == pytest.approx(lam * w, rel=1e-9)
    assert res.mean_in_system > 1          # a loaded system, not a trivial one


def test_utilization_and_latency_rise_with_rate(saturation):
    rates = [f * saturation for f in (0.2, 0.5, 0.8, 0.95)]
    runs = [_run(r) for r in rates]
    busy = [r.busy_fraction for r in runs]
    ttft = [r.summary()["ttft"]["mean"] for r in runs]
    e2e = [r.summary()["e2e"]["mean"] for r in runs]
    in_system = [r.mean_in_system for r in runs]
    assert busy == sorted(busy) and busy[0] < busy[-1]
    assert ttft == sorted(ttft) and ttft[-1] > 2 * ttft[0]
    assert e2e == sorted(e2e) and in_system == sorted(in_system)


def test_unloaded_requests_see_the_pure_service_time():
    reqs = [Request(i, 1000.0 * i, 1500, 20) for i in range(5)]       # far apart: no one shares a step
    res = simulate(COST, reqs, SCHED)
    # Service alone: a 1500-token prompt in chunks of 1024 and 476, then 19 decodes at batch 1.
    chunks = []
    for done, n in ((0, 1024), (1024, 476)):
        s = COST.new_shape()
        s.add(done, n)
        chunks.append(COST.step_time(s))
    decodes = [roofline.decode(DEP, 1, 1500 + i).total_s for i in range(19)]
    for r in res.requests:
        assert r.queue_s == 0
        assert r.ttft_s == pytest.approx(sum(chunks), rel=1e-9)
        assert r.tpot_s == pytest.approx(sum(decodes) / 19, rel=1e-9)


def test_latency_never_beats_service_time_alone(saturation):
    res = _run(0.9 * saturation)
    for r in res.requests[:50]:
        alone = simulate(COST, [Request(0, 0.0, r.prompt_len, r.output_len)], SCHED).requests[0]
        assert r.e2e_s >= alone.e2e_s * (1 - 1e-9)


def test_infinite_capacity_limit_approaches_the_unloaded_latency(saturation):
    slo = SLO.parse("ttft_p99:60000,tpot_p99:60000")
    res = plan_capacity(COST, SCHED, Traffic(3 * saturation, PROMPT, OUTPUT, num_requests=300), slo)
    many = res.evaluations[-1]
    assert res.replicas == 4                     # ρ < 1 needs 4 replicas for 3× one replica's saturation
    spread = plan_capacity(COST, SCHED, Traffic(3 * saturation, PROMPT, OUTPUT, num_requests=300),
                           SLO.parse("ttft_p50:1,tpot_p50:1"), max_replicas=64)
    assert spread.replicas is None               # 1 ms is below the pure service time: unreachable
    wide = spread.evaluations[-1]
    assert wide.online["ttft"]["p50"] < many.online["ttft"]["p50"]
    assert wide.online["ttft"]["p50"] == pytest.approx(res.unloaded.online["ttft"]["p50"], rel=0.5)


def test_fast_forwarded_decodes_give_the_same_results_as_single_steps(saturation):
    for rate, blocks, policy in ((0.5, 4000, "fcfs"), (1.5, 600, "fcfs"), (1.5, 600, "priority")):
        reqs = make_requests(rate * saturation, 200, PROMPT, OUTPUT, offline_share=0.3, seed=5)
        cfg = replace(SCHED, num_kv_blocks=blocks, policy=policy)
        fast = Simulator(COST, cfg, fast_forward=True).run(reqs)
        slow = Simulator(COST, cfg, fast_forward=False).run(reqs)
        assert fast.requests == slow.requests
        assert fast.num_steps == slow.num_steps and fast.num_preemptions == slow.num_preemptions


def test_a_small_kv_pool_preempts_yet_every_request_completes():
    reqs = make_requests(100.0, 100, PROMPT, OUTPUT, seed=1)
    res = simulate(COST, reqs, replace(SCHED, num_kv_blocks=300))
    assert res.num_preemptions > 0
    assert sorted(r.id for r in res.requests) == list(range(100))
    assert all(r.e2e_s >= r.ttft_s > 0 for r in res.requests)


def test_priority_policy_serves_online_requests_first(saturation):
    reqs = make_requests(1.2 * saturation, 300, PROMPT, OUTPUT, offline_share=0.5, seed=2)
    res = simulate(COST, reqs, replace(SCHED, policy="priority"))
    online, offline = res.summary(online=True), res.summary(online=False)
    assert online["queue"]["mean"] < offline["queue"]["mean"]


def test_a_request_larger_than_the_pool_is_reported():
    with pytest.raises(ValueError, match="tokens of KV"):
        simulate(COST, [Request(0, 0.0, 5000, 4)], replace(SCHED, num_kv_blocks=100))


def test_a_request_over_an_unchunked_step_budget_is_reported_not_looped():
    # the engine caps max_model_len at the budget when chunked prefill is off; the simulation refuses the same
    with pytest.raises(ValueError, match="chunked prefill is off and a step holds 512"):
        simulate(COST, [Request(0, 0.0, 1000, 4)], replace(SCHED, enable_chunked_prefill=False,
                                                          max_num_batched_tokens=512))
    assert len(simulate(COST, [Request(0, 0.0, 500, 4)], replace(SCHED, enable_chunked_prefill=False,
                                                               max_num_batched_tokens=512)).requests) == 1


def test_schedule_matches_the_engine_scheduler_step_for_step():
    sched_mod = pytest.importorskip("tokenfab.engine.scheduler")
    from tokenfab.engine.kv_cache import BlockManager
    from tokenfab.engine.sequence import Sequence
    from tokenfab.sampling import SamplingParams

    for policy, blocks in (("fcfs", 80), ("fcfs", 1000), ("priority", 80)):
        reqs = make_requests(1.0, 30, parse_length("uniform:20:300"), parse_length("uniform:1:40"),
                             offline_share=0.4, seed=7)
        for r in reqs:
            r.arrival = 0.0                   # all queued at once: the engine test has no clock
        cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, block_size=16, num_kv_blocks=blocks,
                              policy=policy)
        ours: list = []
        Simulator(COST, cfg, trace=ours).run(reqs)

        sch = sched_mod.Scheduler(BlockManager(blocks, 16, enable_prefix_caching=False), 8, 256, policy=policy)
        for r in reqs:
            sch.add(Sequence(request_id=str(r.id), index=0, prompt_token_ids=list(range(r.prompt_len)),
                             params=SamplingParams(max_tokens=r.output_len), max_tokens=r.output_len,
                             priority=int(r.offline), arrival_time=r.id * 1e-9))
        theirs = []
        while sch.has_work():
            batch = sch.schedule()
            theirs.append([(int(s.request_id), n) for s, n in zip(batch.seqs, batch.num_new_tokens)])
            for s, n in zip(batch.seqs, batch.num_new_tokens):
                s.num_computed_tokens += n
                if s.num_computed_tokens == s.num_tokens:
                    s.token_ids.append(7)
                    if s.num_output_tokens >= s.max_tokens:
                        sch.remove(s)
        assert ours == theirs, (policy, blocks)


def test_runs_at_different_rates_see_the_same_requests_closer_together():
    slow, fast = (make_requests(r, 50, PROMPT, OUTPUT, offline_share=0.3, seed=9) for r in (1.0, 4.0))
    assert [(r.prompt_len, r.output_len, r.offline) for r in slow] == [(r.prompt_len, r.output_len, r.offline) for r in fast]
    assert all(f.arrival == pytest.approx(s.arrival / 4) for s, f in zip(slow, fast))


def test_more_traffic_needs_at_least_as_many_replicas(saturation):
    slo = SLO.parse("ttft_p99:2000,tpot_p99:100")
    counts = [plan_capacity(COST, SCHED, Traffic(f * saturation, PROMPT, OUTPUT, num_requests=200), slo).replicas
              for f in (0.5, 2.0, 6.0)]
    assert counts == sorted(counts) and counts[-1] > counts[0]
