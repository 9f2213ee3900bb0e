"""Single-stream decode under contention: tok/s with N busy processes beside the engine, divided by the
quiet figure measured in the same run, with the adaptive thread count on and off.

    python benchmarks/contention.py                 # 2 busy processes, 256 tokens, adaptive on and off
    python benchmarks/contention.py --busy 1 --tokens 128
    python benchmarks/contention.py --url http://127.0.0.1:8080   # any OpenAI-compatible server, e.g. llama-server
    python benchmarks/contention.py --against-fixed 4 --rounds 6  # the controller against 4 fixed threads

It also prints the fair-share ceiling for thread counts up to the cores: with B busy processes and T
engine threads on C cores, a fair scheduler gives each runnable thread at most C/(B+T) of a core, so no
such count can beat max over T of (quiet tok/s at T threads) x min(1, C/(B+T)), even with perfect gang
scheduling. More threads than cores claim more of the scheduler's time (T x C/(B+T) cores in all), so
the adaptive controller, which goes there when the C kernels' pool runs the step, is not bound by it.

The busy processes are plain Python loops (one core each), like the two `yes > /dev/null` of issue 12.
`--url` measures a running server the same way (one non-streamed completion at a time, `ignore_eos`),
so llama.cpp's `llama-server` and `tokenfab serve` are compared with the same loops beside them. On a machine other people
share, the quiet figure is itself contended: say so with the numbers.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# tokenfab first: importing it sets OpenMP's spin wait (GOMP_SPINCOUNT), which libgomp reads when torch loads it
from tokenfab import LLM, SamplingParams, kernels  # noqa: E402
import torch  # noqa: E402
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


def _busy_loops(n: int):
    stop = mp.Event()
    procs = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    # measured from 5 s on: in the first ~2 s beside new busy loops the engine got more of the cores than
    # it does later (2 threads 12.5 ms per step, later 16; on a 2-core AMD EPYC Zen 3)
    time.sleep(5)
    return stop, procs


def _end_busy(stop, procs) -> None:
    stop.set()
    for p in procs:
        p.join(5)


def server_tok_per_s(url: str, tokens: int, repeats: int) -> float:
    import httpx

    best = 0.0
    with httpx.Client(base_url=url, timeout=600) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
        for _ in range(repeats):
            t = time.perf_counter()
            r = client.post("/v1/completions", json=body)
            r.raise_for_status()
            best = max(best, r.json()["usage"]["completion_tokens"] / (time.perf_counter() - t))
    return best


def measure_server(args) -> None:
    server_tok_per_s(args.url, 8, 1)                          # warm
    quiet = server_tok_per_s(args.url, args.tokens, args.repeats)
    stop, procs = _busy_loops(args.busy)
    try:
        busy = server_tok_per_s(args.url, args.tokens, args.repeats)
    finally:
        _end_busy(stop, procs)
    print(f"{'server':>28} {'quiet tok/s':>12} {'busy tok/s':>11} {'busy/quiet':>11}")
    print(f"{args.url:>28} {quiet:12.1f} {busy:11.1f} {busy / quiet:11.2f}")
    print("command: python benchmarks/contention.py " + " ".join(sys.argv[1:]))


def print_ceiling(files, args, quiet_full: float) -> None:
    """Quiet tok/s at each thread count, and the best a fair share of the cores allows beside the busy loops."""
    cores, full = len(os.sched_getaffinity(0)), torch.get_num_threads()
    llm = LLM(loaded=files, max_model_len=512, max_num_seqs=4, adaptive_threads=False)
    print(f"{'threads':>8} {'quiet tok/s':>12} {'fair share':>11} {'ceiling/quiet':>14}")
    best = 0.0
    for t in range(1, full + 1):
        torch.set_num_threads(t)
        tok_per_s(llm, 8, 1)
        q = tok_per_s(llm, args.tokens, args.repeats)
        share = min(1.0, cores / (args.busy + t))
        best = max(best, q * share / quiet_full)
        print(f"{t:8d} {q:12.1f} {share:11.2f} {q * share / quiet_full:14.2f}")
    torch.set_num_threads(full)
    print(f"fair-share ceiling of busy/quiet with {args.busy} busy processes on {cores} cores, up to {full} "
          f"threads: {best:.2f}")


def against_fixed(files, args) -> None:
    """The controller against a fixed thread count (the pool's team, above the cores included), beside
    the busy loops: one engine, 256-token rounds alternated (the order swapped each round, since the
    machine drifts), with where the controller's steps went: counts, mean step time, trial and probe steps."""
    import statistics
    from collections import Counter

    from tokenfab.engine.engine import _set_threads
    cores = torch.get_num_threads()
    llm = LLM(loaded=files, max_model_len=512, max_num_seqs=4, adaptive_threads=True)
    ctl = llm.engine.thread_controller
    steps: list[tuple[int, float, bool, bool]] = []
    observe = ctl.observe

    def traced(num_tokens: int, seconds: float) -> int:
        steps.append((ctl.threads, seconds, ctl._trial is not None, ctl._probe is not None))
        return observe(num_tokens, seconds)

    ctl.observe = traced
    tok_per_s(llm, 8, 1)
    quiet = tok_per_s(llm, args.tokens, args.repeats)
    shares: dict[str, list[float]] = {"controller": [], f"fixed {args.against_fixed}": []}

    def with_controller() -> None:
        llm.engine.thread_controller = ctl
        _set_threads(cores, ctl.threads)
        steps.clear()
        shares["controller"].append(tok_per_s(llm, args.tokens, 1) / quiet)

    def fixed() -> None:
        llm.engine.thread_controller = None
        _set_threads(cores, args.against_fixed)
        shares[f"fixed {args.against_fixed}"].append(tok_per_s(llm, args.tokens, 1) / quiet)

    stop, procs = _busy_loops(args.busy)
    try:
        for r in range(args.rounds):
            for run in ((with_controller, fixed) if r % 2 == 0 else (fixed, with_controller)):
                run()
            counts = Counter(t for t, *_ in steps)
            ms = {t: round(1e3 * statistics.mean(s for u, s, *_ in steps if u == t), 1) for t in counts}
            print(f"round {r}: controller {shares['controller'][-1]:.2f}, fixed {args.against_fixed} "
                  f"{shares[f'fixed {args.against_fixed}'][-1]:.2f} of quiet; controller steps per thread count "
                  f"{dict(counts)}, mean ms {ms}, in trials {sum(s[2] for s in steps)}, in probes {sum(s[3] for s in steps)}")
    finally:
        _end_busy(stop, procs)
        _set_threads(cores, cores)
    print(f"quiet {quiet:.1f} tok/s; mean share of it over {args.rounds} rounds: " +
          ", ".join(f"{k} {statistics.mean(v):.3f}" for k, v in shares.items()))
    print("command: python benchmarks/contention.py " + " ".join(sys.argv[1:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--busy", type=int, default=2, help="busy processes beside the engine (default 2)")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--model", default=None)
    ap.add_argument("--url", default=None, help="measure this running OpenAI-compatible server instead")
    ap.add_argument("--against-fixed", type=int, default=None, metavar="N",
                    help="only compare the controller with N fixed threads, alternated, --rounds times")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    if args.url:
        return measure_server(args)
    files = load_model_files(args.model)
    if args.against_fixed:
        return against_fixed(files, args)
    print(f"cpu: {os.cpu_count()} cores, torch threads {torch.get_num_threads()}; busy processes: {args.busy}")
    rows = []
    for adaptive in (True, False):
        llm = LLM(loaded=files, max_model_len=512, max_num_seqs=4, adaptive_threads=adaptive)
        tok_per_s(llm, 8, 1)                                   # warm
        quiet = tok_per_s(llm, args.tokens, args.repeats)
        stop, procs = _busy_loops(args.busy)
        ctl = llm.engine.thread_controller
        try:
            busy = tok_per_s(llm, args.tokens, args.repeats)
            threads = ctl.threads if ctl else torch.get_num_threads()
        finally:
            _end_busy(stop, procs)
        rows.append((adaptive, quiet, busy, threads, ctl.reductions if ctl else 0, ctl.raises if ctl else 0))
        torch.set_num_threads(ctl.max_threads if ctl else torch.get_num_threads())
        kernels.pool_threads(0)                                # the controller may have left it above the cores
        del llm
    print(f"{'adaptive threads':>17} {'quiet tok/s':>12} {'busy tok/s':>11} {'busy/quiet':>11} {'threads':>8} "
          f"{'lowered':>8} {'raised':>7}")
    for adaptive, quiet, busy, threads, red, up in rows:
        print(f"{'on' if adaptive else 'off':>17} {quiet:12.1f} {busy:11.1f} {busy / quiet:11.2f} {threads:8d} "
              f"{red:8d} {up:7d}")
    print_ceiling(files, args, rows[-1][1])
    print("command: python benchmarks/contention.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
