"""Interactive traffic beside a batch job on one `tokenfab serve` of the bundled model.

Measures, against the same server:
1. capacity: a closed loop of `--concurrency` requests (request/s and output tok/s);
2. interactive only: Poisson arrivals at `--load` x capacity (default 50 %);
3. the same arrivals while a Batch API job runs: interactive TTFT/TPOT against (2), and the batch's
   output tok/s against the capacity (2) left idle;
4. the same arrivals with `--long-fraction` long prompts (`--long-input-len` tokens) in the long-prompt
   lane: the short requests' P99 TTFT against (2).
Ratios are within one run on one server, so a shared machine's drift lands on every condition alike,
but its noise does not: repeat before believing a ratio near a target.

    python benchmarks/mixed_load.py
    python benchmarks/mixed_load.py --num-prompts 48 --batch-lines 128
    python benchmarks/mixed_load.py --quick        # a smoke run (a few minutes): it works, the numbers mean little
"""
from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from openai import OpenAI  # noqa: E402

from tests.serve_process import serve  # noqa: E402


def bench(url: str, args, out: str, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "tokenfab", "bench", "serve", "--base-url", url, "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--ignore-eos", "--no-progress", "--seed", "0",
           # one edge between the short and the long prompts: a long prompt of exactly --long-input-len
           # tokens would fall in the first bucket if the edge were that length (buckets hold their edge)
           "--buckets", str((args.input_len + args.long_input_len) // 2), "--out", out, *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        log = os.path.join(os.path.dirname(out), "serve.log")
        server = open(log).read()[-3000:] if os.path.exists(log) else ""
        sys.exit(f"tokenfab bench serve failed ({r.returncode}): {r.stderr.strip()[-2000:]}\nserver log:\n{server}")
    return json.load(open(out))["runs"][0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8, help="closed loop for the capacity run")
    ap.add_argument("--load", type=float, default=0.5, help="interactive rate as a share of capacity")
    ap.add_argument("--batch-lines", type=int, default=96)
    ap.add_argument("--batch-output-len", type=int, default=32)
    ap.add_argument("--long-fraction", type=float, default=0.05)
    ap.add_argument("--long-input-len", type=int, default=1024)
    ap.add_argument("--serve-flags", default="--max-num-seqs 16 --long-prompt-threshold 512 --max-long-prefill-tokens 128")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 8 prompts, 8 output tokens, 16 batch lines, 600-token long prompts")
    args = ap.parse_args()
    if args.quick:
        args.num_prompts, args.output_len, args.batch_lines, args.batch_output_len = 8, 8, 16, 16
        args.long_input_len, args.long_fraction = 600, 0.25

    with tempfile.TemporaryDirectory() as tmp, \
            serve(os.path.join(tmp, "serve.log"), "--data-dir", os.path.join(tmp, "data"), "--no-ui",
                  *args.serve_flags.split()) as url:
        cap = bench(url, args, os.path.join(tmp, "cap.json"), "--num-prompts", str(args.num_prompts),
                    "--max-concurrency", str(args.concurrency))["summary"]
        rate = args.load * cap["request_throughput"]
        print(f"capacity: {cap['request_throughput']:.2f} req/s, {cap['output_throughput']:.1f} output tok/s "
              f"(closed loop, {args.concurrency} in flight); interactive at {rate:.2f} req/s ({args.load:.0%})",
              flush=True)
        poisson = ("--num-prompts", str(args.num_prompts), "--request-rate", f"{rate:.3f}")
        alone = bench(url, args, os.path.join(tmp, "alone.json"), *poisson)["summary"]
        print(f"interactive only: P99 TTFT {alone['p99_ttft_ms']:.0f} ms, P99 TPOT {alone['p99_tpot_ms']:.1f} ms",
              flush=True)

        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=2, timeout=120)
        lines = [json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/completions",
                             "body": {"prompt": f"Write item {i} of a long list:", "max_tokens": args.batch_output_len,
                                      "temperature": 0, "ignore_eos": True}}) for i in range(args.batch_lines)]
        f = client.files.create(file=("b.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
        job = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        while client.batches.retrieve(job.id).status == "validating":
            time.sleep(0.2)
        t0, done0 = time.monotonic(), client.batches.retrieve(job.id).request_counts.completed
        mixed = bench(url, args, os.path.join(tmp, "mixed.json"), *poisson)["summary"]
        t1, b = time.monotonic(), client.batches.retrieve(job.id)
        client.batches.cancel(job.id)
        batch_tok_s = (b.request_counts.completed - done0) * args.batch_output_len / (t1 - t0)
        finished_early = b.status == "completed"
        while client.batches.retrieve(job.id).status not in ("cancelled", "completed"):
            time.sleep(0.2)

        long_run = bench(url, args, os.path.join(tmp, "long.json"), *poisson, "--dataset", "mixed",
                         "--long-fraction", str(args.long_fraction), "--long-input-len", str(args.long_input_len))
        short = long_run["buckets"][0]

    idle_tok_s = cap["output_throughput"] - alone["output_throughput"]
    print(f"{'':34}{'P50 TTFT':>10}{'P99 TTFT':>10}{'P50 TPOT':>10}{'P99 TPOT':>10}  (ms)")
    for name, s in (("interactive only", alone), ("with a batch job", mixed),
                    (f"with {args.long_fraction:.0%} long prompts: short ones", short)):
        print(f"{name:34}{s['median_ttft_ms']:10.0f}{s['p99_ttft_ms']:10.0f}{s['median_tpot_ms']:10.1f}"
              f"{s['p99_tpot_ms']:10.1f}")
    print(f"batch job beside interactive: P99 TTFT x{mixed['p99_ttft_ms'] / alone['p99_ttft_ms']:.2f} (target <= 1.2), "
          f"P99 TPOT x{mixed['p99_tpot_ms'] / alone['p99_tpot_ms']:.2f} (target <= 1.2)")
    share = f"{batch_tok_s / idle_tok_s:.0%}" if idle_tok_s > 0 else "n/a (no idle capacity measured: a noisy run)"
    print(f"batch throughput {batch_tok_s:.1f} tok/s against {idle_tok_s:.1f} tok/s left idle: "
          f"{share} (target >= 70 %)" + (" [the job finished inside the window]" if finished_early else ""))
    print(f"long prompts on: short requests' P99 TTFT x{short['p99_ttft_ms'] / alone['p99_ttft_ms']:.2f} (target <= 1.3)")
    longs = [b for b in long_run["buckets"][1:] if b.get("completed")]
    if longs and longs[0].get("median_ttft_ms") is not None:
        print(f"  (the long prompts themselves: {longs[0]['completed']} of them, P50 TTFT "
              f"{longs[0]['median_ttft_ms']:.0f} ms: what the step-time budget makes them wait)")
    print("command: python benchmarks/mixed_load.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
