"""The tensor-parallel communication model: what one all-reduce costs, and fitting it to measurements.

    all-reduce(bytes) = latency + 2(t−1)/t × bytes / bandwidth          (ring; NCCL's and gloo's shape)

A step of a t-way tensor-parallel model pays two of them per layer (after o_proj and down_proj), each
of the step's hidden states (roofline.step_time).

`latency` is what one all-reduce costs *inside an engine step*, not on an idle link: on the 2-core
dev VM a bare gloo all-reduce of 2 KiB took ~0.3 ms in a tight loop but ~0.9 ms between two layers'
matmuls (docs/tensor_parallel.md), because each rank comes to it from compute, with cold caches and a
gloo I/O thread to wake. So the catalog's gloo figure is the in-engine one, and the calibration hook
below fits both numbers to the engine's own all-reduce counters (`shard.Comm`: calls, bytes, seconds),
which is what `benchmarks/tensor_parallel.py --save-hardware FILE` writes into a hardware entry.
"""
from __future__ import annotations

from dataclasses import dataclass

# Defaults by collective backend, for a hardware entry that names `interconnect_backend` but gives no
# link numbers of its own. gloo (2 CPU ranks on the 2-core dev VM, benchmarks/tensor_parallel.py, quiet
# machine, 2026-12-01 03:33 UTC): the latency is fit_allreduce over the engine's recorded in-step
# all-reduces (0.93 ms at 2 KiB, 0.80 ms at 16 KiB: latency-bound, 856 µs), the bandwidth the bare
# link's fit of the same run (0.94 GB/s; only prefill-sized messages feel it). nccl: the GPU entries'
# usual figures (PCIe-class ring; NVLink entries give their own), not measured here (no GPU). shm
# (tokenfab's shared-memory all-reduce, distributed/shm.py: what CPU ranks on one host use by default):
# fit_allreduce over the engine's in-step all-reduces, every step of one run (2026-12-01 23:28 UTC,
# 13 µs at 2 KiB, 16 µs at 16 KiB, 371 µs at 1 MiB), checked on a later run (docs/tensor_parallel.md).
BACKEND_DEFAULTS = {
    "gloo": {"interconnect_latency_us": 855.0, "interconnect_gb_s": 0.94},
    "shm": {"interconnect_latency_us": 11.0, "interconnect_gb_s": 3.59},
    "nccl": {"interconnect_latency_us": 25.0, "interconnect_gb_s": 32.0},
}


def allreduce_s(t: int, nbytes: float, latency_us: float, gb_s: float) -> float:
    """Seconds of one ring all-reduce of `nbytes` over `t` ranks (0 for t = 1)."""
    if t <= 1:
        return 0.0
    return latency_us * 1e-6 + 2 * (t - 1) / t * nbytes / (gb_s * 1e9)


@dataclass(frozen=True, slots=True)
class LinkFit:
    latency_us: float
    gb_s: float
    mean_abs_rel_error: float
    samples: int

    def entry(self) -> dict:
        """The hardware-entry fields this fit sets."""
        return {"interconnect_latency_us": round(self.latency_us, 2), "interconnect_gb_s": float(f"{self.gb_s:.5g}")}


def fit_allreduce(samples: list[tuple[float, float]], t: int = 2) -> LinkFit:
    """(latency, bandwidth) of the ring formula from (bytes per all-reduce, seconds per all-reduce)
    samples: least squares on the relative error (weights 1/seconds²), so the small messages a decode
    step sends count as much as a prefill's big ones. With one message size (or a negative slope, from
    noise) only the latency is fitted and the bandwidth is left effectively infinite."""
    if not samples:
        raise ValueError("no all-reduce samples to fit (run a tensor-parallel engine with tensor_parallel_size > 1)")
    xs = [2 * (t - 1) / t * b for b, _ in samples]
    ys = [s for _, s in samples]
    w = [1 / y ** 2 for y in ys]
    sw, sx, sy = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * y for wi, y in zip(w, ys))
    sxx, sxy = sum(wi * x * x for wi, x in zip(w, xs)), sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    den = sw * sxx - sx * sx
    slope = (sw * sxy - sx * sy) / den if den > 1e-30 * max(1.0, sw * sxx) else 0.0
    if slope <= 0:
        slope, lat = 0.0, sy / sw
    else:
        lat = (sy - slope * sx) / sw
        if lat < 0:             # all bandwidth: refit through the origin
            lat, slope = 0.0, sxy / sxx
    gb_s = 1 / slope / 1e9 if slope > 0 else 1e6
    err = sum(abs(allreduce_s(t, b, lat * 1e6, gb_s) / s - 1) for b, s in samples) / len(samples)
    return LinkFit(latency_us=lat * 1e6, gb_s=gb_s, mean_abs_rel_error=err, samples=len(samples))


def step_samples(deltas: list[tuple[int, int, float]]) -> list[tuple[float, float]]:
    """Engine steps' all-reduce counter deltas (calls, bytes, seconds) -> (bytes, seconds) per
    all-reduce. Every all-reduce of one step carries the same hidden-state size, so the step's mean is
    one sample at that size."""
    return [(b / c, s / c) for c, b, s in deltas if c > 0 and s > 0]
