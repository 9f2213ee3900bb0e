"""A step-cost model fitted to measured step times, to replace the roofline in the simulator.

Rows are steps the real engine ran, each with its shape and duration:

    {num_tokens: 512, num_seqs: 1, attn_pairs: 131328, kv_tokens: 512, step_s: 0.031}

and the fit is

    step_s ≈ f(num_tokens) + c_seq·num_seqs + c_pair·attn_pairs + c_kv·kv_tokens

with f piecewise linear between knots on the token count and every coefficient non-negative. The
token count is how many rows go through the linear layers, which is what switches a real engine's
regime: memory-bound decode kernels for a few rows, a GEMM for many, fewer threads for small steps
(tokenfab on CPU can do all three), a CUDA graph per batch size. A single line through all of them
misses both ends (on the 2-core VM it under-predicted a held-out run's P50 TPOT by 15-33 %). Knots sit
on a grid (every count to 8, then ×1.5 steps) thinned until each segment holds at least
`MIN_ROWS_PER_SEGMENT` rows, so sparse tables fall back to a line. Rows are weighted by 1/√step_s
(relative error would let the many short decode steps pull the total low; absolute error ignores
them), then the fit is scaled so its total over the rows equals the measured total.

Step times also scatter around the fit (the 2-core VM: ratios 0.8-1.2 at P10-P90, runs of slow steps
when the machine is busy elsewhere), and a mean-cost replay under-predicts tail latencies: a P99 TTFT
lands on the slow stretches. So the fit keeps the measured/predicted ratios' quantiles (mean 1) and,
for a step log (rows carry their start time `t`, in order), their lag-1 correlation; `NoisyStepCost`
multiplies each simulated step by a ratio drawn from them, correlated step to step the same way.
A table file is YAML or JSON (a list of rows, or {rows: [...]}) or JSON lines.
"""
from __future__ import annotations

import json
import math
import random
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from tokenfab.costmodel.shape import StepShape

FEATURES = ("num_tokens", "num_seqs", "attn_pairs", "kv_tokens")
LINEAR_FEATURES = FEATURES[1:]          # num_tokens enters through the piecewise-linear f
MIN_ROWS_PER_SEGMENT = 8
RIDGE = 1e-8
NOISE_QUANTILES = 64        # ratio quantiles kept for NoisyStepCost
MIN_NOISE_ROWS = 32         # fewer rows: no noise model (the quantiles would be the rows themselves)


def nonneg_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with x ≥ 0: drop the most negative coefficient and refit until none is."""
    active = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (sol >= 0).all():
            x[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return x


def _grid(hi: float) -> list[float]:
    g, k = list(range(1, 9)), 8.0
    while k < hi:
        k = round(k * 1.5)
        g.append(k)
    return g


def choose_knots(tokens: np.ndarray, min_rows: int = MIN_ROWS_PER_SEGMENT) -> list[float]:
    """Knots from the min to the max token count, on the grid, each segment holding ≥ min_rows rows."""
    lo, hi = float(tokens.min()), float(tokens.max())
    if lo == hi:
        return [lo]
    knots = [lo]
    for k in _grid(hi):
        if knots[-1] < k < hi and np.count_nonzero((tokens > knots[-1]) & (tokens <= k)) >= min_rows:
            knots.append(float(k))
    if len(knots) > 1 and np.count_nonzero(tokens > knots[-1]) < min_rows:
        knots.pop()                     # the last segment would be too thin: merge it into the one before
    return knots + [hi]


def hat_basis(x: np.ndarray, knots: list[float]) -> np.ndarray:
    """Columns whose weights are f's values at the knots (linear interpolation inside [knots])."""
    x = np.clip(np.asarray(x, dtype=float), knots[0], knots[-1])
    if len(knots) == 1:
        return np.ones((len(x), 1))
    out = np.zeros((len(x), len(knots)))
    j = np.clip(np.searchsorted(knots, x, side="right") - 1, 0, len(knots) - 2)
    k = np.asarray(knots)
    t = (x - k[j]) / (k[j + 1] - k[j])
    rows = np.arange(len(x))
    out[rows, j] = 1 - t
    out[rows, j + 1] = t
    return out


