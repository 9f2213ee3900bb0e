"""Speculative decoding against plain decoding, in one process, on the bundled model.

Two workloads through the chat template, greedy (so both engines emit the same tokens):
- copy-heavy: rewrite a given passage, edit given code (the output repeats the input);
- open-ended chat: stories and explanations (little to copy).
Single stream (one request at a time) and --streams requests at once. Plain and speculative runs are
interleaved request by request, so that load from other processes on shared cores hits both alike;
the ratios are the result, the absolute tok/s are not.

The plain baseline is, by default, the same engine with SamplingParams(speculative=False) (--baseline
optout): one copy of the weights, so both sides run the same memory. A second engine (--baseline
engine) measured 6-11 % slower decode steps than the first one built even with no speculation in
either (two plain engines, 8 streams, 1 thread: 173.5 vs 192.4 ms median, with the speculative engine
built between them at 188.7 ms), which is what the earlier "9 % slower plain steps" was.

    python benchmarks/speculative.py                                   # ngram, k=4
    python benchmarks/speculative.py --k 8 --tokens 128 --rounds 2
    python benchmarks/speculative.py --spec '{"method": "ngram", "num_speculative_tokens": 4, "max_batch_size": 64}'
    python benchmarks/speculative.py --batch-only --staggered --rounds 4    # a batch with a tail
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenfab import LLM, SamplingParams  # noqa: E402
from tokenfab.model.loader import load_model_files  # noqa: E402

PASSAGE = ("Decode on a small model is bound by one pass over the weights per token. Speculative decoding "
           "proposes several tokens cheaply and checks them in one forward pass, so a stream gains where "
           "the output repeats its input: summaries, code edits, answers grounded in retrieved text.")
CODE = ("def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs)\n\n"
        "def variance(xs):\n    m = mean(xs)\n    return sum((x - m) ** 2 for x in xs) / len(xs)\n")
COPY = [
    "Rewrite this passage exactly, word for word:\n\n" + PASSAGE,
    "Rename the function mean to average everywhere in this code and print the whole file:\n\n" + CODE,
    "Repeat the following text verbatim:\n\n" + PASSAGE,
    "Add type hints to this code and print the whole file:\n\n" + CODE,
]
CHAT = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten year old.",
    "Give me three ideas for a weekend trip in the mountains.",
    "What are the pros and cons of electric cars?",
]


def timed(llm: LLM, convs, params) -> tuple[float, int]:
    t = time.perf_counter()
    outs = llm.chat(convs, params, use_tqdm=False)
    return time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in outs)


def exclude_kernels(names: list[str]) -> None:
    """Make these registered linear kernels unsupported in this process, so the table chooses among the
    rest: the same engine as it ran before a kernel existed (e.g. --exclude-kernel qtile)."""
    import tokenfab.quant.kernels  # noqa: F401  (registers the quantized kernels)
    from tokenfab.kernels.linear import get
    from tokenfab.kernels.tuning import KernelTable
    for name in names:
        get(name).supports = lambda layer, name=name: f"excluded by --exclude-kernel {name}"
    if names:     # rows measured now lack those kernels: keep them out of the cached table
        KernelTable.save = lambda self: None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens (default 4)")
    ap.add_argument("--spec", help="a full speculative_config as JSON (overrides --k)")
    ap.add_argument("--tokens", type=int, default=64, help="max new tokens per request (default 64)")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per workload, single stream (default 2, max 4)")
    ap.add_argument("--batch-only", action="store_true", help="only the --streams case")
    ap.add_argument("--streams", type=int, default=8, help="concurrent requests in the batched case (default 8)")
    ap.add_argument("--staggered", action="store_true",
                    help="batched case: request i of N asks for tokens x (i + 1) / N tokens, so the batch shrinks one "
                         "sequence at a time and its second half runs with at most N / 2 sequences (a tail)")
    ap.add_argument("--rounds", type=int, default=1, help="passes over the prompts (default 1)")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--num-threads", type=int, help="torch threads (default: torch's choice)")
    ap.add_argument("--exclude-kernel", action="append", default=[], metavar="NAME",
                    help="linear kernels the table may not choose in this process (e.g. qtile: the run before it)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--baseline", choices=("optout", "engine"), default="optout",
                    help="plain = the speculative engine with speculative=False (default), or a second engine")
    args = ap.parse_args()
    exclude_kernels(args.exclude_kernel)

    spec_cfg = json.loads(args.spec) if args.spec else {"method": "ngram", "num_speculative_tokens": args.k}
    files = load_model_files(None)
    # No prefix caching: both sides run the same prompts, and with one engine the second side's prompts
    # would be cache hits (a free prefill) that the first side paid for.
    common = dict(loaded=files, quantization=args.quantization, max_model_len=2048, num_kv_blocks=1024,
                  num_threads=args.num_threads, enable_prefix_caching=False)
    spec = LLM(speculative_config=spec_cfg, **common)
    plain = LLM(**common) if args.baseline == "engine" else spec
    params = SamplingParams(max_tokens=args.tokens, temperature=0)
    plain_params = SamplingParams(max_tokens=args.tokens, temperature=0, speculative=False)
    for llm in (plain, spec):               # warm up both (kernels, allocator)
        timed(llm, [[{"role": "user", "content": COPY[0]}]], SamplingParams(max_tokens=8, temperature=0))
    # Step durations by kind: a pure decode step (one token per sequence) against a step that
    # verifies drafts (the per-layer path with k + 1 rows per speculating sequence).
    step_ms: dict[tuple, list[float]] = {}

    running = ["plain"]                                  # which side the current run measures

    def see(shapes, start, end, busy):
        if all(c > 0 for c, _ in shapes):            # decodes only (no prefill chunk of a new prompt)
            kind = "verify" if any(n > 1 for _, n in shapes) else "decode"
            step_ms.setdefault((running[0], len(shapes), kind), []).append((end - start) * 1e3)

    plain.engine.step_observer = spec.engine.step_observer = see

    results = []
    order = [1]
    for workload, prompts in (("copy-heavy", COPY), ("open-ended", CHAT)):
        convs = [[{"role": "user", "content": p}] for p in prompts]
        for streams in ((args.streams,) if args.batch_only else (1, args.streams)):
            t = {"plain": 0.0, "spec": 0.0}
            n = {"plain": 0, "spec": 0}
            if streams == 1:
                groups = [[c] for c in convs[:args.prompts]]
            else:                            # `streams` requests at once, cycling through the prompts
                groups = [[convs[i % len(convs)] for i in range(streams)]]
                # Untimed first: a batch's first run touches KV blocks and buffers no run touched before
                # (page faults, allocator growth); timed, that cost fell on whichever side ran first
                # (8 streams: 0.95-0.98x with speculation off on both sides, the same code path).
                for llm in {id(x): x for x in (plain, spec)}.values():
                    timed(llm, groups[0], plain_params)
            s0 = spec.engine.stats()
            pair_ratios = []                 # plain time / spec time of each back-to-back pair
            for _ in range(args.rounds):
                for g in groups:
                    order[0] ^= 1                    # alternate who goes first: load drifts over time
                    pair = (("plain", plain, plain_params), ("spec", spec, params))
                    dts = {}
                    for name, llm, p in pair[::-1] if order[0] else pair:
                        running[0] = name
                        if streams > 1 and args.staggered:
                            p = [dataclasses.replace(p, max_tokens=max(1, args.tokens * (i + 1) // streams))
                                 for i in range(len(g))]
                        dt, toks = timed(llm, g, p)
                        t[name] += dt
                        n[name] += toks
                        dts[name] = dt
                    pair_ratios.append(dts["plain"] / dts["spec"])
            s1 = spec.engine.stats()
            drafted = s1.spec_decode_num_draft_tokens - s0.spec_decode_num_draft_tokens
            accepted = s1.spec_decode_num_accepted_tokens - s0.spec_decode_num_accepted_tokens
            rounds = s1.spec_decode_num_drafts - s0.spec_decode_num_drafts
            row = dict(workload=workload, streams=streams, plain_tok_s=n["plain"] / t["plain"],
                       spec_tok_s=n["spec"] / t["spec"], tokens=n["spec"],
                       acceptance=accepted / drafted if drafted else None,
                       mean_accepted_len=1 + accepted / rounds if rounds else None, rounds=rounds)
            row["speedup"] = row["spec_tok_s"] / row["plain_tok_s"]
            # One pair hit by another process's burst moves the totals; the median pair does not notice.
            row["median_pair_speedup"] = sorted(pair_ratios)[len(pair_ratios) // 2]
            results.append(row)
            acc = f"{row['acceptance']:.2f}" if row["acceptance"] is not None else "-"
            mal = f"{row['mean_accepted_len']:.2f}" if row["mean_accepted_len"] is not None else "-"
            print(f"{workload:11s} streams={streams:2d}  plain {row['plain_tok_s']:6.1f} tok/s  "
                  f"spec {row['spec_tok_s']:6.1f} tok/s  x{row['speedup']:.2f} (median pair x{row['median_pair_speedup']:.2f})  acceptance {acc}  "
                  f"mean accepted length {mal}  ({n['spec']} tokens, {rounds} verification rounds)", flush=True)
    print("median step time (ms) by engine, sequences in the step, kind:")
    for key in sorted(step_ms):
        v = sorted(step_ms[key])
        print(f"  {key[0]:5s} {key[1]:2d} seqs {key[2]:6s}  {v[len(v) // 2]:7.1f} ms  ({len(v)} steps)")
    pol = spec.engine.spec.policy
    print("policy's draft-row cost c(n) (measured; prior " + f"{pol.prior_cost:.2f}): " +
          "  ".join(f"n={k}: {pol.cost(k):.3f}" for k in (1, 2, 4)) + f"  engine-wide acceptance {pol.rate:.2f}")
    print(f"speculative_config={json.dumps(spec_cfg)}  quantization={args.quantization}  "
          f"max_tokens={args.tokens}  rounds={args.rounds}  baseline={args.baseline}  staggered={args.staggered}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"speculative_config": spec_cfg, "results": results,
                   "step_ms": {f"{k[0]} {k[1]} {k[2]}": sorted(v)[len(v) // 2] for k, v in step_ms.items()}}, f, indent=2)


if __name__ == "__main__":
    main()
