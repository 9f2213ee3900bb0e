"""The measured kernel table's row buckets: per-bucket kernel times, and end-to-end throughput with the
plans chosen from buckets up to 64 rows ("before": every bigger step ran the 64-row choice) against
buckets up to 512 (now), in one process on the bundled model.

    python benchmarks/kernel_buckets.py                      # prefill 512 tokens, decode at 32 and 64 streams
    python benchmarks/kernel_buckets.py --rounds 3 --decode-tokens 32

Prints (1) the table's one-thread times per bucket for the model's shapes, (2) both plans, (3) prefill
tok/s (a 512-token prompt, one output token) and decode output tok/s (N prompts of 16 tokens, each
--decode-tokens new tokens) for each plan, measured in alternating rounds (so both share the machine's
noise), best round of each, and the ratio now / before. Where both plans agree the ratio is noise.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenfab import LLM, SamplingParams  # noqa: E402
from tokenfab.kernels import linear as seam  # noqa: E402
from tokenfab.kernels.linear import plan_linears  # noqa: E402
from tokenfab.kernels.select import select_kernels  # noqa: E402
from tokenfab.kernels.tuning import KernelTable  # noqa: E402
from tokenfab.files.bundled import bundled_model_path  # noqa: E402


def replan(llm: LLM, tbl: KernelTable, buckets: tuple[int, ...]) -> dict[str, str]:
    """Install the plans the table gives with these row buckets (the engine's own arguments)."""
    eng, model = llm.engine, llm.engine.model
    saved = seam.ROW_BUCKETS
    seam.ROW_BUCKETS = buckets
    try:
        report = select_kernels(model, max_rows=eng.config.max_num_batched_tokens,
                                head_max_rows=eng.config.max_num_seqs, head=model.lm_head, autotune=False,
                                table=tbl, float_copy_budget=8 << 30, dtype=eng.dtype,
                                stack_rows=eng.config.fused_decode_max_tokens if eng.config.enable_fused_decode else 0)
    finally:
        seam.ROW_BUCKETS = saved
    return report.plans


def install(llm: LLM, plans: list) -> None:
    """Swap in a set of plans built before (building them prepares every weight copy: slow)."""
    for m, plan in zip(plan_linears(llm.engine.model), plans):
        m.plan = plan
    backend = llm.engine.model.attention_backend
    if hasattr(backend, "_stack"):
        backend._stack = None            # the one-call decode stack is rebuilt from the plans


def prefill_tok_s(llm: LLM, n: int) -> float:
    ids = [1000 + (i * 37) % 40000 for i in range(n)]
    t = time.perf_counter()
    llm.generate([ids], SamplingParams(max_tokens=1, temperature=0))
    return n / (time.perf_counter() - t)


def decode_tok_s(llm: LLM, streams: int, tokens: int) -> float:
    prompts = [[2000 + s * 16 + i for i in range(16)] for s in range(streams)]
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--streams", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--decode-tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    llm = LLM(model=bundled_model_path(), max_model_len=2048, enable_prefix_caching=False)
    tbl = KernelTable.load(llm.engine.kernel_report.table_path)
    print(f"threads {torch.get_num_threads()}, table {tbl.path}")
    print("\none-thread us per call by row bucket (the measured table):")
    for key in llm.engine.kernel_report.plans:
        e = tbl.entries.get(key)
        if e is None:
            continue
        print(f"  {key}: rows {e['rows']}")
        for name, ts in e["times"].items():
            print(f"    {name:8s}" + " ".join(f"{'-' if t is None else round(t * 1e6):>6}" for t in ts))

    before = tuple(b for b in seam.ROW_BUCKETS if b <= 64)
    plans = {}
    for label, buckets in {"before": before, "now": seam.ROW_BUCKETS}.items():
        print(f"\nplan {label} (buckets {buckets[0]}..{buckets[-1]}):", flush=True)
        for key, desc in replan(llm, tbl, buckets).items():
            print(f"  {key}: {desc}", flush=True)
        plans[label] = [m.plan for m in plan_linears(llm.engine.model)]

    results: dict[str, dict[str, float]] = {label: {} for label in plans}
    for _ in range(args.rounds):
        for label, plan_set in plans.items():
            install(llm, plan_set)
            prefill_tok_s(llm, 64)                                       # warm the new plans
            r = results[label]
            r["prefill"] = max(r.get("prefill", 0.0), prefill_tok_s(llm, args.prefill_tokens))
            for s in args.streams:
                r[f"{s} streams"] = max(r.get(f"{s} streams", 0.0), decode_tok_s(llm, s, args.decode_tokens))
            print(f"  round: {label} {', '.join(f'{k} {v:.1f}' for k, v in r.items())}", file=sys.stderr, flush=True)
    print(f"\nbest of {args.rounds} alternating rounds (tok/s; prefill: prompt tokens, decode: output tokens):")
    print(f"  {'':12s}{'before':>10s}{'now':>10s}{'now/before':>12s}")
    for k in results["now"]:
        b, n = results["before"][k], results["now"][k]
        print(f"  {k:12s}{b:10.1f}{n:10.1f}{n / b:12.2f}")


if __name__ == "__main__":
    main()
