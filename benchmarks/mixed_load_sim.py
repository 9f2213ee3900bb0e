"""mixed_load.py's three conditions, simulated: the real Scheduler and StepBudget, no model, no server.

Steps take the time a fixed step-cost model says (fitted by hand to the 2-core VM: 12 ms a step, 5 ms a
sequence, 0.5 ms a token), and the clock jumps by it, so one run takes seconds and is the same every
time: a policy change to the scheduler or the step budget can be judged here over many seeds before
the real benchmark (minutes, and noisy on a shared machine) checks it. What it leaves out: the step
model's own error, the server (HTTP, detokenizing, the Batch API's event loop) and the machine's noise.

Per seed (one Poisson arrival sequence): interactive only, the same arrivals beside a batch job that
keeps `--batch-concurrency` lines in the engine, and the same arrivals with `--long-fraction` long
prompts; ratios as mixed_load.py prints them, and the batch job's output tok/s against the capacity
(a closed loop of 8) left idle.

    python benchmarks/mixed_load_sim.py
    python benchmarks/mixed_load_sim.py --seeds 8 --no-step-budget     # token caps only
"""
from __future__ import annotations

import argparse
import math
import os
import random
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenfab.engine.kv_cache import BlockManager  # noqa: E402
from tokenfab.engine.scheduler import Scheduler  # noqa: E402
from tokenfab.engine.sequence import Sequence  # noqa: E402
from tokenfab.engine.step_budget import StepBudget  # noqa: E402
from tokenfab.costmodel.shape import StepShape  # noqa: E402
from tokenfab.costmodel.measured import MeasuredStepCost  # noqa: E402
from tokenfab.engine.update import ModelOutput  # noqa: E402
from tokenfab.sampling import SamplingParams  # noqa: E402

# 1 decode row 17.5 ms, 8 rows 56 ms, a 512-token prefill 273 ms: the 2-core VM's 17 / 53 / ~290 ms.
COST = MeasuredStepCost(knots=(0.0, 4096.0), values=(0.012, 0.012 + 4096 * 0.0005),
                        coef={"num_seqs": 0.005, "attn_pairs": 2e-9, "kv_tokens": 1e-6})


def scheduler(args, now: list[float]) -> Scheduler:
    # The simulated clock; a StepBudget from before the arrival bound (commit 8fb9c05) has none to take.
    clock = {"clock": lambda: now[0]} if "clock" in StepBudget.__dataclass_fields__ else {}
    budget = None if args.no_step_budget else StepBudget(SimpleNamespace(cost=COST), None, args.slack, **clock)
    return Scheduler(BlockManager(8192, 16), args.max_num_seqs, args.max_num_batched_tokens,
                     batch_prefill_share=args.batch_prefill_share, long_prompt_threshold=args.long_threshold,
                     max_long_prefill_tokens=args.max_long_prefill_tokens, step_budget=budget)


def step(s: Scheduler, now: list[float]) -> list[Sequence]:
    """Run one step through the scheduler's own update (the model always samples token 7); returns the
    sequences that got a token in it. Those that reach max_tokens finish there."""
    batch = s.schedule()
    shape = StepShape()
    for q, n in zip(batch.seqs, batch.num_new_tokens):
        shape.add(q.num_computed_tokens, n)
    now[0] += COST.step_time(shape)
    return [q for q, _ in s.update_from_output(batch, ModelOutput.stand_in(batch, 7)).new_tokens]


def prompt(rid: str, n: int) -> list[int]:
    rng = random.Random(rid)                  # distinct prompts, the same in every process
    return [rng.randrange(30000) for _ in range(n)]


def capacity(args) -> float:
    """Output tok/s of a closed loop of 8 interactive requests."""
    now, s = [0.0], None
    s = scheduler(args, now)
    started = done = tokens = 0
    while done < args.num_prompts:
        while started - done < 8 and started < args.num_prompts:
            s.add(Sequence(f"c{started}", 0, prompt(f"c{started}", args.input_len), SamplingParams(),
                           max_tokens=args.output_len))
            started += 1
        for q in step(s, now):
            tokens += 1
            if q.status.finished:
                done += 1
    return tokens / now[0]


