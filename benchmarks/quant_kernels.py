"""Quantized-linear kernels against float32 F.linear, per shape and token count.

    python benchmarks/quant_kernels.py                 # the bundled model's shapes, 1/8/32 tokens
    python benchmarks/quant_kernels.py --threads 2 --tokens 1 8 32 128 --markdown

Prints, for each [out x in] shape and token count, the float32 time and each variant's speed as a
ratio to it (> 1: faster than float32). Variants: bf16 F.linear, and for int8 (per channel),
int4-g32 (also Q4_1, the same kernel) and Q8_0 both paths: `packed` (torch's int8/int4 CPU kernels,
bf16 activations) and `dequant` (expand the weight, then F.linear). The last columns say which of
the two quantized paths won, which is what tokenfab/kernels/tuning.py's default rules encode (the engine measures its own table).

Weights are streamed from memory as in a real decode step: each call uses the next of enough copies
of the layer to overflow the CPU's last-level cache (a 576x576 float32 layer, 1.3 MB, would
otherwise sit in cache and flatter float32). Times are the 25th percentile of single calls, which
is robust to other processes on a shared machine.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from tokenfab.quant.linear import Int4Linear, Int8Linear, Q8_0Linear

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]   # SmolLM2-135M: q/o, k/v, gate/up, down, lm_head
STREAM_BYTES = 128 << 20      # float32 bytes cycled per shape: 4x the 32 MB L3 of the dev machine


def time_calls(fns, seconds: float) -> float:
    for f in fns:           # every copy once: the first call of a layer builds its packed weights
        f()
    times, i = [], 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds or len(times) < 5:
        f = fns[i % len(fns)]
        i += 1
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 4]


def variants(out_f: int, in_f: int, copies: int, gen: torch.Generator):
    ws = [torch.randn(out_f, in_f, generator=gen) * 0.05 for _ in range(copies)]
    mods = {
        "int8": [Int8Linear.from_float(w) for w in ws],
        "int4-g32": [Int4Linear.from_float(w, group_size=32) for w in ws],
        "q8_0": [Q8_0Linear(torch.randint(-127, 128, (out_f, in_f), dtype=torch.int8, generator=gen),
                            torch.rand(out_f, in_f // 32, generator=gen) * 1e-3) for _ in ws],
    }
    return ws, [w.bfloat16() for w in ws], mods


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the dev box is shared)")
    ap.add_argument("--seconds", type=float, default=0.2, help="timing window per measurement")
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table (for docs/quant.md)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    layouts = ["int8", "int4-g32", "q8_0"]
    header = ["shape (out x in)", "tokens", "f32 µs", "bf16"] + [f"{l} {p}" for l in layouts for p in ("packed", "dequant")] \
        + [f"{l} best" for l in layouts]
    rows = []
    with torch.no_grad():
        for out_f, in_f in SHAPES:
            copies = max(1, STREAM_BYTES // (out_f * in_f * 4))
            ws, wbs, mods = variants(out_f, in_f, copies, gen)
            for t in args.tokens:
                x = torch.randn(t, in_f, generator=gen)
                xb = x.bfloat16()
                base = time_calls([lambda w=w: F.linear(x, w) for w in ws], args.seconds)
                row = [f"{out_f}x{in_f}", str(t), f"{base * 1e6:.0f}",
                       f"{base / time_calls([lambda w=w: F.linear(xb, w) for w in wbs], args.seconds):.2f}"]
                best = []
                for layout in layouts:
                    res = {}
                    for path in ("packed", "dequant"):
                        for m in mods[layout]:
                            m.kernel = path
                        res[path] = base / time_calls([lambda m=m: m(x) for m in mods[layout]], args.seconds)
                        row.append(f"{res[path]:.2f}")
                    best.append(max(res, key=res.get))
                rows.append(row + best)
                print(" ".join(row + best), file=sys.stderr, flush=True)
            del ws, wbs, mods
    cmd = "python benchmarks/quant_kernels.py " + " ".join(argv if argv is not None else sys.argv[1:])
    note = (f"ratio = float32 F.linear time / variant time (> 1 is faster); torch {torch.__version__}, "
            f"{args.threads} thread(s), {torch.backends.cpu.get_cpu_capability()}; command: {cmd.strip()}")
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for r in rows:
            print("| " + " | ".join(r) + " |")
        print(f"\n{note}")
    else:
        from rich.console import Console
        from rich.table import Table
        table = Table(title="quantized linear kernels vs float32 F.linear", caption=note)
        for h in header:
            table.add_column(h, justify="right")
        for r in rows:
            table.add_row(*r)
        Console().print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
