"""Calibration: time the real engine and fit the roofline's efficiencies and per-step overhead.

Measurements (through the offline API, `LLM.generate`):
- prefill: one prompt of P tokens with max_tokens=1, at a few P (one step each, P ≤ the budget);
- decode: B prompts generating N1 and then N2 tokens; (T(N2) − T(N1)) / (N2 − N1) is one decode
  step at batch B, with the prefill and the request overheads cancelled out.

Each timing becomes a step shape with a measured duration. The fit finds bandwidth efficiency
e_b, compute efficiency e_c and overhead o minimising the relative error of

    t ≈ max(bytes / (BW · e_b), flops / (peak · e_c)) + o

by a log-spaced grid over (e_b, e_c), with o solved in closed form at each point, then refined by
alternating least squares on the regime each point falls in. The rows are also a step table
(`costmodel.measured.MeasuredStepCost`), which the simulator can use instead of the roofline.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, replace

import numpy as np

from tokenfab.costmodel.measured import nonneg_lstsq, shape_row
from tokenfab.costmodel.shape import StepShape
from tokenfab.plan import roofline
from tokenfab.plan.roofline import Deployment, Efficiency


@dataclass(frozen=True, slots=True)
class Fit:
    bandwidth: float
    compute: float
    overhead_s: float
    mean_abs_rel_error: float
    predicted_s: list[float]
    bound: list[str]

    def as_dict(self) -> dict:
        return {"bandwidth_efficiency": self.bandwidth, "compute_efficiency": self.compute,
                "step_overhead_ms": self.overhead_s * 1e3, "mean_abs_rel_error": self.mean_abs_rel_error}


def _ceilings(dep: Deployment, shapes: list[StepShape]) -> tuple[np.ndarray, np.ndarray]:
    """Per shape: memory time and compute time at 100% efficiency, no overhead."""
    ideal = replace(dep, eff=Efficiency(bandwidth=1.0, compute=1.0, step_overhead_s=0.0))
    times = [roofline.step_time(ideal, s) for s in shapes]
    return np.array([t.memory_s for t in times]), np.array([t.compute_s for t in times])


def _objective(a, b, t, x, y):
    """For inverse efficiencies x (memory), y (compute): best overhead ≥ 0 and the weighted SSE."""
    base = np.maximum(a * x, b * y)
    w2 = 1.0 / t**2
    o = max(0.0, float(np.sum((t - base) * w2) / np.sum(w2)))
    return o, float(np.sum(((base + o - t) / t) ** 2))


def fit_efficiency(dep: Deployment, shapes: list[StepShape], measured_s: list[float]) -> Fit:
    """Fit (e_b, e_c, overhead) to measured step times; see the module docstring."""
    if len(shapes) != len(measured_s) or len(shapes) < 3:
        raise ValueError(f"need at least 3 timed steps (got {len(measured_s)}) with one shape each")
    a, b = _ceilings(dep, shapes)
    t = np.array(measured_s, dtype=float)
    if (t <= 0).any():
        raise ValueError("measured step times must be positive")
    # Grid over inverse efficiencies: efficiencies from 0.5% to 150% of the spec sheet.
    grid = np.geomspace(1 / 1.5, 200.0, 90)
    best = (np.inf, 1.0, 1.0, 0.0)
    for x in grid:
        for y in grid:
            o, err = _objective(a, b, t, x, y)
            if err < best[0]:
                best = (err, x, y, o)
    err, x, y, o = best
    # Refine: points' regimes are fixed by the current (x, y); solve the linear problem; repeat.
    for _ in range(20):
        mem = a * x >= b * y
        cols = np.stack([np.where(mem, a, 0.0), np.where(mem, 0.0, b), np.ones_like(t)], axis=1)
        sol = nonneg_lstsq(cols / t[:, None], np.ones_like(t))
        nx = sol[0] if mem.any() and sol[0] > 0 else x
        ny = sol[1] if (~mem).any() and sol[1] > 0 else y
        no, nerr = _objective(a, b, t, nx, ny)
        if nerr >= err - 1e-12:
            break
        err, x, y, o = nerr, nx, ny, no
    pred = np.maximum(a * x, b * y) + o
    return Fit(bandwidth=float(1 / x), compute=float(1 / y), overhead_s=o,
               mean_abs_rel_error=float(np.mean(np.abs(pred - t) / t)), predicted_s=pred.tolist(),
               bound=["memory" if ai * x >= bi * y else "compute" for ai, bi in zip(a, b)])


# ---- measuring the engine ------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Timing:
    phase: str            # prefill | decode
    prompt_len: int
    batch: int
    context: int          # cached tokens per sequence before the step (decode: the mean over the run)
    step_s: float

    def shape(self, window: int | None = None, global_frac: float = 1.0) -> StepShape:
        s = StepShape(window=window, global_frac=global_frac)
        if self.phase == "prefill":
            s.add(0, self.prompt_len, self.batch)
        else:
            s.add(self.context, 1, self.batch)
        return s

    def row(self) -> dict:
        n = self.prompt_len if self.phase == "prefill" else 1
        return {"phase": self.phase, **shape_row(0 if self.phase == "prefill" else self.context, n,
                                                 self.batch, self.step_s)}


def _prompts(rng: random.Random, count: int, length: int, vocab: int) -> list[list[int]]:
    # Random ids (away from the special tokens at the start of most vocabularies): no two prompts
    # share a prefix, so a prefix cache cannot shorten a timed prefill.
    return [[rng.randrange(256, max(vocab, 512)) for _ in range(length)] for _ in range(count)]


def _timed(llm, prompts, max_tokens: int) -> float:
    from tokenfab.sampling import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    got = [len(o.outputs[0].token_ids) for o in outs]
    if got != [max_tokens] * len(prompts):
        raise RuntimeError(f"asked for {max_tokens} tokens per prompt with ignore_eos, got {got}")
    return dt


def measure_engine(llm, prompt_lens: list[int], batches: list[int], vocab: int, decode_prompt_len: int = 32,
                   decode_tokens: tuple[int, int] = (8, 40), repeats: int = 3, seed: int = 0,
                   progress=None) -> list[Timing]:
    """Time prefill at each prompt length and decode at each batch size; medians of `repeats`."""
    rng = random.Random(seed)
    _timed(llm, _prompts(rng, 1, 16, vocab), 2)           # warm-up: first-call allocations, kernels
    out = []
    for p in prompt_lens:
        dts = [_timed(llm, _prompts(rng, 1, p, vocab), 1) for _ in range(repeats)]
        out.append(Timing("prefill", p, 1, 0, statistics.median(dts)))
        if progress:
            progress()
    n1, n2 = decode_tokens
    for bsz in batches:
        steps = []
        for _ in range(repeats):
            t1 = _timed(llm, _prompts(rng, bsz, decode_prompt_len, vocab), n1)
            t2 = _timed(llm, _prompts(rng, bsz, decode_prompt_len, vocab), n2)
            steps.append((t2 - t1) / (n2 - n1))
        ctx = decode_prompt_len + (n1 + n2) // 2
        out.append(Timing("decode", decode_prompt_len, bsz, ctx, max(statistics.median(steps), 1e-6)))
        if progress:
            progress()
    return out


def measure_mixed(llm, prompt_lens: list[int], output_len: int, vocab: int, seed: int = 1) -> float:
    """Wall time of one offline batch of prompts of mixed lengths: a held-out check of the simulator."""
    rng = random.Random(seed)
    return _timed(llm, [_prompts(rng, 1, p, vocab)[0] for p in prompt_lens], output_len)
