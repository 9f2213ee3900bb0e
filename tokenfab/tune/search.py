"""The search: quality first, then speed, measured where it can decide and predicted elsewhere.

1. Quality, once per (weights, KV dtype) (quality.py), when a floor is given. Points below the floor
   are out: no speed run can bring them back, so none is spent on them.
2. The baseline, the engine's defaults, is measured first (when its quality holds): the reference
   the chosen point's goodput is set against.
3. Each build (weights, KV dtype, threads, speculation) gets one measured point, the one whose
   scheduler settings are nearest the defaults. Its run predicts the build's other points (predict.py).
4. Predicted points that could win, meeting the targets with a 10 % margin and scoring above the
   best measured point, are measured, best first, and the build's predictions are refreshed from
   the newest run of that build.
Every measurement waits for the budget: none starts once the time left is below the mean of the
earlier ones. The points never reached keep their prediction, or none.

Score: goodput per core (requests/s meeting both latency targets, over `num_threads`), or with a price
per hour the cost of a million good output tokens on the cores the point uses (lower wins).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tokenfab.bench.local_server import ServerError
from tokenfab.tune.measure import bench_once, compact_run, run_metrics, serving
from tokenfab.tune.predict import predict
from tokenfab.tune.quality import measure_quality
from tokenfab.tune.results import Results
from tokenfab.tune.space import Point, check_point
from tokenfab.tune.targets import Check, Targets

WIN_MARGIN = 1.05        # a prediction must beat the best measured score by 5 % to be worth a run
TARGET_MARGIN = 1.10     # ... and meet the latency targets with 10 % to spare for the prediction's error
MAX_RUNS_PER_BUILD = 3


@dataclass
class PointResult:
    point: Point
    source: str                         # measured | predicted | skipped | not run
    metrics: dict | None = None
    quality: dict | None = None
    checks: list[Check] = field(default_factory=list)
    note: str = ""
    score: float = -math.inf

    @property
    def meets(self) -> bool:
        return self.metrics is not None and all(c.ok for c in self.checks)

    def failing(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]


@dataclass
class Scorer:
    """Goodput per core, or (usd_per_hour given) minus the cost per million good output tokens."""
    usd_per_hour: float | None = None
    cores: int = 1

    def __call__(self, point: Point, metrics: dict) -> float:
        if self.usd_per_hour is None:
            return metrics["goodput"] / point.num_threads
        return -self.cost_per_mtok(point, metrics)

    def cost_per_mtok(self, point: Point, metrics: dict) -> float:
        tok_s = metrics["good_output_tok_s"]
        if not tok_s:
            return math.inf
        share = min(1.0, point.num_threads / self.cores)
        return self.usd_per_hour * share / 3600 / tok_s * 1e6


@dataclass
class Tuner:
    model: str | None
    is_gguf: bool
    points: list[Point]
    baseline: Point
    targets: Targets
    workload: object
    out_dir: Path
    budget_s: float
    scorer: Scorer
    quality_args: dict                  # text, ctx, max_windows for quant eval
    say: Callable[[str], None] = lambda _msg: None
    on_tick: Callable[[int, int], None] = lambda _measured, _predicted: None
    results: Results | None = None
    measured_now: list[Point] = field(default_factory=list)
    _t0: float = 0.0
    _run_seconds: list[float] = field(default_factory=list)

    # -- time ----------------------------------------------------------------------------------------
    def time_left(self) -> float:
        return self.budget_s - (time.monotonic() - self._t0)

    def _can_run(self) -> bool:
        est = sum(self._run_seconds) / len(self._run_seconds) if self._run_seconds else 0.0
        return self.time_left() > est

    # -- quality -------------------------------------------------------------------------------------
    def _quality(self, key: tuple[str, str]) -> dict | None:
        if key in self.results.quality:
            return self.results.quality[key]
        if self.time_left() <= 0:
            return None
        self.say(f"quality of {key[0]} weights, KV {key[1]}: quant eval against full precision")
        return self.results.add_quality(*key, measure_quality(self.model, *key, **self.quality_args))

    # -- speed ---------------------------------------------------------------------------------------
    def _measure(self, point: Point) -> dict | None:
        if point in self.results.measured:
            return self.results.measured[point]
        if point in self.results.failed or not self._can_run():
            return None
        n = len(self.results.measured) + len(self.results.failed)
        bench_path, steps = self.out_dir / "bench" / f"{n}.json", self.out_dir / "steps" / f"{n}.jsonl"
        for p in (bench_path, steps):
            p.parent.mkdir(parents=True, exist_ok=True)
        steps.unlink(missing_ok=True)
        self.say(f"measuring {point.label()}")
        t0 = time.monotonic()
        try:
            with serving(self.model, point.argv(), self.out_dir / "server.log", steps) as url:
                result = bench_once(url, self.workload, self.targets.slos())
        except ServerError as e:
            self.results.add_failed(point, str(e))
            return None
        from tokenfab.bench.schema import write_result
        write_result(str(bench_path), result)
        seconds = time.monotonic() - t0
        self._run_seconds.append(seconds)
        self.measured_now.append(point)
        return self.results.add_measured(point, {"run": compact_run(result), "bench": str(bench_path.name),
                                                 "step_log": str(steps.name), "seconds": round(seconds, 2)})

    def _metrics(self, row: dict) -> dict:
        return run_metrics(row["run"], self.targets.slos())

    def _predict_build(self, build: tuple, feasible: list[Point]) -> dict[Point, dict]:
        """Predictions for the build's unmeasured points, from its most recent measured run."""
        runs = [(p, r) for p, r in self.results.measured.items() if p.build() == build]
        others = [p for p in feasible if p.build() == build and p not in self.results.measured]
        if not runs or not others:
            return {}
        point, row = runs[-1]
        try:
            return predict(point, self._metrics(row), str(self.out_dir / "bench" / row["bench"]),
                           str(self.out_dir / "steps" / row["step_log"]), others, self.targets.slos())
        except (ValueError, OSError) as e:      # a step log too thin to fit: the build stays unpredicted
            self.say(f"no prediction for {point.label()}'s build: {e}")
            return {}

    def _could_win(self, point: Point, metrics: dict, best: float) -> bool:
        lat = {"p99_ttft_ms": self.targets.p99_ttft_ms, "p99_tpot_ms": self.targets.p99_tpot_ms}
        for key, limit in lat.items():
            value = metrics.get(key)
            if limit is not None and (value is None or not value * TARGET_MARGIN <= limit):
                return False
        score = self.scorer(point, metrics)
        return best == -math.inf or score > (best * WIN_MARGIN if best > 0 else best / WIN_MARGIN)

    def _best_measured(self, feasible: set[Point]) -> float:
        scores = [self.scorer(p, m) for p, m in ((p, self._metrics(r)) for p, r in self.results.measured.items())
                  if p in feasible and all(c.ok for c in self.targets.speed_checks(m))]
        return max(scores, default=-math.inf)

    def run(self, results: Results) -> list[PointResult]:
        self.results, self._t0 = results, time.monotonic()
        out: dict[Point, PointResult] = {}
        valid = []
        for p in self.points:
            why = check_point(p, self.model, self.is_gguf)
            if why:
                out[p] = PointResult(p, "skipped", note=why)
            else:
                valid.append(p)
        quality = {}
        need = self.targets.max_kl is not None or self.targets.min_top1 is not None
        for key in dict.fromkeys(p.quality_key() for p in valid):      # no floor: nothing to measure
            quality[key] = self._quality(key) if need else {}
        feasible = []
        for p in valid:
            q = quality[p.quality_key()]
            if q is None:
                out[p] = PointResult(p, "not run", note="the budget ended before its quality was measured")
            elif not all(c.ok for c in self.targets.quality_checks(q)):
                out[p] = PointResult(p, "skipped", quality=q, checks=self.targets.quality_checks(q),
                                     note="below the quality floor")
            else:
                feasible.append(p)
        predicted: dict[Point, dict] = {}
        builds = list(dict.fromkeys(p.build() for p in feasible))
        first = [self.baseline] if self.baseline in feasible else []
        probes = first + [min((p for p in feasible if p.build() == b), key=self._distance) for b in builds]
        for p in dict.fromkeys(probes):
            if self._measure(p) is not None:
                predicted.update(self._predict_build(p.build(), feasible))
            self.on_tick(len(self.results.measured), len(predicted))
        runs_per_build: dict[tuple, int] = {}
        while self._can_run():
            best = self._best_measured(set(feasible))
            todo = sorted(((p, m) for p, m in predicted.items() if p not in self.results.measured
                           and p not in self.results.failed
                           and runs_per_build.get(p.build(), 0) < MAX_RUNS_PER_BUILD
                           and self._could_win(p, m, best)),
                          key=lambda pm: -self.scorer(*pm))
            if not todo:
                break
            p = todo[0][0]
            runs_per_build[p.build()] = runs_per_build.get(p.build(), 0) + 1
            if self._measure(p) is None:
                predicted.pop(p, None)
                continue
            predicted.update(self._predict_build(p.build(), feasible))
            self.on_tick(len(self.results.measured), len(predicted))
        for p in feasible:
            q = quality[p.quality_key()]
            if p in self.results.measured:
                m, source = self._metrics(self.results.measured[p]), "measured"
            elif p in predicted:
                m, source = predicted[p], "predicted"
            else:
                note = self.results.failed.get(p, "the budget ended before it was measured or predicted")
                out[p] = PointResult(p, "not run", quality=q, note=note)
                continue
            checks = self.targets.speed_checks(m) + self.targets.quality_checks(q)
            out[p] = PointResult(p, source, m, q or None, checks, score=self.scorer(p, m))
        return [out[p] for p in self.points if p in out]

    def _distance(self, p: Point) -> tuple:
        """How far a point's scheduler settings are from the baseline's (the probe is the nearest)."""
        b = self.baseline
        return (abs(math.log2(p.max_num_seqs / b.max_num_seqs)),
                abs(math.log2(p.max_num_batched_tokens / b.max_num_batched_tokens)),
                p.enable_chunked_prefill != b.enable_chunked_prefill)


def choose(results: list[PointResult]) -> PointResult | None:
    """The measured point that meets every target with the highest score."""
    ok = [r for r in results if r.source == "measured" and r.meets]
    return max(ok, key=lambda r: r.score, default=None)


def nearest_misses(results: list[PointResult]) -> list[Check]:
    """For each failing target, the best value any measured point reached: how far the targets are."""
    best: dict[str, Check] = {}
    for r in results:
        if r.source != "measured" and r.source != "skipped":
            continue
        for c in r.checks:
            if c.name not in best or c.excess < best[c.name].excess:
                best[c.name] = c
    return [c for c in best.values() if not c.ok]