@dataclass(frozen=True, slots=True)
class MeasuredStepCost:
    knots: tuple[float, ...]             # token counts
    values: tuple[float, ...]            # f at the knots (s)
    coef: dict[str, float]               # per num_seqs / attn_pairs / kv_tokens (s)
    window: int | None = None
    global_frac: float = 1.0
    rows: int = 0
    mean_abs_rel_error: float = 0.0
    noise: tuple[float, ...] = ()        # quantiles of measured/predicted at (i + 0.5) / n, mean 1
    noise_corr: float = 0.0              # lag-1 autocorrelation of their logs, in time order

    @classmethod
    def fit(cls, rows: list[dict], window: int | None = None, global_frac: float = 1.0) -> "MeasuredStepCost":
        if len(rows) < 2:
            raise ValueError(f"a step table needs at least 2 measured rows, got {len(rows)}")
        try:
            feats = np.array([[float(r[f]) for f in FEATURES] for r in rows])
            y = np.array([float(r["step_s"]) for r in rows])
        except KeyError as e:
            raise ValueError(f"step-table rows need {', '.join(FEATURES)} and step_s; a row lacks {e.args[0]}") from None
        if (y <= 0).any():
            raise ValueError("step-table rows need a positive step_s")
        knots = choose_knots(feats[:, 0])
        x = np.hstack([hat_basis(feats[:, 0], knots), feats[:, 1:]])
        w = 1.0 / np.sqrt(y)
        nk = len(knots)
        a = x * w[:, None]
        # Columns at unit norm, and a faint ridge on the linear terms: where they are collinear with f
        # (pure decodes have num_seqs == num_tokens) or unmeasured, f takes the time, not them.
        norm = np.linalg.norm(a, axis=0)
        norm[norm == 0] = 1.0
        ridge = np.zeros((x.shape[1] - nk, x.shape[1]))
        ridge[:, nk:] = np.sqrt(RIDGE) * np.eye(x.shape[1] - nk)
        sol = nonneg_lstsq(np.vstack([a / norm, ridge]), np.concatenate([y * w, np.zeros(len(ridge))])) / norm
        # Then scale so the rows' predicted total is their measured total: the weighting above still
        # leans low, and busy time is what a queue amplifies (3 % low in step cost was 10 % low in TPOT).
        total = float((x @ sol).sum())
        if total > 0:
            sol *= float(y.sum()) / total
        pred = x @ sol
        err = float(np.mean(np.abs(pred - y) / y))
        noise, corr = _noise(y, pred, all("t" in r for r in rows))
        return cls(knots=tuple(knots), values=tuple(map(float, sol[:nk])),
                   coef=dict(zip(LINEAR_FEATURES, map(float, sol[nk:]))), window=window,
                   global_frac=global_frac, rows=len(rows), mean_abs_rel_error=err, noise=noise, noise_corr=corr)

    @classmethod
    def from_file(cls, path: str | Path, window: int | None = None, global_frac: float = 1.0) -> "MeasuredStepCost":
        return cls.fit(read_rows(path), window=window, global_frac=global_frac)

    def new_shape(self) -> StepShape:
        return StepShape(window=self.window, global_frac=self.global_frac)

    def tokens_cost(self, n: float) -> float:
        """f(n): interpolated between knots; outside them, the end segment's slope (never negative)."""
        k, v = self.knots, self.values
        if len(k) == 1:
            return v[0]
        if n <= k[0]:
            slope = max(0.0, (v[1] - v[0]) / (k[1] - k[0]))
            return max(0.0, v[0] - slope * (k[0] - n))
        if n >= k[-1]:
            return v[-1] + max(0.0, (v[-1] - v[-2]) / (k[-1] - k[-2])) * (n - k[-1])
        j = bisect_right(k, n) - 1                     # plain Python: the simulator calls this per step
        return v[j] + (v[j + 1] - v[j]) * (n - k[j]) / (k[j + 1] - k[j])

    def step_time(self, shape: StepShape) -> float:
        c = self.coef
        return (self.tokens_cost(shape.num_tokens) + c["num_seqs"] * shape.num_seqs
                + c["attn_pairs"] * shape.attn_pairs + c["kv_tokens"] * shape.kv_tokens)

    def as_dict(self) -> dict:
        out = {"tokens_cost_s": {f"{k:g}": v for k, v in zip(self.knots, self.values)}, "coef": self.coef,
               "rows": self.rows, "mean_abs_rel_error": self.mean_abs_rel_error}
        if self.noise:
            n = self.noise
            out["noise"] = {"ratio_p10": n[len(n) // 10], "ratio_p50": n[len(n) // 2],
                            "ratio_p90": n[len(n) - 1 - len(n) // 10], "lag1_corr": self.noise_corr}
        return out


def _noise(y: np.ndarray, pred: np.ndarray, timed: bool) -> tuple[tuple[float, ...], float]:
    """The ratios measured/predicted as NOISE_QUANTILES quantiles scaled to mean 1 (so the noise keeps
    the fitted total), and their logs' lag-1 autocorrelation when the rows are a time series."""
    ok = pred > 0
    if ok.sum() < MIN_NOISE_ROWS:
        return (), 0.0
    ratio = y[ok] / pred[ok]
    q = np.quantile(ratio, (np.arange(NOISE_QUANTILES) + 0.5) / NOISE_QUANTILES)
    q /= q.mean()
    corr = 0.0
    if timed:
        lr = np.log(ratio) - np.log(ratio).mean()
        den = float(lr @ lr)
        corr = min(max(float(lr[1:] @ lr[:-1]) / den, 0.0), 0.99) if den > 0 else 0.0
    return tuple(map(float, q)), corr


class NoisyStepCost:
    """A measured step cost whose every step is multiplied by a ratio drawn from the fit's measured
    scatter: a Gaussian AR(1) with the measured lag-1 correlation, mapped through the ratio quantiles.
    Seeded; every `Simulator.run` starts the sequence afresh (`reset`), so a run is reproducible."""

    def __init__(self, base: MeasuredStepCost, seed: int = 0):
        if not base.noise:
            raise ValueError("this step table has too few rows for a noise model")
        self.base, self.seed = base, seed
        self._q, self._rho = base.noise, base.noise_corr
        self._innov = math.sqrt(1 - self._rho ** 2)
        self.reset()

    def reset(self) -> None:
        self._rng = random.Random(self.seed)
        self._z = self._rng.gauss(0.0, 1.0)

    def new_shape(self) -> StepShape:
        return self.base.new_shape()

    def ratio(self) -> float:
        self._z = self._rho * self._z + self._innov * self._rng.gauss(0.0, 1.0)
        u = 0.5 * (1.0 + math.erf(self._z / math.sqrt(2.0)))           # N(0,1) → uniform
        q = self._q
        x = min(max(u * len(q) - 0.5, 0.0), len(q) - 1.0)               # quantile i sits at (i + 0.5) / n
        i = min(int(x), len(q) - 2)
        return q[i] + (q[i + 1] - q[i]) * (x - i)

    def step_time(self, shape: StepShape) -> float:
        return self.base.step_time(shape) * self.ratio()


def read_rows(path: str | Path) -> list[dict]:
    """Rows from a YAML or JSON file (a list, or {rows: [...]}) or a JSON-lines file (.jsonl, one row
    per line: what `tokenfab serve --step-log` writes)."""
    p = Path(path).expanduser()
    try:
        text = p.read_text()
    except OSError as e:
        raise ValueError(f"{path}: cannot read the step table ({e.strerror})") from None
    try:
        if p.suffix == ".jsonl":
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except ValueError as e:
        raise ValueError(f"{path}: not a step table ({e})") from None
    rows = data.get("rows") if isinstance(data, dict) else data
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected a list of step rows or a mapping with 'rows'")
    return rows


class StepLog:
    """Appends one JSON line per engine step to a file: the step's shape and its duration.

    Hook it into an engine (`engine.step_observer = StepLog(path)`): a table of what the real server
    ran under real load, for `plan capacity --step-table` and `plan validate`. A step's duration runs
    to the start of the next step when requests were left in flight (so the serving loop's own work
    between steps is counted, as a client feels it), else to its own end."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        self._f = open(self.path, "a", buffering=1)        # line-buffered: rows survive a crash
        self._pending: tuple[StepShape, float, float, bool] | None = None

    def __call__(self, steps: list[tuple[int, int]], start: float, end: float, busy: bool) -> None:
        """steps: (cached tokens before the step, new tokens) per scheduled sequence."""
        self._flush(start)
        s = StepShape()
        for computed, n in steps:
            s.add(computed, n)
        self._pending = (s, start, end, busy)

    def _flush(self, next_start: float | None) -> None:
        if self._pending is None:
            return
        s, start, end, busy = self._pending
        step_s = (next_start if busy and next_start is not None else end) - start
        self._f.write(json.dumps({"num_tokens": s.num_tokens, "num_seqs": s.num_seqs, "attn_pairs": s.attn_pairs,
                                  "kv_tokens": s.kv_tokens, "step_s": round(step_s, 7),
                                  "t": round(start, 6)}) + "\n")
        self._pending = None

    def close(self) -> None:
        self._flush(None)
        self._f.close()


def shape_row(computed: int, n: int, count: int, step_s: float) -> dict:
    """A table row for `count` sequences with `computed` cached tokens each running `n` new ones."""
    s = StepShape()
    s.add(computed, n, count)
    return {"num_tokens": s.num_tokens, "num_seqs": s.num_seqs, "attn_pairs": s.attn_pairs,
            "kv_tokens": s.kv_tokens, "step_s": step_s}
