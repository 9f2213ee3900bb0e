"""How well does the planner's simulator predict a real serving run? One script, end to end:

1. serve the bundled model with `--step-log` and drive it with `tokenfab bench serve` over a sweep of
   request rates and then of fixed concurrencies (the training load; the rates alone rarely dwell at
   the middle batch sizes a moderate load lives in): every engine step is logged with its shape and
   wall time;
2. serve it again, without the log, and measure one held-out run at another rate;
3. `tokenfab plan validate`: replay that run's exact arrivals through the simulator with a step
   table fitted to the training steps, and print predicted against measured P50 TPOT, P99 TTFT and
   output throughput (the mean of 100 replays with the training steps' measured scatter, and their
   P10-P90).

The held-out server logs its steps too (never used for the prediction): validating against a table
fitted to the held-out run's own steps, printed second, tells how much of the error is the step
costs moving between runs (machine noise) and how much is the simulator.

    python benchmarks/plan_validate.py                       # defaults below
    python benchmarks/plan_validate.py --train-rates 0.5,1,2,4 --train-concurrency none --rate 1.5
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(["tokenfab", "serve", "--port", str(port), "--no-access-log", "--log-level", "warning",
                             *extra], stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit("the server exited during start-up")
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not come up in 5 minutes")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def bench(url: str, args, num_prompts: int, extra: list[str]) -> None:
    cmd = ["tokenfab", "bench", "serve", "--base-url", url, "--num-prompts", str(num_prompts),
           "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--range-ratio", "0.5",
           "--no-progress", *extra]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train-rates", default="0.5,1,2", help="request rates of the logged (training) sweep")
    ap.add_argument("--rate", type=float, default=0.8, help="request rate of the held-out run (below saturation)")
    ap.add_argument("--train-concurrency", default="2,4,8,12,16",
                    help="closed-loop concurrencies of the logged sweep, after the rates ('none' to skip)")
    ap.add_argument("--num-prompts", type=int, default=60, help="requests per training rate")
    ap.add_argument("--concurrency-prompts", type=int, default=3,
                    help="requests per slot at each training concurrency (c x this many)")
    ap.add_argument("--held-out-prompts", type=int, default=300,
                    help="requests in the held-out run (its P99 TTFT is about its 3rd-largest at 300)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dir", default=None, help="where the step log and bench result go (default: a temp dir)")
    args = ap.parse_args()
    out = args.dir or tempfile.mkdtemp(prefix="tokenfab-plan-validate-")
    os.makedirs(out, exist_ok=True)
    steps, held_out = os.path.join(out, "steps.jsonl"), os.path.join(out, "held_out.json")
    held_out_steps = os.path.join(out, "held_out_steps.jsonl")
    for f in (steps, held_out_steps):
        if os.path.exists(f):
            os.unlink(f)

    proc, url = serve(["--step-log", steps])
    try:
        bench(url, args, args.num_prompts, ["--sweep", args.train_rates, "--seed", "1"])
        if args.train_concurrency != "none":
            for c in (int(x) for x in args.train_concurrency.split(",")):
                bench(url, args, c * args.concurrency_prompts, ["--max-concurrency", str(c), "--seed", str(10 + c)])
    finally:
        stop(proc)
    proc, url = serve(["--step-log", held_out_steps])
    try:
        bench(url, args, args.held_out_prompts, ["--request-rate", str(args.rate), "--seed", "2", "--out", held_out])
    finally:
        stop(proc)
    print(f"command: python benchmarks/plan_validate.py {' '.join(sys.argv[1:])}\nfiles in {out}", flush=True)
    print("\nThe prediction (step table from the training sweep):", flush=True)
    subprocess.run(["tokenfab", "plan", "validate", "--bench", held_out, "--step-table", steps], check=True)
    print("\nThe same without the step scatter (one replay at the fitted costs):", flush=True)
    subprocess.run(["tokenfab", "plan", "validate", "--bench", held_out, "--step-table", steps, "--no-step-noise"],
                   check=True)
    print("\nDiagnosis only (step table from the held-out run's own steps):", flush=True)
    subprocess.run(["tokenfab", "plan", "validate", "--bench", held_out, "--step-table", held_out_steps], check=True)


if __name__ == "__main__":
    main()
