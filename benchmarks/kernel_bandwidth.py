"""Decode GEMMs at real layer shapes, per GGUF block type: one activation row (one stream's decode step)
through the four projections of one decoder layer of a geometry, each built from random blocks the way the
loader builds it, timed with the kernel forced (qgemm by default, best of a few runs). Prints, per type,
ms per layer and GB/s of the bytes the kernel reads (the layer's layout in memory) and of the GGUF file's
bytes, beside the machine's read bandwidth (tokenfab plan probe's float32 sum over 512 MiB). The file
GB/s over the machine's is the share of the bandwidth limit a decode step can reach on these layers.

    python benchmarks/kernel_bandwidth.py                          # llama-3.2-1b, every type
    python benchmarks/kernel_bandwidth.py --geometry llama-3.2-3b --types Q4_K,Q4_0 --kernel qdot

"Q4_K stored" and "Q4_0 stored" are the file's blocks held as stored (what the loader builds on AVX2 CPUs
without AMX int8 tiles, `blocks_as_stored` in tokenfab/quant/kquants.py); "Q4_K" and "Q4_0" are the int4
blocks in tf_qgemm's layout it builds elsewhere. The other types load one way.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from tokenfab import kernels
from tokenfab.kernels import linear as seam
from tokenfab.plan.probe import ProbeSettings, measure_bandwidth
from tokenfab.quant.linear import gguf_linear

# hidden, q heads, kv heads, head dim, FFN width
GEOMETRIES = {
    "smollm2-135m": (576, 9, 3, 64, 1536),
    "llama-3.2-1b": (2048, 32, 8, 64, 8192),
    "llama-3.2-3b": (3072, 24, 8, 128, 8192),
    "llama-3.1-8b": (4096, 32, 8, 128, 14336),
}
# bytes per block, weights per block, and the offsets of the fp16 scales set to sane values in random blocks
BLOCKS = {"Q4_0": (18, 32, (0,)), "Q4_1": (20, 32, (0, 2)), "Q5_0": (22, 32, (0,)), "Q8_0": (34, 32, (0,)),
          "Q4_K": (144, 256, (0, 2)), "Q5_K": (176, 256, (0, 2)), "Q6_K": (210, 256, (208,))}


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    bb, qk, scales = BLOCKS[kind]
    b = rng.integers(0, 256, size=(rows, cols // qk, bb), dtype=np.uint8)
    for off in scales:
        s = (rng.random((rows, cols // qk)) * 0.01 + 1e-3).astype(np.float16)
        b[..., off:off + 2] = s.view(np.uint8).reshape(rows, cols // qk, 2)
    return b.reshape(rows, -1)


def layer_shapes(geometry: str) -> list[tuple[str, int, int]]:
    hidden, h, kvh, d, ffn = GEOMETRIES[geometry]
    return [("qkv", (h + 2 * kvh) * d, hidden), ("o", hidden, h * d), ("gate_up", 2 * ffn, hidden),
            ("down", hidden, ffn)]


def best_time(fn, runs: int) -> float:
    fn()
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--geometry", default="llama-3.2-1b", choices=sorted(GEOMETRIES))
    ap.add_argument("--types", default="Q4_K stored,Q4_K,Q5_K,Q6_K,Q8_0,Q4_0 stored,Q4_0,Q4_1")
    ap.add_argument("--kernel", default="qgemm", help="the linear kernel forced on every layer")
    ap.add_argument("--rows", type=int, default=1, help="activation rows (decode streams)")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--min-mb", type=float, default=256, help="file bytes of layer copies to cycle through")
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    bw = measure_bandwidth(ProbeSettings())
    cpu = kernels._cpu_model().split(":", 1)[-1].strip()
    print(f"{cpu}, {kernels.isa()} build, {torch.get_num_threads()} threads; "
          f"machine read bandwidth {bw:.1f} GB/s; {args.geometry}, {args.rows} row(s), kernel {args.kernel}")
    print(f"{'type':<12}{'ms/layer':>10}{'layout MB':>11}{'file MB':>9}{'layout GB/s':>13}{'file GB/s':>11}"
          f"{'file/machine':>14}")
    for kind in args.types.split(","):
        base = kind.split()[0]
        if any(in_f % BLOCKS[base][1] for _, _, in_f in layer_shapes(args.geometry)):
            print(f"{kind:<12}blocks of {BLOCKS[base][1]} do not divide this geometry's widths")
            continue
        layers, file_bytes, copies = [], 0, 0
        while file_bytes < args.min_mb * 1e6:      # several layers' copies: a step streams from memory, not cache
            for _, out_f, in_f in layer_shapes(args.geometry):
                raw = random_blocks(base, out_f, in_f, rng)
                layers.append(gguf_linear(raw, base, out_f, in_f, as_stored=kind.endswith("stored")))
                file_bytes += raw.nbytes
            copies += 1
        why = seam.get(args.kernel).supports(layers[0])
        if why:
            print(f"{kind:<12}{args.kernel} cannot run it here: {why}")
            continue
        xs = []
        for layer in layers:
            layer.plan = seam.forced_plan(layer, args.kernel)
            xs.append(torch.randn(args.rows, layer.in_features))
        s = best_time(lambda: [layer(x) for layer, x in zip(layers, xs)], args.runs)
        layout_bytes = sum(layer.weight_bytes() for layer in layers)
        print(f"{kind:<12}{s / copies * 1e3:>10.3f}{layout_bytes / copies / 1e6:>11.1f}{file_bytes / copies / 1e6:>9.1f}"
              f"{layout_bytes / s / 1e9:>13.1f}{file_bytes / s / 1e9:>11.1f}{file_bytes / s / 1e9 / bw:>14.0%}")

if __name__ == "__main__":
    main()
