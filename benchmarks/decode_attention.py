"""Decode attention over the paged KV pools: tf_paged_decode_attention against the first kernel
(tf_decode_attention_window), in one process, on the bundled model's shapes (9 query heads, 3 kv heads,
head_dim 64, blocks of 16), with one pool per layer so the K/V come from memory as in a real step.

Prints ms per decode step (all layers) and the ratio, for each batch (rows) x context length, and the
same kernel on float16 pools (kv_cache_dtype="float16": half the bytes). With
--threads 1 the times are the thread's CPU time, which time spent descheduled by other processes on a
shared machine does not inflate (memory stalls still count); else wall time.

    python benchmarks/decode_attention.py                      # 1, 8, 32, 64 rows x 135, 256 tokens
    python benchmarks/decode_attention.py --rows 64 --ctx 192 --layers 30
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenfab import kernels  # noqa: E402


def step_ms(reference: bool, pools, q, tables, lens, H, KVH, D) -> float:
    """One decode step's attention: every layer's pool once."""
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    t = clock()
    for kc, vc in pools:
        kernels.decode_attention(q, kc, vc, tables, lens, H, KVH, D ** -0.5, reference=reference)
    return (clock() - t) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--ctx", type=int, nargs="+", default=[135, 256])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="OpenMP threads (default: torch's)")
    ap.add_argument("--best", action="store_true",
                    help="the fastest repeat instead of the median (on a shared machine, the one least disturbed)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not kernels.enabled():
        sys.exit("tokenfab's C kernels are not built here (no C compiler, or TOKENFAB_CPU_KERNELS=0)")
    H, KVH, D, bs = 9, 3, 64, 16
    print(f"C kernels: {kernels.describe()}; threads: {torch.get_num_threads()}")
    print(f"{'rows':>5} {'ctx':>5} {'MB/step':>8} {'first ms':>9} {'paged ms':>9} {'speed-up':>9} "
          f"{'f16 ms':>8} {'speed-up':>9}")
    torch.manual_seed(0)
    for B in args.rows:
        for ctx in args.ctx:
            per_seq = -(-ctx // bs)
            nblocks = B * per_seq + 1
            pools = [(torch.randn(nblocks, bs, KVH, D), torch.randn(nblocks, bs, KVH, D)) for _ in range(args.layers)]
            tables = torch.randperm(nblocks)[: B * per_seq].view(B, per_seq).contiguous()   # scattered blocks
            lens = torch.full((B,), ctx, dtype=torch.long)
            q = torch.randn(B, (H + 2 * KVH) * D)[:, : H * D]      # q inside fused qkv rows, as in the model
            ref = kernels.decode_attention(q, *pools[0], tables, lens, H, KVH, D ** -0.5, reference=True)
            new = kernels.decode_attention(q, *pools[0], tables, lens, H, KVH, D ** -0.5)
            torch.testing.assert_close(new, ref, rtol=1e-5, atol=1e-5)
            half = [(k.half(), v.half()) for k, v in pools]
            old, new, f16 = [], [], []
            for _ in range(args.repeats):       # interleaved, so all see the same background load
                old.append(step_ms(True, pools, q, tables, lens, H, KVH, D))
                new.append(step_ms(False, pools, q, tables, lens, H, KVH, D))
                f16.append(step_ms(False, half, q, tables, lens, H, KVH, D))
            pick = min if args.best else statistics.median
            old_ms, new_ms, f16_ms = pick(old), pick(new), pick(f16)
            mb = args.layers * B * ctx * KVH * D * 4 * 2 / 1e6
            print(f"{B:>5} {ctx:>5} {mb:>8.0f} {old_ms:>9.2f} {new_ms:>9.2f} {old_ms / new_ms:>8.2f}x "
                  f"{f16_ms:>8.2f} {old_ms / f16_ms:>8.2f}x")
            del pools, half


if __name__ == "__main__":
    main()
