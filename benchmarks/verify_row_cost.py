"""What a verification row costs: one sequence's decode step with M query rows (1 + M - 1 drafts) on
the one-call C decode stack, plus the LM head at all M rows, against M = 1. The speculative policy's
ROW_COST (tokenfab/engine/spec/policy.py) is (t(M) / t(1) - 1) / (M - 1).

    OMP_NUM_THREADS=1 python benchmarks/verify_row_cost.py --num-threads 1

(OMP_NUM_THREADS=1: the C kernels' OpenMP pool may be another libgomp than torch's, and the default
--clock cpu counts the calling thread only.)
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tokenfab import LLM  # noqa: E402
from tokenfab.model.attention import AttentionMetadata  # noqa: E402
from speculative import exclude_kernels  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-threads", type=int)
    ap.add_argument("--context", type=int, default=100, help="cached tokens before the rows (default 100)")
    ap.add_argument("--repeats", type=int, default=5, help="calls per row count and round (default 5)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                    help="cpu: this thread's CPU time (default; needs --num-threads 1 to see all the work), wall: elapsed")
    ap.add_argument("--rounds", type=int, default=6, help="rounds over the row counts; minimum per call kept (default 6)")
    ap.add_argument("--exclude-kernel", action="append", default=[], metavar="NAME",
                    help="linear kernels the table may not choose in this process (e.g. qtile: the run before it)")
    ap.add_argument("--linear-kernel", default="auto",
                    help="force one linear kernel (e.g. qgemm, qtile) to compare; default: the measured table's choice")
    args = ap.parse_args()
    exclude_kernels(args.exclude_kernel)
    if args.clock == "cpu" and args.num_threads != 1:
        sys.exit("--clock cpu counts this thread only: add --num-threads 1 (or use --clock wall)")
    llm = LLM(max_model_len=1024, num_kv_blocks=64, num_threads=args.num_threads, linear_kernel=args.linear_kernel)
    model, kv, bs = llm.engine.model, llm.engine.runner.kv_caches, llm.engine.config.block_size
    table = list(range(-(-(args.context + 16) // bs)))

    def meta(m: int) -> AttentionMetadata:
        pos = list(range(args.context, args.context + m))
        return AttentionMetadata(
            slot_mapping=torch.tensor([table[p // bs] * bs + p % bs for p in pos]), num_decode_tokens=m,
            decode_block_tables=torch.tensor([table] * m), decode_context_lens=torch.tensor([p + 1 for p in pos]),
            decode_max_context=args.context + m, prefills=[], positions=torch.tensor(pos))

    # Each call timed on its own, the minimum kept, and by default in CPU time of this thread (with
    # --num-threads 1 the kernels run on it): on the shared 2-core machine (load average 10-16) a
    # 15 ms call is always preempted, so wall-clock minima read 125 ms for a 15 ms stack and medians
    # of averages moved 3x between runs. CPU time still carries cache and memory contention from
    # the other processes. Rounds interleave the row counts, so load hits each alike.
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    best: dict[int, list[float]] = {}
    for _ in range(args.rounds):
        for m in (1, 2, 3, 5, 8):
            md, x = meta(m), model.embed_tokens(torch.randint(0, 1000, (m,)))
            h = model.norm(x)
            b = best.setdefault(m, [float("inf")] * 2)
            for _ in range(args.repeats):
                xs = x.clone()
                t = clock()
                if not model.attention_backend.run_stack(model, xs, kv, md):
                    sys.exit("the one-call decode stack does not run here (needs the cpu backend and qgemm plans)")
                t1 = clock()
                model.lm_head(h)
                t2 = clock()
                b[0], b[1] = min(b[0], (t1 - t) * 1e3), min(b[1], (t2 - t1) * 1e3)
    med = {m: tuple(v) for m, v in best.items()}
    plan = model.layers[0].mlp.gate_up_proj.plan
    print(f"kernels: decoder {plan.names() if plan else None}, head {model.lm_head.plan.names() if getattr(model.lm_head, 'plan', None) else None}")
    base = sum(med[1])
    for m, (s, h) in med.items():
        cost = f"  row cost {(s + h) / base - 1:.2f} / (M - 1) = {((s + h) / base - 1) / (m - 1):.2f}" if m > 1 else ""
        print(f"M={m}: decoder stack {s:6.1f} ms  LM head {h:5.1f} ms  total {s + h:6.1f} ms  "
              f"x{(s + h) / base:.2f}{cost}")


if __name__ == "__main__":
    main()
