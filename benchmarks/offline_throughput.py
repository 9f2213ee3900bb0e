"""Offline throughput: tokenfab against transformers `generate`, in one process, on the bundled model.

Prints ratios against the baseline measured in the same run:
  1. single-stream decode tok/s (one prompt, --tokens new tokens);
  2. output tok/s for --batch prompts x --tokens new tokens;
  3. prefix caching: time to first token with and without a --prefix-tokens shared prefix.

    python benchmarks/offline_throughput.py                     # everything, float32 and the default path
    python benchmarks/offline_throughput.py --skip-hf           # tokenfab only
    python benchmarks/offline_throughput.py --quantization int8 # another tokenfab weight path
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenfab import LLM, SamplingParams  # noqa: E402
from tokenfab.files.bundled import bundled_model_path  # noqa: E402
from tokenfab.model.loader import load_model_files  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def batch_prompts(n: int) -> list[str]:
    topics = ["the sea", "a robot", "the moon", "a library", "winter", "a violin", "trains", "bees"]
    return [f"Write a detailed essay about {topics[i % len(topics)]} and why it matters, part {i}." for i in range(n)]


def hf_model():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    path = bundled_model_path()
    d, f = os.path.dirname(path), os.path.basename(path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    return model, tok


def hf_generate(model, tok, prompts: list[str], new_tokens: int) -> tuple[float, int]:
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok(prompts, return_tensors="pt", padding=True)
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    dt = time.perf_counter() - t
    return dt, (out.shape[1] - enc.input_ids.shape[1]) * len(prompts)


def tf_generate(llm: LLM, prompts, new_tokens: int) -> tuple[float, int]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    return dt, sum(len(o.outputs[0].token_ids) for o in outs)


def decode_rate(gen, *args, new_tokens: int) -> float:
    """Decode tok/s with the prefill (and first token) taken out: time(N) - time(1) over N - 1 tokens."""
    t1, _ = gen(*args, 1)
    tn, n = gen(*args, new_tokens)
    return (new_tokens - 1) / max(tn - t1, 1e-9)


def ttft(llm: LLM, prompt_ids: list[int]) -> float:
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    llm.generate([prompt_ids], params, use_tqdm=False)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default="auto", help="auto (GGUF blocks native) | none (float) | gguf | int8 | int4")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()

    res: dict[str, float] = {}
    files = load_model_files(None)
    llm = LLM(loaded=files, dtype=args.dtype, quantization=args.quantization, max_model_len=4096,
              max_num_seqs=max(64, args.batch))
    tf_generate(llm, [PROMPT], 8)  # warm-up
    res["tokenfab_single_tok_s"] = statistics.median(
        decode_rate(tf_generate, llm, [PROMPT], new_tokens=args.tokens) for _ in range(args.repeats))
    dt, n = tf_generate(llm, batch_prompts(args.batch), args.tokens)
    res["tokenfab_batch_tok_s"] = n / dt

    # Prefix caching: the same 1,000-token prefix with a fresh suffix each time, cache on vs off.
    tok = llm.get_tokenizer()
    words = ("The committee reviewed the quarterly reports on energy, transport and housing in detail. " * 200)
    prefix = tok(words).input_ids[: args.prefix_tokens]
    suffixes = [tok(f" Question {i}: summarise item {i}.").input_ids for i in range(args.repeats + 1)]
    ttft(llm, prefix + suffixes[0])  # fills the cache
    res["ttft_prefix_cached_s"] = statistics.median(ttft(llm, prefix + s) for s in suffixes[1:])
    nocache = LLM(loaded=files, dtype=args.dtype, quantization=args.quantization, max_model_len=4096,
                  enable_prefix_caching=False)
    res["ttft_prefix_uncached_s"] = statistics.median(ttft(nocache, prefix + s) for s in suffixes[1:])
    del nocache, llm

    if not args.skip_hf:
        model, hftok = hf_model()
        hf_generate(model, hftok, [PROMPT], 4)  # warm-up
        res["hf_single_tok_s"] = statistics.median(
            decode_rate(hf_generate, model, hftok, [PROMPT], new_tokens=args.tokens) for _ in range(args.repeats))
        dt, n = hf_generate(model, hftok, batch_prompts(args.batch), args.tokens)
        res["hf_batch_tok_s"] = n / dt

    label = f"tokenfab ({args.dtype}, quantization={args.quantization})"
    print(f"\ncommand: python benchmarks/offline_throughput.py {' '.join(sys.argv[1:])}")
    print(f"threads: {torch.get_num_threads()}")
    print(f"{label} single-stream decode: {res['tokenfab_single_tok_s']:.1f} tok/s")
    print(f"{label} {args.batch} prompts x {args.tokens} tokens: {res['tokenfab_batch_tok_s']:.1f} output tok/s")
    if "hf_single_tok_s" in res:
        print(f"transformers single-stream decode: {res['hf_single_tok_s']:.1f} tok/s  -> ratio "
              f"{res['tokenfab_single_tok_s'] / res['hf_single_tok_s']:.2f}x")
        print(f"transformers {args.batch} prompts: {res['hf_batch_tok_s']:.1f} output tok/s  -> ratio "
              f"{res['tokenfab_batch_tok_s'] / res['hf_batch_tok_s']:.2f}x")
    print(f"TTFT with a {args.prefix_tokens}-token shared prefix: cached {res['ttft_prefix_cached_s'] * 1e3:.0f} ms, "
          f"uncached {res['ttft_prefix_uncached_s'] * 1e3:.0f} ms -> "
          f"{res['ttft_prefix_uncached_s'] / res['ttft_prefix_cached_s']:.1f}x faster with the cache")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
