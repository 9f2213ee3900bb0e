"""What scoring a prompt costs: prefill with prompt logprobs (max_tokens 0) against a plain prefill
that samples one token (max_tokens 1), on the bundled model, in one process, alternating runs.

    python3 benchmarks/prompt_logprobs.py [--prompts 8] [--prompt-len 256] [--repeats 3]

Prints the seconds per run of each and their ratio. The extra work is the LM head (and a log-softmax
and top-k) at every prompt position instead of only the last. Prefix caching is off, so both
compute every prompt token.
"""
from __future__ import annotations

import argparse
import statistics
import time

from tokenfab import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--top", type=int, default=1, help="prompt_logprobs=N (default: 1, as lm-eval asks)")
    args = ap.parse_args()

    llm = LLM(enable_prefix_caching=False, max_model_len=args.prompt_len + 16)
    prompts = [[(17 + 31 * i + 7 * j) % 40000 + 100 for j in range(args.prompt_len)] for i in range(args.prompts)]
    plain = SamplingParams(max_tokens=1, temperature=0)
    scored = SamplingParams(max_tokens=0, prompt_logprobs=args.top)
    llm.generate(prompts[:1], plain, use_tqdm=False)          # warm-up (kernels, caches)
    times: dict[str, list[float]] = {"plain prefill + 1 token": [], f"prompt_logprobs={args.top}, max_tokens=0": []}
    for _ in range(args.repeats):
        for (name, params) in zip(times, (plain, scored)):
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            times[name].append(time.perf_counter() - t0)
    base, other = (statistics.median(v) for v in times.values())
    for name, v in times.items():
        print(f"{name:36s} median {statistics.median(v):.3f} s  ({', '.join(f'{x:.3f}' for x in v)})")
    print(f"ratio (scored / plain): {other / base:.2f}x   [{args.prompts} prompts x {args.prompt_len} tokens]")


if __name__ == "__main__":
    main()
