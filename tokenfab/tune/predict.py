"""The calibrated planner's prediction of a point from a measured point of the same build.

One measured run of a build (weights, KV dtype, threads, speculation) leaves two things: the bench
result (every request's arrival, prompt and output length) and the server's step log (what each
engine step cost). The step log fits the planner's measured step table
(`costmodel.measured.MeasuredStepCost`), and the run's exact arrivals are replayed through the
planner's scheduler simulation (`plan.simulate`) under another point's scheduler settings
(`max_num_seqs`, `max_num_batched_tokens`, chunking), as `tokenfab plan validate` replays a run.

The replay of the measured point's own settings calibrates the rest: its P99 TTFT, P99 TPOT and run
length against the measured ones give a factor each, and every prediction is scaled by them, so what
the simulator leaves out (HTTP, detokenizing, the client) counts once, the same for every point.
Speculation is not simulated (its acceptance is unknown before a run); its builds are predicted
through the same factors.
"""
from __future__ import annotations

import math

from tokenfab.tune.space import Point


def _sched(point: Point):
    from tokenfab.plan.simulate import SchedulerConfig
    return SchedulerConfig(max_num_seqs=point.max_num_seqs, max_num_batched_tokens=point.max_num_batched_tokens,
                           enable_chunked_prefill=point.enable_chunked_prefill)


def _p99(values: list[float]) -> float:
    from tokenfab.plan.simulate import percentile
    return percentile(values, 99) if values else math.nan


def _replay(cost, reqs, point: Point):
    from tokenfab.plan.simulate import simulate
    done = simulate(cost, reqs, _sched(point)).requests
    span = max(r.arrival + r.e2e_s for r in done) - min(r.arrival for r in done)
    return done, span


def _factor(measured: float | None, predicted: float) -> float:
    if measured is None or not predicted > 0 or not measured > 0:
        return 1.0
    return min(4.0, max(0.25, measured / predicted))


def predict(measured_point: Point, measured: dict, bench_path: str, step_log: str, candidates: list[Point],
            slos: dict[str, float]) -> dict[Point, dict]:
    """Predicted metrics (run_metrics' keys) of `candidates`, same build as `measured_point`, whose
    measured metrics are `measured`. Raises ValueError when the step log is too thin to fit."""
    from tokenfab.costmodel.measured import MeasuredStepCost
    from tokenfab.plan.validate import load_bench_run

    reqs, _ = load_bench_run(bench_path)
    cost = MeasuredStepCost.from_file(step_log)
    ref, ref_span = _replay(cost, reqs, measured_point)
    f_ttft = _factor(measured.get("p99_ttft_ms"), _p99([r.ttft_s * 1e3 for r in ref]))
    f_tpot = _factor(measured.get("p99_tpot_ms"), _p99([r.tpot_s * 1e3 for r in ref if r.tpot_s is not None]))
    f_span = _factor(measured.get("duration_s"), ref_span)
    out = {}
    for point in candidates:
        try:
            done, span = _replay(cost, reqs, point)
        except ValueError:       # settings the workload cannot run under (a prompt over an unchunked budget)
            out[point] = {"completed": 0, "failed": len(reqs), "duration_s": math.nan, "p99_ttft_ms": math.inf,
                          "p99_tpot_ms": math.inf, "request_throughput": 0.0, "output_throughput": 0.0,
                          "goodput": 0.0, "good_output_tok_s": 0.0}
            continue
        rows = [(r.ttft_s * 1e3 * f_ttft, None if r.tpot_s is None else r.tpot_s * 1e3 * f_tpot, r.output_len)
                for r in done]
        dur = max(span * f_span, 1e-9)
        good = [r for r in rows if r[0] <= slos.get("ttft", math.inf) and (r[1] or 0.0) <= slos.get("tpot", math.inf)]
        out[point] = {"completed": len(rows), "failed": 0, "duration_s": dur,
                      "p99_ttft_ms": _p99([r[0] for r in rows]),
                      "p99_tpot_ms": _p99([r[1] for r in rows if r[1] is not None]),
                      "request_throughput": len(rows) / dur, "output_throughput": sum(r[2] for r in rows) / dur,
                      "goodput": len(good) / dur, "good_output_tok_s": sum(r[2] for r in good) / dur}
    return out
