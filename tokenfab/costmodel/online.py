"""The engine's step-cost model, calibrated online from the steps it runs.

Every step's shape (rows through the linears, sequences, attention pairs, KV entries read) and wall time
go into a window of the last WINDOW steps; every REFIT_EVERY steps a `MeasuredStepCost` (measured.py) is refitted
over them (a few milliseconds of numpy on the engine thread). Two readers share the one model:
- the scheduler's step-time budget (engine/step_budget.py), which sizes batch rows and long-prompt
  prefill chunks so that a step stays within the interactive TPOT target;
- SLO admission (server/slo.py), which predicts a new request's TTFT from it.
Until MIN_ROWS steps have run, `cost` is None and neither uses it.

The refit runs on one BLAS thread: numpy's OpenBLAS, left to its own thread pool beside torch's busy
OpenMP threads, took 60-400 ms for the small least-squares (a stall every REFIT_EVERY steps, i.e. in
every P99), against 1-40 ms on one thread (the 2-core VM, busy).
"""
from __future__ import annotations

import contextlib
from collections import deque

from tokenfab.costmodel.measured import MeasuredStepCost
from tokenfab.costmodel.shape import StepShape

MIN_ROWS = 32
REFIT_EVERY = 64
WINDOW = 1024


class OnlineStepModel:
    """Collects (shape, seconds) per step and keeps `cost`, refitted; `cost` is replaced whole, so a
    reader on another thread never sees a half-built model."""

    def __init__(self) -> None:
        self.rows: deque[dict] = deque(maxlen=WINDOW)
        self.since_fit = 0
        self.cost: MeasuredStepCost | None = None

    def observe(self, steps: list[tuple[int, int]], seconds: float) -> None:
        """steps: (tokens computed before the step, new tokens) per scheduled sequence."""
        s = StepShape()
        for computed, n in steps:
            s.add(computed, n)
        self.rows.append({"num_tokens": s.num_tokens, "num_seqs": s.num_seqs, "attn_pairs": s.attn_pairs,
                          "kv_tokens": s.kv_tokens, "step_s": max(seconds, 1e-6)})
        self.since_fit += 1
        if len(self.rows) >= MIN_ROWS and (self.cost is None or self.since_fit >= REFIT_EVERY):
            try:
                with _one_blas_thread():
                    self.cost = MeasuredStepCost.fit(list(self.rows))
            except (ValueError, ArithmeticError):
                pass
            self.since_fit = 0


_controller = None


def _one_blas_thread():
    """One BLAS thread for the refit. The controller (the loaded BLAS and OpenMP libraries, found by
    scanning the process's shared objects) is built once: `threadpool_limits` rebuilt it on every call,
    6 ms of the engine thread per refit with torch loaded (0.04 ms reusing it)."""
    global _controller
    if _controller is None:
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:           # a runtime dependency; without it the fit just runs on numpy's default
            return contextlib.nullcontext()
        _controller = ThreadpoolController()
    return _controller.limit(limits=1)
