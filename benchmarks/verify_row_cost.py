"""What a verification row costs: one sequence's decode step with M query rows (1 + M - 1 drafts) on
the one-call C decode stack, plus the LM head at all M rows, against M = 1. The speculative policy's
ROW_COST (tokenfab/engine/spec/policy.py) is (t(M) / t(1) - 1) / (M - 1).

    python benchmarks/verify_row_cost.py --num-threads 1
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenfab import LLM  # noqa: E402
from tokenfab.model.attention import AttentionMetadata  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-threads", type=int)
    ap.add_argument("--context", type=int, default=100, help="cached tokens before the rows (default 100)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    llm = LLM(max_model_len=1024, num_kv_blocks=64, num_threads=args.num_threads)
    model, kv, bs = llm.engine.model, llm.engine.runner.kv_caches, llm.engine.config.block_size
    table = list(range(-(-(args.context + 16) // bs)))

    def meta(m: int) -> AttentionMetadata:
        pos = list(range(args.context, args.context + m))
        return AttentionMetadata(
            slot_mapping=torch.tensor([table[p // bs] * bs + p % bs for p in pos]), num_decode_tokens=m,
            decode_block_tables=torch.tensor([table] * m), decode_context_lens=torch.tensor([p + 1 for p in pos]),
            decode_max_context=args.context + m, prefills=[], positions=torch.tensor(pos))

    times: dict[int, list[tuple[float, float]]] = {}
    for _ in range(3):                     # interleaved rounds: load from other processes hits every M alike
        for m in (1, 2, 3, 5, 8):
            md, x = meta(m), model.embed_tokens(torch.randint(0, 1000, (m,)))
            t = time.perf_counter()
            for _ in range(args.repeats):
                if not model.attention_backend.run_stack(model, x.clone(), kv, md):
                    sys.exit("the one-call decode stack does not run here (needs the cpu backend and qgemm plans)")
            stack = (time.perf_counter() - t) / args.repeats
            h = model.norm(x)
            t = time.perf_counter()
            for _ in range(args.repeats):
                model.lm_head(h)
            times.setdefault(m, []).append((stack * 1e3, (time.perf_counter() - t) / args.repeats * 1e3))
    med = {m: (sorted(a for a, _ in v)[1], sorted(b for _, b in v)[1]) for m, v in times.items()}
    base = sum(med[1])
    for m, (s, h) in med.items():
        cost = f"  row cost {(s + h) / base - 1:.2f} / (M - 1) = {((s + h) / base - 1) / (m - 1):.2f}" if m > 1 else ""
        print(f"M={m}: decoder stack {s:6.1f} ms  LM head {h:5.1f} ms  total {s + h:6.1f} ms  "
              f"x{(s + h) / base:.2f}{cost}")


if __name__ == "__main__":
    main()
