"""Per-step cost of structured output: N concurrent JSON-schema-constrained streams against N
unconstrained ones, on the same engine, runs interleaved (free, constrained, constrained with the mask
computed in a thread during the forward pass), repeated for several rounds.

    python benchmarks/structured_output.py                 # 8 streams, 64 tokens, 3 rounds, bundled model
    python benchmarks/structured_output.py --streams 8 --tokens 64 --rounds 3 --threads 2

Prints the median decode-step time (steps where all N streams decode) of each mode, the ratio to
unconstrained, and where the extra time goes (filling the masks, applying them in the sampler).
Timings on a shared machine are noisy: compare the ratios of one run, not absolute numbers.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import tokenfab.engine.sampler as sampler_mod
from tokenfab import LLM, SamplingParams
from tokenfab.structured_output import StructuredOutputParams

# A long array of objects: no stream can finish it within --tokens, so every step has N streams.
SCHEMA = {"type": "array", "minItems": 40, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 99},
                   "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}}}}


class Timer:
    def __init__(self) -> None:
        self.total = 0.0
        self.calls = 0

    def wrap(self, fn):
        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.total += time.perf_counter() - t
                self.calls += 1
        return timed


def run(llm: LLM, prompt: list[int], streams: int, tokens: int, constrained: bool, overlap: bool) -> dict:
    eng = llm.engine
    eng.structured.overlap = overlap
    spec = StructuredOutputParams(json=SCHEMA) if constrained else None
    steps: list[float] = []

    def observe(shapes, start, end, busy):
        if len(shapes) == streams and all(n == 1 for _, n in shapes):
            steps.append(end - start)

    fill, apply, fwd, smp = Timer(), Timer(), Timer(), Timer()
    masks, apply_fn = eng.structured.masks, sampler_mod.apply_token_bitmask
    execute, sampler = eng.runner.execute, eng.sampler
    eng.structured.masks = fill.wrap(masks)
    sampler_mod.apply_token_bitmask = apply.wrap(apply_fn)
    eng.runner.execute, eng.sampler = fwd.wrap(execute), smp.wrap(sampler)
    eng.step_observer = observe
    try:
        for i in range(streams):
            eng.add_request(f"b{i}", prompt, SamplingParams(max_tokens=tokens, temperature=1.0, seed=i,
                                                            ignore_eos=not constrained, structured_output=spec))
        while eng.has_unfinished_requests():
            eng.step()
    finally:
        eng.step_observer = None
        eng.structured.masks = masks
        eng.runner.execute, eng.sampler = execute, sampler
        sampler_mod.apply_token_bitmask = apply_fn
        eng.structured.overlap = False
    n = max(len(steps), 1)
    return {"step_ms": [s * 1e3 for s in steps], "fill_ms": fill.total / max(fill.calls, 1) * 1e3,
            "apply_ms": apply.total / max(apply.calls, 1) * 1e3, "n": n,
            "forward_ms": fwd.total / max(fwd.calls, 1) * 1e3, "sampler_ms": smp.total / max(smp.calls, 1) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2-135M GGUF)")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model, max_model_len=1024, num_kv_blocks=max(64, args.streams * 16))
    prompt = llm.apply_chat_template([{"role": "user", "content": "List people as JSON: name, age and tags."}])
    modes = {"unconstrained": (False, False), "json schema": (True, False), "json schema, overlapped masks": (True, True)}
    run(llm, prompt, args.streams, 8, True, False)          # warm-up: compile the grammar, touch the caches
    results = {m: [] for m in modes}
    fills = {m: [] for m in modes}
    applies = {m: [] for m in modes}
    fwds = {m: [] for m in modes}
    smps = {m: [] for m in modes}
    for _ in range(args.rounds):
        for m, (constrained, overlap) in modes.items():
            r = run(llm, prompt, args.streams, args.tokens, constrained, overlap)
            results[m] += r["step_ms"]
            fills[m].append(r["fill_ms"])
            applies[m].append(r["apply_ms"])
            fwds[m].append(r["forward_ms"])
            smps[m].append(r["sampler_ms"])
    base = statistics.median(results["unconstrained"])
    print(f"{args.streams} streams x {args.tokens} tokens, {args.rounds} rounds, torch threads {torch.get_num_threads()}")
    print("mask fill: in the step's thread (overlapped: only the hand-off); forward / sampler: mean per step")
    print(f"{'mode':34} {'median step ms':>15} {'ratio':>7} {'mask fill ms':>13} {'mask apply ms':>14} "
          f"{'forward ms':>11} {'sampler ms':>11} {'steps':>6}")
    for m in modes:
        med = statistics.median(results[m])
        fill = statistics.median(fills[m]) if m != "unconstrained" else 0.0
        apply = statistics.median(applies[m]) if m != "unconstrained" else 0.0
        print(f"{m:34} {med:15.2f} {med / base:7.3f} {fill:13.3f} {apply:14.3f} {statistics.median(fwds[m]):11.2f} "
              f"{statistics.median(smps[m]):11.2f} {len(results[m]):6d}")


if __name__ == "__main__":
    main()
