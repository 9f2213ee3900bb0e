"""`tokenfab plan validate`: the simulator's prediction error against a measured `tokenfab bench` run.

The bench result holds every request's scheduled send time, prompt and output length. Those exact
arrivals are replayed through the simulator (same scheduler limits as the server) with a step-cost
model, and the simulated P50 TPOT, P99 TTFT and output throughput are set beside the measured ones:

    error = (predicted - measured) / measured

With a step table's measured scatter (`costmodel.measured.NoisyStepCost`) the replay runs `replicates` times
with different seeds: the prediction is the mean of each replicate's metrics (what one measured run
is expected to show) and the P10-P90 of them is printed beside it: a P99 over 150 requests is about
their second-largest value and moves a lot from run to run, measured or simulated.

The step costs should come from steps measured on a different run than the one checked (for
instance `tokenfab serve --step-log steps.jsonl` during another rate, or `plan calibrate
--save-table`), or the check grades the fit on its own training data.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tokenfab.costmodel.measured import MeasuredStepCost, NoisyStepCost
from tokenfab.plan.simulate import SchedulerConfig, percentile, simulate
from tokenfab.plan.workload import Request

METRICS = (("tpot_p50_ms", "P50 TPOT (ms)"), ("ttft_p99_ms", "P99 TTFT (ms)"),
           ("output_tok_s", "output throughput (tok/s)"))


@dataclass
class Validation:
    bench: str
    run: int
    requests: int
    measured: dict[str, float]
    predicted: dict[str, float]
    replicates: int = 1
    band: dict[str, tuple[float, float]] = field(default_factory=dict)   # P10, P90 over the replicates

    @property
    def errors(self) -> dict[str, float]:
        return {k: (self.predicted[k] - v) / v if v else float("nan") for k, v in self.measured.items()}

    def as_dict(self) -> dict:
        return {"bench": self.bench, "run": self.run, "requests": self.requests, "measured": self.measured,
                "predicted": self.predicted, "relative_error": self.errors, "replicates": self.replicates,
                "predicted_p10_p90": self.band}


def _metrics(ttft_s: list[float], tpot_s: list[float], output_tokens: int, span_s: float) -> dict[str, float]:
    return {"tpot_p50_ms": percentile(tpot_s, 50) * 1e3, "ttft_p99_ms": percentile(ttft_s, 99) * 1e3,
            "output_tok_s": output_tokens / span_s if span_s > 0 else float("nan")}


def load_bench_run(path: str | Path, run: int = 0) -> tuple[list[Request], dict[str, float]]:
    """The completed requests of one run of a `tokenfab bench serve --out` file, as simulator
    requests (arrival = scheduled send time), and that run's measured metrics."""
    try:
        data = json.loads(Path(path).expanduser().read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read a bench result ({e})") from None
    runs = data.get("runs") if isinstance(data, dict) else None
    if not runs:
        raise ValueError(f"{path}: no runs in this file (expected the JSON `tokenfab bench serve` writes)")
    if not 0 <= run < len(runs):
        raise ValueError(f"{path} has {len(runs)} run(s); --run {run} is out of range")
    recs = [r for r in runs[run].get("requests") or [] if r.get("success")]
    if len(recs) < 2:
        raise ValueError(f"{path}: run {run} has {len(recs)} completed request records; "
                         "re-run the bench without --no-requests")
    start = min(r["scheduled_s"] for r in recs)
    reqs = [Request(id=i, arrival=r["scheduled_s"] - start, prompt_len=int(r["prompt_len"]),
                    output_len=max(1, int(r["output_len"]))) for i, r in enumerate(recs)]
    measured = _metrics([r["ttft_ms"] / 1e3 for r in recs],
                        [r["tpot_ms"] / 1e3 for r in recs if r.get("tpot_ms") is not None],
                        sum(int(r["output_len"]) for r in recs),
                        max(r["end_s"] for r in recs) - start)
    return reqs, measured


def validate(bench: str | Path, cost, config: SchedulerConfig, run: int = 0, replicates: int = 1,
             seed: int = 0) -> Validation:
    """Replay the bench run's arrivals through the simulator with `cost` (a StepCost); with
    `replicates` > 1 and a measured table that has a noise model, once per seed with its scatter."""
    reqs, measured = load_bench_run(bench, run)
    noisy = replicates > 1 and isinstance(cost, MeasuredStepCost) and bool(cost.noise)
    costs = [NoisyStepCost(cost, seed + i) for i in range(replicates)] if noisy else [cost]
    runs = []
    for c in costs:
        done = simulate(c, reqs, config).requests
        runs.append(_metrics([r.ttft_s for r in done], [r.tpot_s for r in done if r.tpot_s is not None],
                             sum(r.output_len for r in done), max(r.arrival + r.e2e_s for r in done)))
    predicted = {k: sum(r[k] for r in runs) / len(runs) for k in measured}
    band = {k: (percentile([r[k] for r in runs], 10), percentile([r[k] for r in runs], 90))
            for k in measured} if len(runs) > 1 else {}
    return Validation(str(bench), run, len(reqs), measured, predicted, len(runs), band)
