"""The precise quantized kernels at big-batch and prefill row counts, against float32, per call.

    python benchmarks/big_batch_kernels.py                       # 2 threads, 17 32 64 512 rows
    python benchmarks/big_batch_kernels.py --threads 1 --rows 16 32 64 128

For each of the bundled model's linear shapes (int4-g32 decoder layers, the Q8_0 LM head; random
weights) and each row count: tf_qgemm (decode rows,
timed up to 64), tf_qmadd (qgemm's layout, outputs in the lanes) and float32 F.linear on the
dequantized weight (MKL, the float copy's arithmetic), best of --repeats calls after a warm one, and
the ratio float32 / qmadd (> 1: qmadd faster). The engine measures its own table per CPU
(tokenfab/kernels/tuning.py: one thread, weights streamed); this shows the kernels side by side with
the CPU's model and flags, so ratios from different machines can be told apart.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from tokenfab import kernels
from tokenfab.quant.linear import Int4Linear, Q8_0Linear

SHAPES = [("int4", 960, 576), ("int4", 576, 576), ("int4", 3072, 576), ("int4", 576, 1536), ("q8_0", 49152, 576)]


def best_ms(f, repeats: int) -> float:
    f()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def layer(fmt: str, n: int, k: int, g: torch.Generator):
    if fmt == "int4":
        return Int4Linear.from_float(torch.randn(n, k, generator=g) * 0.05, None, 32)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    return Q8_0Linear(q, torch.rand(n, k // 32, generator=g) * 0.01)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[17, 32, 64, 512])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    if not kernels.enabled():
        raise SystemExit("tokenfab's C kernels are not built here (no compiler, or TOKENFAB_CPU_KERNELS=0)")
    torch.set_num_threads(args.threads)
    flags = sorted(kernels.cpu_flags() & {"avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16"})
    print(f"{kernels._cpu_model().strip()} ({' '.join(flags)}); kernels {kernels.describe()}; "
          f"{args.threads} thread(s); ms per call")
    g = torch.Generator().manual_seed(0)
    print(f"{'shape':>18} {'rows':>5} {'qgemm':>9} {'qmadd':>9} {'float32':>9} {'float32/qmadd':>14}")
    for fmt, n, k in SHAPES:
        lin = layer(fmt, n, k, g)
        lay, w = lin.cpu_layout(), lin.dequantize(torch.float32)
        for rows in args.rows:
            x = torch.randn(rows, k, generator=g)
            tq = best_ms(lambda: kernels.qgemm(x, *lay, n), args.repeats) if rows <= 64 else float("nan")
            tm = best_ms(lambda: kernels.qmadd(x, *lay, n), args.repeats)
            tf = best_ms(lambda: F.linear(x, w), args.repeats)
            print(f"{fmt + ' ' + str(n) + 'x' + str(k):>18} {rows:>5} {tq:>9.3f} {tm:>9.3f} {tf:>9.3f} {tf / tm:>13.2f}x",
                  flush=True)


if __name__ == "__main__":
    main()
