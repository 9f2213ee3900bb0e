"""SLA capacity planning: how many replicas serve a traffic rate within latency targets.

Requests are spread over R identical replicas at random, so each sees Poisson traffic at rate/R
(a router that balances load does better, so this errs toward more replicas). For each R the
simulator runs one replica and the online requests' percentiles are checked against the SLO.

Utilization is offered load over what a replica sustains when saturated (the same request mix,
all queued at once, counted between 10% and 90% completions), so it reads like a queue's ρ:
below 1 the replica keeps up. Offline requests carry no SLO; they run at lower priority in the
capacity the online traffic leaves, and only need the replica to keep up (ρ < 1). That is the
simultaneous-use factor: the fleet is sized for the combined load, not for the sum of two peaks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from tokenfab.plan.simulate import SchedulerConfig, SimResult, StepCost, percentile, simulate
from tokenfab.plan.workload import SLO, LengthDist, make_requests


@dataclass(frozen=True, slots=True)
class Traffic:
    rate: float                    # requests/s, online and offline together
    prompt: LengthDist
    output: LengthDist
    offline_share: float = 0.0
    num_requests: int = 1000       # simulated per evaluation
    seed: int = 0
    burstiness: float = 1.0

    def requests(self, rate: float, num: int | None = None):
        return make_requests(rate, num or self.num_requests, self.prompt, self.output, self.offline_share,
                             self.seed, self.burstiness)


@dataclass(slots=True)
class ReplicaEval:
    replicas: int
    rate_per_replica: float
    utilization: float
    meets_slo: bool
    violations: list[str]
    online: dict
    offline: dict | None
    totals: dict
    sim: SimResult | None = field(default=None, repr=False)

    def as_dict(self) -> dict:
        return {"replicas": self.replicas, "rate_per_replica": self.rate_per_replica,
                "utilization": self.utilization, "meets_slo": self.meets_slo, "violations": self.violations,
                "online": self.online, "offline": self.offline, "sim": self.totals}


def saturation_rate(cost: StepCost, sched: SchedulerConfig, traffic: Traffic) -> float:
    """Requests/s one replica completes when it always has a full queue."""
    reqs = traffic.requests(1.0)
    for r in reqs:
        r.arrival = 0.0
    res = simulate(cost, reqs, sched)
    ends = sorted(r.arrival + r.e2e_s for r in res.requests)
    lo, hi = ends[len(ends) // 10], ends[(9 * len(ends)) // 10]
    if hi <= lo:
        return len(ends) / res.end_s
    return ((9 * len(ends)) // 10 - len(ends) // 10) / (hi - lo)


def evaluate(cost: StepCost, sched: SchedulerConfig, traffic: Traffic, slo: SLO, replicas: int,
             saturation: float) -> ReplicaEval:
    rate = traffic.rate / replicas
    rho = rate / saturation
    if rho >= 1:
        # Overloaded: queues grow without bound, every percentile with the run length. Not simulated.
        return ReplicaEval(replicas, rate, rho, False, [f"utilization {rho:.2f} ≥ 1: the queue grows without bound"],
                           {}, None, {})
    res = simulate(cost, traffic.requests(rate), sched)
    online = res.summary(online=True)
    violations = []
    if online["requests"]:
        for (metric, pct), target in slo.targets.items():
            got = res_percentile(res, metric, pct)
            if not got <= target:
                violations.append(f"{metric} p{pct:g} {got * 1e3:.1f} ms > {target * 1e3:g} ms")
    offline = res.summary(online=False) if traffic.offline_share > 0 else None
    return ReplicaEval(replicas, rate, rho, not violations, violations, online, offline, res.totals(), res)


def res_percentile(res: SimResult, metric: str, pct: float) -> float:
    vals = [getattr(r, f"{metric}_s") for r in res.select(online=True)]
    return percentile([v for v in vals if v is not None], pct)


@dataclass(slots=True)
class CapacityResult:
    replicas: int | None           # None: not reachable within max_replicas
    best: ReplicaEval | None
    saturation_rate: float         # requests/s per replica at full load
    evaluations: list[ReplicaEval]
    unloaded: ReplicaEval | None   # one request at a time: the pure service time, for reference


def plan_capacity(cost: StepCost, sched: SchedulerConfig, traffic: Traffic, slo: SLO,
                  max_replicas: int = 4096) -> CapacityResult:
    """Smallest replica count meeting the SLO: start where utilization drops below 1, double until the
    SLO holds, then bisect (latency falls as replicas rise; common random numbers keep that monotone)."""
    sat = saturation_rate(cost, sched, traffic)
    evals: dict[int, ReplicaEval] = {}

    def ok(r: int) -> bool:
        if r not in evals:
            evals[r] = evaluate(cost, sched, traffic, slo, r, sat)
        return evals[r].meets_slo

    bad, r = 0, max(1, math.floor(traffic.rate / sat))   # fewer than rate/sat replicas cannot keep up
    while not ok(r):
        if r >= max_replicas:
            break
        bad, r = r, min(r * 2, max_replicas)
    found = r if ok(r) else None
    while found is not None and found - bad > 1:
        mid = (bad + found) // 2
        if ok(mid):
            found = mid
        else:
            bad = mid
    # The unloaded reference: requests far apart, so nobody queues or shares a step.
    slow = replace(traffic, rate=sat / 1000, num_requests=min(traffic.num_requests, 50))
    unloaded = evaluate(cost, sched, slow, slo, 1, sat)
    return CapacityResult(found, evals.get(found) if found else None, sat,
                          [evals[k] for k in sorted(evals)], unloaded)
