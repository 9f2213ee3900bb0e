"""What the attention precision options cost in quality, on the bundled model: KL against the float model.

Builds the default engine (native GGUF blocks, the measured kernel table: on a CPU with bf16 units the
qkv projection runs the lossy bf16 kernel from 9 rows) and runs --windows windows of --tokens tokens of
the held-out text as one prefill each: with the cpu backend's prefill attention in float32, in bfloat16
(prefill_attention_dtype), and in float32 over float16 KV pools (kv_cache_dtype="float16": a prefill
attends to the rounded K/V it stores, as every later decode reads them). Each is compared with the
float (dequantized, float32 everywhere) model. Prints mean KL, top-1 agreement and perplexity for each,
and how long the prefills took.

    python benchmarks/attention_kl.py                  # 4 windows of 512 tokens
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenfab import LLM  # noqa: E402
from tokenfab.model.llama import full_logits  # noqa: E402
from tokenfab.model.loader import load_model_files  # noqa: E402
from tokenfab.quant.eval import compare_logits, next_token_targets  # noqa: E402
from tokenfab.quant.export import build_float_model  # noqa: E402
from tokenfab.quant.text import split_eval_calib, text_token_ids, token_windows  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--windows", type=int, default=4)
    args = ap.parse_args()
    files = load_model_files(None)
    windows = token_windows(split_eval_calib(text_token_ids(files.tokenizer))[0], args.tokens, args.windows)
    ref_model = build_float_model(files, args.tokens + 1, "none")
    refs = [full_logits(ref_model, w) for w in windows]
    del ref_model
    llm = LLM(loaded=files, max_model_len=args.tokens + 64)
    model = llm.engine.model
    paged = model.attention_backend.cpu_paged
    print(f"attention backend: {model.attention_backend.describe()}")
    full_logits(model, windows[0])          # warm-up: first-call allocations and oneDNN primitives
    for name, rows, kv in (("float32", None, None), ("bfloat16", 1, None), ("f32, f16 KV", None, torch.float16)):
        paged.bf16_rows = rows
        logits, t = [], time.perf_counter()
        for w in windows:
            logits.append(full_logits(model, w, kv_dtype=kv))
        dt = (time.perf_counter() - t) / len(windows)
        rs, targets = zip(*(next_token_targets(torch.tensor(w)) for w in windows))
        r = compare_logits(torch.cat([b[s] for b, s in zip(refs, rs)]), torch.cat([c[s] for c, s in zip(logits, rs)]),
                           torch.cat(targets))
        print(f"attention {name:>11}: KL vs float {r.kl_mean:.2e}, top-1 same {r.same_top1_pct:.2f} %, "
              f"{dt * 1e3:.0f} ms per {args.tokens}-token prefill  ({r})")


if __name__ == "__main__":
    main()
