"""A step-cost model fitted to measured step times, to replace the roofline in the simulator.

Rows are steps the real engine ran, each with its shape and duration:

    {num_tokens: 512, num_seqs: 1, attn_pairs: 131328, kv_tokens: 512, step_s: 0.031}

and the fit is least squares with non-negative coefficients:

    step_s ≈ c0 + c_tok·num_tokens + c_seq·num_seqs + c_pair·attn_pairs + c_kv·kv_tokens

Within one regime (all memory-bound decodes, or all compute-bound prefills) each term is what the
roofline says it is; mixing regimes makes the fit an average of both, which is why calibration
measures both phases. A table file is YAML or JSON: a list of rows, or {rows: [...]}.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from tokenfab.plan.roofline import StepShape

FEATURES = ("num_tokens", "num_seqs", "attn_pairs", "kv_tokens")


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


@dataclass(frozen=True, slots=True)
class MeasuredStepCost:
    intercept: float
    coef: dict[str, float]
    window: int | None = None
    global_frac: float = 1.0
    rows: int = 0
    mean_abs_rel_error: float = 0.0

    @classmethod
    def fit(cls, rows: list[dict], window: int | None = None, global_frac: float = 1.0) -> "MeasuredStepCost":
        if len(rows) < 2:
            raise ValueError(f"a step table needs at least 2 measured rows, got {len(rows)}")
        try:
            x = np.array([[1.0] + [float(r[f]) for f in FEATURES] for r in rows])
            y = np.array([float(r["step_s"]) for r in rows])
        except KeyError as e:
            raise ValueError(f"step-table rows need {', '.join(FEATURES)} and step_s; a row lacks {e.args[0]}") from None
        # Relative error matters: a 1 ms decode and a 1 s prefill should both fit, so rows are weighted by 1/y.
        w = 1.0 / np.maximum(y, 1e-9)
        sol = nonneg_lstsq(x * w[:, None], y * w)
        pred = x @ sol
        err = float(np.mean(np.abs(pred - y) / np.maximum(y, 1e-9)))
        return cls(intercept=float(sol[0]), coef=dict(zip(FEATURES, map(float, sol[1:]))), window=window,
                   global_frac=global_frac, rows=len(rows), mean_abs_rel_error=err)

    @classmethod
    def from_file(cls, path: str | Path, window: int | None = None, global_frac: float = 1.0) -> "MeasuredStepCost":
        return cls.fit(read_rows(path), window=window, global_frac=global_frac)

    def new_shape(self) -> StepShape:
        return StepShape(window=self.window, global_frac=self.global_frac)

    def step_time(self, shape: StepShape) -> float:
        c = self.coef
        return (self.intercept + c["num_tokens"] * shape.num_tokens + c["num_seqs"] * shape.num_seqs
                + c["attn_pairs"] * shape.attn_pairs + c["kv_tokens"] * shape.kv_tokens)

    def as_dict(self) -> dict:
        return {"intercept_s": self.intercept, "coef": self.coef, "rows": self.rows,
                "mean_abs_rel_error": self.mean_abs_rel_error}


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
                                  "kv_tokens": s.kv_tokens, "step_s": round(step_s, 7)}) + "\n")
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
