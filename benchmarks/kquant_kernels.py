"""K-quant decode kernels (tf_qgemm's K-quant path) against the float32 oneDNN GEMM and Q8_0's tf_qgemm on a
2048x2048 weight, one thread, 1 and 8 rows: microseconds per call and the ratio to float (best of 3).

    python benchmarks/kquant_kernels.py
"""
import time

import torch
torch.set_num_threads(1)
from tokenfab.quant.kquants import KQUANT_LINEAR_TYPES
from tokenfab.quant.linear import Q8_0Linear
from tokenfab.kernels.linear import onednn_pack, onednn_linear
N, K = 2048, 2048
w = torch.randn(N, K)
layers = {"Q4_K qgemm": KQUANT_LINEAR_TYPES["Q4_K"].from_float(w), "Q6_K qgemm": KQUANT_LINEAR_TYPES["Q6_K"].from_float(w),
          "Q8_0 qgemm": Q8_0Linear(*__import__("tokenfab.quant.schemes", fromlist=["x"]).quantize_int8(w)[:1], torch.ones(N, K//32)) }
for l in layers.values(): l.kernel = "qgemm"
packed = onednn_pack(w)
def t(f, reps=30):
    f(); best = 1e9
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps): f()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best
for M in (1, 8):
    x = torch.randn(M, K)
    base = t(lambda: onednn_linear(x, packed, None))
    print(f"M={M} float32 oneDNN {base*1e6:.0f} us", end="; ")
    for n, l in layers.items():
        print(f"{n} {t(lambda: l(x))*1e6:.0f} us ({base / t(lambda: l(x)):.2f}x float)", end="; ")
    print()