def run(args, rate: float, seed: int, batch: bool, long_fraction: float) -> dict:
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for i in range(args.num_prompts):
        t += rng.expovariate(rate)
        arrivals.append((t, f"i{i}", args.long_input_len if rng.random() < long_fraction else args.input_len))
    now = [0.0]
    s = scheduler(args, now)
    rec, nxt, batch_in, batch_next, batch_tokens = {}, 0, 0, 0, 0
    while nxt < len(arrivals) or any(q.service_class != "batch" for q in s.running + list(s.waiting)):
        while nxt < len(arrivals) and arrivals[nxt][0] <= now[0]:
            at, rid, n = arrivals[nxt]
            s.add(Sequence(rid, 0, prompt(rid, n), SamplingParams(), max_tokens=args.output_len, arrival_time=at))
            rec[rid] = {"arrival": at, "len": n, "first": None, "done": None}
            nxt += 1
        while batch and batch_in < args.batch_concurrency:
            rid = f"b{batch_next}"
            s.add(Sequence(rid, 0, prompt(rid, 10), SamplingParams(), max_tokens=args.batch_output_len,
                           service_class="batch", arrival_time=now[0]))
            batch_in, batch_next = batch_in + 1, batch_next + 1
        if not s.has_work():
            now[0] = arrivals[nxt][0]
            continue
        for q in step(s, now):
            if q.service_class == "batch":
                batch_tokens += now[0] <= arrivals[-1][0]
            elif rec[q.request_id]["first"] is None:
                rec[q.request_id]["first"] = now[0]
            if q.status.finished:
                if q.service_class == "batch":
                    batch_in -= 1
                else:
                    rec[q.request_id]["done"] = now[0]
    short = [r for r in rec.values() if r["len"] == args.input_len]
    longs = sorted(r["first"] - r["arrival"] for r in rec.values() if r["len"] != args.input_len)
    ttft = sorted(r["first"] - r["arrival"] for r in short)
    tpot = sorted((r["done"] - r["first"]) / (args.output_len - 1) for r in short)
    return {"p50_ttft": _q(ttft, 0.5), "p99_ttft": _q(ttft, 0.99), "p50_tpot": _q(tpot, 0.5),
            "p99_tpot": _q(tpot, 0.99), "batch_tok_s": batch_tokens / arrivals[-1][0],
            "long_p50_ttft": longs[len(longs) // 2] if longs else None}


def _q(v: list[float], q: float) -> float:
    return v[min(len(v) - 1, math.ceil(q * len(v)) - 1)]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--load", type=float, default=0.5)
    ap.add_argument("--batch-concurrency", type=int, default=16)
    ap.add_argument("--batch-output-len", type=int, default=32)
    ap.add_argument("--long-fraction", type=float, default=0.05)
    ap.add_argument("--long-input-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--batch-prefill-share", type=float, default=0.25)
    ap.add_argument("--long-threshold", type=int, default=512)
    ap.add_argument("--max-long-prefill-tokens", type=int, default=128)
    ap.add_argument("--slack", type=float, default=0.2)
    ap.add_argument("--no-step-budget", action="store_true", help="token caps only")
    return ap


def main() -> None:
    args = parser().parse_args()

    cap_tok_s = capacity(args)
    rate = args.load * cap_tok_s / args.output_len
    idle = cap_tok_s - rate * args.output_len
    print(f"capacity {cap_tok_s:.1f} output tok/s (closed loop of 8); interactive at {rate:.2f} req/s; "
          f"{idle:.1f} tok/s left idle")
    print(f"{'seed':>4}{'alone P99 TTFT':>16}{'P99 TPOT':>10}  {'with batch: TTFT':>17}{'TPOT':>7}{'batch/idle':>12}"
          f"  {'long on: short TTFT':>20}{'TPOT':>7}{'long P50 TTFT':>15}")
    for seed in range(args.seeds):
        alone = run(args, rate, seed, batch=False, long_fraction=0.0)
        mixed = run(args, rate, seed, batch=True, long_fraction=0.0)
        longs = run(args, rate, seed, batch=False, long_fraction=args.long_fraction)
        lp = f"{longs['long_p50_ttft']:.1f} s" if longs["long_p50_ttft"] is not None else "-"
        print(f"{seed:>4}{alone['p99_ttft'] * 1e3:>13.0f} ms{alone['p99_tpot'] * 1e3:>7.1f} ms"
              f"  {mixed['p99_ttft'] / alone['p99_ttft']:>16.2f}x{mixed['p99_tpot'] / alone['p99_tpot']:>6.2f}x"
              f"{mixed['batch_tok_s'] / idle:>11.0%}  {longs['p99_ttft'] / alone['p99_ttft']:>19.2f}x"
              f"{longs['p99_tpot'] / alone['p99_tpot']:>6.2f}x{lp:>15}")
    print("command: python benchmarks/mixed_load_sim.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
