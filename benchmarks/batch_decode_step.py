"""Where a big decode step and a 512-token prefill spend their time, in process, on the bundled model.

For each N in --streams: N greedy requests of --prompt-len random tokens are prefilled, then --steps
decode steps of N rows are timed (ms per step and output tok/s), optionally under cProfile (--profile:
the top functions by own time, e.g. `decode_attention`, oneDNN's `_linear_pointwise`, `.to` conversions,
the sampler's `max`). Then --prefill-len-token prompts are prefilled alone (TTFT median, ms). Each
figure comes with the process's CPU time: with --threads 1 that is the fair measure on a shared machine
(time descheduled does not count; with more threads, spinning OpenMP workers inflate it).

    python benchmarks/batch_decode_step.py                          # 32 and 64 streams, 512-token prefill
    python benchmarks/batch_decode_step.py --streams 64 --profile   # plus a cProfile table
    python benchmarks/batch_decode_step.py --threads 1 --kv-cache-dtype float16
    python benchmarks/batch_decode_step.py --threads 1 --streams 8 32 64 --kv-cache-dtype auto float16 \
        --rounds 3 --prefill-len 0      # engines side by side, alternating, ratios against the first
    python benchmarks/batch_decode_step.py --threads 1 --prefill-attention-dtype float32

Several --kv-cache-dtype values build one engine each in this process and time them in turn, --rounds
times alternately (medians, and each one's ratio against the first): the 2-core VM is shared, so single
figures are noisy. For code changes, run the same command on two checkouts back to back
(PYTHONPATH=<checkout>), a few times alternately.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import statistics
import sys
import time

sys.path.insert(0, os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] or
                os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenfab import LLM, SamplingParams  # noqa: E402


def decode_steps(llm: LLM, n: int, prompt_len: int, steps: int, profile: bool) -> float:
    eng = llm.engine
    rng = random.Random(n)
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    ids = [f"d{n}-{i}" for i in range(n)]
    for rid in ids:
        eng.add_request(rid, [rng.randrange(100, 49000) for _ in range(prompt_len)], params)
    while eng.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running):
        eng.step()
    eng.step()
    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    t, c = time.perf_counter(), time.process_time()
    for _ in range(steps):
        eng.step()
    dt, cpu = (time.perf_counter() - t) / steps, (time.process_time() - c) / steps
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    for rid in ids:
        eng.abort_request(rid)
    return dt, cpu


def prefill_ms(llm: LLM, length: int, repeats: int) -> float:
    eng = llm.engine
    rng = random.Random(length)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    times, cpu = [], []
    for i in range(repeats + 1):
        eng.add_request(f"p{i}", [rng.randrange(100, 49000) for _ in range(length)], params)
        t, c = time.perf_counter(), time.process_time()
        while eng.has_unfinished_requests():
            eng.step()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return statistics.median(times[1:]) * 1e3, statistics.median(cpu[1:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--prefill-repeats", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--threads", type=int, default=None,
                    help="engine threads; with 1, the process CPU time is a fair measure on a shared machine")
    ap.add_argument("--kv-cache-dtype", nargs="+", default=["auto"],
                    help="auto (float32 pools) | float16 | int8; several: compared in one run")
    ap.add_argument("--rounds", type=int, default=1, help="alternations of the --kv-cache-dtype engines")
    ap.add_argument("--prefill-attention-dtype", default="auto", help="auto | float32 | bfloat16")
    args = ap.parse_args()
    kw = {"num_threads": args.threads} if args.threads else {}
    kw.update(prefill_attention_dtype=args.prefill_attention_dtype)
    llms = {kv: LLM(max_num_seqs=max(args.streams), max_model_len=4096, enable_prefix_caching=False,
                    kv_cache_dtype=kv, **kw) for kv in args.kv_cache_dtype}
    times: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for r in range(args.rounds):
        for kv, llm in llms.items():
            for n in args.streams:
                dt, cpu = decode_steps(llm, n, args.prompt_len, args.steps, args.profile)
                times.setdefault((kv, n), []).append((dt, cpu))
                print(f"[round {r + 1}] kv {kv}, {n} streams: {dt * 1e3:.1f} ms per decode step "
                      f"({cpu * 1e3:.1f} ms CPU), {n / dt:.0f} output tok/s")
            if args.prefill_len:
                wall, cpu = prefill_ms(llm, args.prefill_len, args.prefill_repeats)
                times.setdefault((kv, "prefill"), []).append((wall, cpu))
                print(f"[round {r + 1}] kv {kv}, {args.prefill_len}-token prefill: {wall:.0f} ms ({cpu:.0f} ms CPU)")
    first = args.kv_cache_dtype[0]
    print(f"medians of {args.rounds} round(s); ratio = the first kv_cache_dtype's ({first}) time / this one's")
    for n in args.streams:
        base = statistics.median(t for t, _ in times[(first, n)])
        for kv in llms:
            dt = statistics.median(t for t, _ in times[(kv, n)])
            cpu = statistics.median(c for _, c in times[(kv, n)])
            print(f"{n} streams, kv {kv}: {dt * 1e3:.1f} ms per decode step ({cpu * 1e3:.1f} ms CPU), "
                  f"{n / dt:.0f} output tok/s, {base / dt:.2f}x")
    if args.prefill_len:
        base = statistics.median(t for t, _ in times[(first, "prefill")])
        for kv in llms:
            wall = statistics.median(t for t, _ in times[(kv, "prefill")])
            cpu = statistics.median(c for _, c in times[(kv, "prefill")])
            print(f"kv {kv}, {args.prefill_len}-token prefill: {wall:.0f} ms ({cpu:.0f} ms CPU), {base / wall:.2f}x")


if __name__ == "__main__":
    main()
