"""One mixture-of-experts layer (model/moe.py) with Q4_K experts as stored, grouped per step against the same
experts run token by token (each token's k experts on its one row: every expert's weights read once per token
that picked it). OLMoE-1B-7B's shape by default (hidden 2048, 64 experts of width 1024, 8 per token); random
weights and a random router, so routing is near uniform. Prints ms per step, the ratio, and the bandwidth the
grouped step reaches on the experts it reads (distinct experts touched x bytes per expert / time).

    python benchmarks/moe_layer.py [--threads 1] [--experts 64] [--top-k 8] [--hidden 2048] [--width 1024]
                                   [--measured]

--measured: each expert projection's kernel per row count from a kernel table measured now (as the engine's
load does, kernels/select.py; kept in memory, the machine's cached table is not touched), instead of the
default rules.
"""
import argparse
import time

import numpy as np
import torch

from tokenfab.model.config import ModelConfig
from tokenfab.model.llama import MLP
from tokenfab.model.moe import MoE, route
from tokenfab.quant.kquants import quantize_q4_k
from tokenfab.quant.linear import gguf_linear


def build(experts: int, k: int, hidden: int, width: int) -> MoE:
    cfg = ModelConfig(arch="olmoe", vocab_size=8, hidden_size=hidden, intermediate_size=width, num_layers=1,
                      num_heads=16, num_kv_heads=16, head_dim=hidden // 16)
    cfg.set_experts(experts, k, width, normalize=False)
    with torch.device("meta"):
        moe = MoE(cfg, lambda: MLP(cfg, width))
    rng = np.random.default_rng(0)
    gate_up = quantize_q4_k((rng.standard_normal((2 * width, hidden)) * 0.02).astype(np.float32))
    down = quantize_q4_k((rng.standard_normal((hidden, width)) * 0.02).astype(np.float32))
    for m in moe.experts:       # each expert its own copy of the blocks, so each is read from its own memory
        m.gate_up_proj = gguf_linear(gate_up.copy(), "Q4_K", 2 * width, hidden, as_stored=True)
        m.down_proj = gguf_linear(down.copy(), "Q4_K", hidden, width, as_stored=True)
    moe.router = torch.nn.Parameter(torch.randn(experts, hidden), requires_grad=False)
    return moe


def token_by_token(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    weights, experts = route(torch.nn.functional.linear(x, moe.router), moe.top_k, moe.normalize)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), experts[t].tolist()):
            out[t] += w * moe.experts[e](x[t:t + 1])[0]
    return out


def best_of(f, reps: int) -> float:
    f()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            f()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--measured", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    moe = build(a.experts, a.top_k, a.hidden, a.width)
    if a.measured:
        from tokenfab.kernels.select import select_kernels
        from tokenfab.kernels.tuning import KernelTable
        report = select_kernels(moe, max_rows=128, head_max_rows=1, table=KernelTable({}, None))
        print("measured plans:", "; ".join(f"{k}: {v} (measured in {report.measured_s:.0f} s)" for k, v in report.plans.items()))
    expert_bytes = 3 * a.hidden * a.width * 144 // 256          # Q4_K: 144 bytes per 256 weights
    print(f"{a.experts} experts, {a.top_k} per token, hidden {a.hidden}, width {a.width}, Q4_K "
          f"({expert_bytes / 2**20:.1f} MiB per expert), {a.threads} thread(s), "
          f"{'measured plans' if a.measured else 'default plans'}")
    print(f"{'tokens':>6} {'experts read':>12} {'grouped ms':>10} {'token-by-token ms':>17} {'ratio':>6} {'GB/s':>6}")
    torch.manual_seed(0)
    for tokens in (1, 8, 32, 128):
        x = torch.randn(tokens, a.hidden)
        touched = int(route(torch.nn.functional.linear(x, moe.router), a.top_k, False)[1].unique().numel())
        reps = max(1, 64 // tokens)
        grouped = best_of(lambda: moe(x), reps)
        naive = best_of(lambda: token_by_token(moe, x), max(1, reps // 4))
        print(f"{tokens:>6} {touched:>12} {grouped * 1e3:>10.2f} {naive * 1e3:>17.2f} {naive / grouped:>5.2f}x "
              f"{touched * expert_bytes / grouped / 1e9:>6.1f}")


if __name__ == "__main__":
    main()
