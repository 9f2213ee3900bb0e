"""Single-stream decode under contention: tok/s with N busy processes beside the engine, divided by the
quiet figure measured in the same run, with the adaptive thread count on and off.

    python benchmarks/contention.py                 # 2 busy processes, 64 tokens, adaptive on and off
    python benchmarks/contention.py --busy 1 --tokens 128

The busy processes are plain Python loops (one core each), like the two `yes > /dev/null` of issue 12.
Measure llama.cpp the same way with its own server and these loops beside it. On a machine other people
share, the quiet figure is itself contended: say so with the numbers.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenfab import LLM, SamplingParams  # noqa: E402
from tokenfab.model.loader import load_model_files  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def _spin(stop) -> None:
    while not stop.is_set():
        for _ in range(100_000):
            pass


def tok_per_s(llm: LLM, tokens: int, repeats: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        out = llm.generate(PROMPT, params)[0]
        best = max(best, len(out.outputs[0].token_ids) / (time.perf_counter() - t))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--busy", type=int, default=2, help="busy processes beside the engine (default 2)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    files = load_model_files(args.model)
    print(f"cpu: {os.cpu_count()} cores, torch threads {torch.get_num_threads()}; busy processes: {args.busy}")
    rows = []
    for adaptive in (True, False):
        llm = LLM(loaded=files, max_model_len=512, max_num_seqs=4, adaptive_threads=adaptive)
        tok_per_s(llm, 8, 1)                                   # warm
        quiet = tok_per_s(llm, args.tokens, args.repeats)
        stop = mp.Event()
        procs = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(args.busy)]
        for p in procs:
            p.start()
        try:
            time.sleep(0.5)
            busy = tok_per_s(llm, args.tokens, args.repeats)
            threads = torch.get_num_threads()
        finally:
            stop.set()
            for p in procs:
                p.join(5)
        ctl = llm.engine.thread_controller
        rows.append((adaptive, quiet, busy, threads, ctl.reductions if ctl else 0))
        torch.set_num_threads(ctl.max_threads if ctl else torch.get_num_threads())
        del llm
    print(f"{'adaptive threads':>17} {'quiet tok/s':>12} {'busy tok/s':>11} {'busy/quiet':>11} {'threads':>8} {'lowered':>8}")
    for adaptive, quiet, busy, threads, red in rows:
        print(f"{'on' if adaptive else 'off':>17} {quiet:12.1f} {busy:11.1f} {busy / quiet:11.2f} {threads:8d} {red:8d}")
    print("command: python benchmarks/contention.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
