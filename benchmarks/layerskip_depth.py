"""layerskip: how the draft depth L trades acceptance against drafting cost, on the bundled model.

For each L, greedy generation over copy-heavy and open-ended chat prompts with k fixed (no adaptive
policy), and the acceptance rate (accepted / drafted tokens) read from the engine's counters. The
cost of a draft token is about L / num_layers of a plain decode step, so layerskip pays only where
acceptance x (1 - L / num_layers) is large. Each L row also prints the same prompts decoded plainly
(SamplingParams(speculative=False), same engine, right after), and the ratio.

    python benchmarks/layerskip_depth.py --layers 6,12,18,24 --tokens 48
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from speculative import CHAT, COPY  # noqa: E402
from tokenfab import LLM, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="6,12,18,24")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    llm = LLM(max_model_len=2048, num_kv_blocks=512,
              speculative_config={"method": "layerskip", "num_speculative_tokens": args.k, "adaptive": False,
                                  "max_batch_size": 64})
    spec = llm.engine.spec
    total = llm.engine.model_config.num_layers
    params = SamplingParams(max_tokens=args.tokens, temperature=0)
    plain_params = SamplingParams(max_tokens=args.tokens, temperature=0, speculative=False)
    for L in [int(x) for x in args.layers.split(",")]:
        spec.proposer.num_layers = L
        for name, prompts in (("copy-heavy", COPY[:2]), ("open-ended", CHAT[:2])):
            s0 = llm.engine.stats()
            t = time.perf_counter()
            outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
            dt = time.perf_counter() - t
            s1 = llm.engine.stats()
            drafted = s1.spec_decode_num_draft_tokens - s0.spec_decode_num_draft_tokens
            acc = (s1.spec_decode_num_accepted_tokens - s0.spec_decode_num_accepted_tokens) / max(drafted, 1)
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            t = time.perf_counter()
            plain = llm.chat([[{"role": "user", "content": p}] for p in prompts], plain_params, use_tqdm=False)
            dt_plain = time.perf_counter() - t
            n_plain = sum(len(o.outputs[0].token_ids) for o in plain)
            print(f"L={L:2d}/{total}  {name:11s} acceptance {acc:.3f}  ({drafted} drafted, {n} tokens)  "
                  f"spec {n / dt:.1f} tok/s  plain {n_plain / dt_plain:.1f} tok/s  x{(n / dt) / (n_plain / dt_plain):.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
