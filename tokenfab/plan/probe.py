"""Measure this machine: memory bandwidth and matmul peak per dtype, as a hardware-catalog entry.

Bandwidth is what a decode step needs: streaming reads of a buffer far larger than the caches
(a float32 sum, so the arithmetic is negligible), best of a few runs. The matmul peak is timed on
square matrices per dtype, best of a few runs; a dtype the device cannot multiply is left out.
These are achievable peaks of torch on this machine, so efficiencies fitted against them by
`calibrate` measure the engine, not the spec sheet.
"""
from __future__ import annotations

import datetime
import os
import platform
import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ProbeSettings:
    device: str = "cpu"              # cpu | cuda
    buffer_mib: int = 512            # bandwidth buffer; must dwarf the last-level cache
    matmul_n: int | None = None      # largest matrix side; None: 2048 on CPU, 8192 on CUDA
    seconds_per_test: float = 0.5
    dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16", "int8")


def _sync(device: str) -> None:
    if device == "cuda":
        import torch
        torch.cuda.synchronize()


def _best_time(fn, device: str, budget_s: float, min_runs: int = 3) -> float:
    fn()                                    # warm-up (allocations, kernel selection)
    _sync(device)
    best, spent, runs = float("inf"), 0.0, 0
    while runs < min_runs or spent < budget_s:
        t0 = time.perf_counter()
        fn()
        _sync(device)
        dt = time.perf_counter() - t0
        best, spent, runs = min(best, dt), spent + dt, runs + 1
        if runs >= 50:
            break
    return best


def measure_bandwidth(s: ProbeSettings) -> float:
    """Read bandwidth in GB/s."""
    import torch
    n = s.buffer_mib * 2**20 // 4
    x = torch.ones(n, dtype=torch.float32, device=s.device)
    dt = _best_time(lambda: x.sum(), s.device, s.seconds_per_test)
    return n * 4 / dt / 1e9


def _matmul_fn(dtype: str, n: int, device: str):
    import torch
    if dtype == "int8":
        a = torch.randint(-8, 8, (n, n), dtype=torch.int8, device=device)
        b = torch.randint(-8, 8, (n, n), dtype=torch.int8, device=device)
        return lambda: torch._int_mm(a, b)
    t = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    a = torch.randn(n, n, device=device).to(t)
    b = torch.randn(n, n, device=device).to(t)
    return lambda: a @ b


def measure_matmul(s: ProbeSettings, dtype: str) -> float | None:
    """Dense matmul TFLOPS (TOPS for int8) at this dtype, or None if unsupported here.

    The size grows from 128 until one multiply takes a quarter of the time budget (or reaches
    `matmul_n`): CPUs without native bf16/fp16/int8 kernels run those formats ~50x slower than
    fp32 (0.5 GFLOPS here against 27), and a fixed 2048-cube would take minutes."""
    n_max = s.matmul_n or (8192 if s.device == "cuda" else 2048)
    n = min(128, n_max)
    while True:
        try:
            fn = _matmul_fn(dtype, n, s.device)
            fn()
            _sync(s.device)
        except (RuntimeError, NotImplementedError, AttributeError, KeyError):
            return None
        t0 = time.perf_counter()
        fn()
        _sync(s.device)
        if time.perf_counter() - t0 > s.seconds_per_test / 4 or n >= n_max:
            break
        n = min(n * 2, n_max)
    dt = _best_time(fn, s.device, s.seconds_per_test)
    return 2 * n**3 / dt / 1e12


def _device_info(device: str) -> tuple[str, float]:
    """(name, memory GiB)."""
    if device == "cuda":
        import torch
        props = torch.cuda.get_device_properties(0)
        return props.name, props.total_memory / 2**30
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), name)
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return name, mem


def probe(s: ProbeSettings, progress=None) -> dict:
    """Measure and return a catalog entry (a mapping, ready for `hardware.save_entry`)."""
    import torch
    if s.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but torch sees no CUDA device")
    name, mem = _device_info(s.device)
    bw = measure_bandwidth(s)
    if progress:
        progress()
    tflops = {}
    for d in s.dtypes:
        v = measure_matmul(s, d)
        if v is not None:
            tflops[d] = round(v, 4)
        if progress:
            progress()
    threads = torch.get_num_threads() if s.device == "cpu" else None
    when = datetime.date.today().isoformat()
    return {
        "kind": "gpu" if s.device == "cuda" else "cpu",
        "memory_gib": round(mem, 1),
        "bandwidth_gb_s": round(bw, 2),
        "tflops": tflops,
        "source": f"measured by `tokenfab plan probe` on {when}: {name}"
                  + (f", {threads} torch threads" if threads else "")
                  + f", {s.buffer_mib} MiB read buffer",
    }
