"""tf_qgemm from two versions of the C kernels, in one process, calls interleaved: a change's effect on decode rows.

    python benchmarks/qgemm_ab.py                        # this tree's kernels against HEAD~1's, 1 row
    python benchmarks/qgemm_ab.py --baseline 2633bc9 --rows 1 4 8 --head

Both versions (tokenfab/kernels/csrc/*.c, or the one cpu.c of a revision from before the split) are compiled
with the flags the engine uses for this CPU's best ISA variant and loaded side by side (ctypes, RTLD_LOCAL).
Each pass calls tf_qgemm on 30 layers' worth of the bundled model's int4 g32 decoder shapes (random weights,
61 MB of int4 blocks and float32 scales: streamed from memory, as a decode step streams them), plus the Q8_0
LM head with --head. Passes alternate between the two libraries (ABAB, then BABA), --passes of each, so a
shared host's drift hits both alike; printed: each one's median and 10th-percentile pass, and baseline /
this tree (> 1: this tree is faster), with the CPU model and flags. The two builds' outputs are compared
first (largest difference relative to the output's largest magnitude).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenfab import kernels  # noqa: E402
from tokenfab.quant.linear import Int4Linear, Q8_0Linear  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]   # qkv, o, gate_up, down (out, in)
QGEMM_ARGS = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
              ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]


def baseline_sources(root: str, rev: str, out_dir: str) -> list[str]:
    """`rev`'s kernel sources written under out_dir: tokenfab/kernels/csrc's *.c and *.h, or the one cpu.c of a
    revision from before the split; returns the .c files."""
    def show(path: str) -> bytes:
        return subprocess.run(["git", "-C", root, "show", f"{rev}:{path}"], check=True, capture_output=True).stdout

    ls = subprocess.run(["git", "-C", root, "ls-tree", "--name-only", rev, "tokenfab/kernels/csrc/"],
                        capture_output=True, text=True)
    paths = [p for p in ls.stdout.split() if p.endswith((".c", ".h"))] if ls.returncode == 0 else []
    if not paths:
        paths = ["tokenfab/kernels/cpu.c"]
    for path in paths:
        with open(os.path.join(out_dir, os.path.basename(path)), "wb") as f:
            f.write(show(path))
    return sorted(os.path.join(out_dir, os.path.basename(p)) for p in paths if p.endswith(".c"))


def build(sources: list[str], out_dir: str, name: str) -> ctypes.CDLL:
    isa = kernels._wanted_isa()
    flags = kernels.FLAGS + (kernels.ISA_VARIANTS[isa][0] if isa in kernels.ISA_VARIANTS else ["-march=native"])
    path = os.path.join(out_dir, name + ".so")
    proc = subprocess.run([os.environ.get("CC", "gcc"), *flags, *sources, "-o", path, "-lm"], capture_output=True,
                          text=True)
    if proc.returncode:
        raise SystemExit(f"building {name} ({', '.join(sources)}) failed:\n{proc.stderr[-2000:]}")
    lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
    lib.tf_qgemm.argtypes, lib.tf_qgemm.restype = QGEMM_ARGS, None
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default="HEAD~1", help="git revision whose C kernels are the baseline")
    ap.add_argument("--rows", type=int, nargs="+", default=[1])
    ap.add_argument("--head", action="store_true", help="also the 49152x576 Q8_0 LM head in each pass")
    ap.add_argument("--passes", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as tmp:
        base_dir = os.path.join(tmp, "base")
        os.makedirs(base_dir)
        libs = [build(baseline_sources(root, args.baseline, base_dir), tmp, "base"),
                build(kernels.sources(), tmp, "tree")]
        flags = sorted(kernels.cpu_flags() & {"avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16"})
        print(f"{kernels._cpu_model().strip()} ({' '.join(flags)}); {kernels._wanted_isa()} build; "
              f"{args.threads} thread(s); baseline {args.baseline} against this tree")
        g = torch.Generator().manual_seed(0)
        calls = []
        for _ in range(30):
            for n, k in SHAPES:
                calls.append((n, k) + Int4Linear.from_float(torch.randn(n, k, generator=g) * 0.05, None, 32).cpu_layout())
        if args.head:
            q = torch.randint(-127, 128, (49152, 576), generator=g, dtype=torch.int8)
            calls.append((49152, 576) + Q8_0Linear(q, torch.rand(49152, 18, generator=g) * 0.01).cpu_layout())
        for rows in args.rows:
            xs = {k: torch.randn(rows, k, generator=g) for k in {k for _, k in SHAPES}}
            ys = {n: torch.empty(rows, n) for n, *_ in calls}

            def run(lib):
                for n, k, q, d, m, gs, bits in calls:
                    lib.tf_qgemm(ys[n].data_ptr(), xs[k].data_ptr(), rows, k, n, q.data_ptr(), d.data_ptr(),
                                 None if m is None else m.data_ptr(), gs, bits)

            outs = []
            for lib in libs:
                run(lib)
                outs.append({n: y.clone() for n, y in ys.items()})
            diff = max(float((outs[0][n] - outs[1][n]).abs().max() / outs[0][n].abs().max()) for n in ys)
            times: list[list[float]] = [[], []]
            for i in range(args.passes):
                for j in ((0, 1) if i % 2 == 0 else (1, 0)):
                    t = time.perf_counter()
                    run(libs[j])
                    times[j].append(time.perf_counter() - t)
            med = [statistics.median(t) * 1e3 for t in times]
            p10 = [sorted(t)[len(t) // 10] * 1e3 for t in times]
            print(f"{rows} row(s), {len(calls)} calls a pass: baseline {med[0]:.3f} ms (p10 {p10[0]:.3f}), "
                  f"this tree {med[1]:.3f} ms (p10 {p10[1]:.3f}): {med[0] / med[1]:.2f}x; "
                  f"outputs differ by {diff:.1e} of their largest value", flush=True)


if __name__ == "__main__":
    main()
