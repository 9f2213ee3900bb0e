"""Replicas on Ray Serve, measured: scale-out, prefix affinity, the long pool (docs/scale_out.md).

    python benchmarks/scale_out.py            # the full measurement (a quiet machine with >= 2 free cores)
    python benchmarks/scale_out.py --quick    # a short end-to-end run: checks that everything works

Each part starts `tokenfab serve --replicas ...` (a local Ray cluster, 1 CPU per replica), drives it
with `tokenfab bench serve`, and stops it. All runs of a part use the same load, so the ratios compare
like with like:
1. scale-out: 1 replica vs 2 replicas at the same Poisson rate: throughput and P99 TTFT;
2. prefix affinity on vs off (`--routing least-loaded`), 2 replicas, `--dataset shared-prefix`:
   P50 TTFT and the prefix-cache hit rate (from the servers' /metrics);
3. long pool on vs off: `--replicas 1 --long-replicas 1` vs `--replicas 2` (the same 2 replicas), with 5%
   long prompts (`--dataset mixed`): the short requests' P99 TTFT.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, flags: list[str], log_dir: str, name: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(os.path.join(log_dir, f"{name}.log"), "w")
        cmd = [sys.executable, "-m", "tokenfab", "serve", "--port", str(self.port), "--no-access-log", "--no-ui",
               *flags]
        print(f"  $ {' '.join(cmd[1:])}", flush=True)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT,
                                     env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")})

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if json.load(r).get("status") == "ok":
                        return
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError(f"the server was not ready within {timeout:g} s; see {self.log.name}")

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out = {}
        for name in ("prefix_cache_hits_total", "prefix_cache_queries_total"):
            m = re.search(rf"^tokenfab:{name}{{[^}}]*}} ([0-9.e+]+)$", text, re.M)
            out[name] = float(m.group(1)) if m else 0.0
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def __enter__(self) -> "Server":
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def bench(url: str, flags: list[str], out: str) -> dict:
    cmd = [sys.executable, "-m", "tokenfab", "bench", "serve", "--base-url", url, "--no-progress", "--out", out,
           "--seed", "0", *flags]
    print(f"  $ {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
                   env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")})
    with open(out) as f:
        return json.load(f)["runs"][0]


def pct(values: list[float], p: float) -> float | None:
    import numpy as np
    return float(np.percentile(values, p)) if values else None


def ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a short run that checks the parts work end to end")
    ap.add_argument("--rate", type=float, default=None,
                    help="Poisson requests/s (default: 1.5, about one 1-core replica's capacity here; quick: 2)")
    ap.add_argument("--num-prompts", type=int, default=None, help="requests per run (default: 60; quick: 16)")
    ap.add_argument("--num-prefixes", type=int, default=16,
                    help="shared prefixes in part 2 (default: 16; with few, every replica soon caches them all)")
    ap.add_argument("--parts", default="1,2,3", help="which parts to run (default 1,2,3)")
    ap.add_argument("--engine-flags", default="--max-num-seqs 16",
                    help="engine flags for every server (default: --max-num-seqs 16)")
    ap.add_argument("--out", help="write all numbers as JSON here")
    args = ap.parse_args()
    q = args.quick
    n = args.num_prompts or (16 if q else 60)
    out_len = "16" if q else "32"
    rate = args.rate or (2.0 if q else 1.5)
    parts = {int(p) for p in args.parts.split(",")}
    engine = args.engine_flags.split()
    results: dict = {"quick": q, "rate": rate, "num_prompts": n}
    tmp = tempfile.mkdtemp(prefix="scale-out-")
    print(f"logs and bench JSON in {tmp}", flush=True)

    if 1 in parts:
        print("\n1. scale-out: 1 vs 2 replicas, Poisson", rate, "req/s", flush=True)
        load = ["--dataset", "random", "--input-len", "128", "--output-len", out_len,
                "--num-prompts", str(n), "--request-rate", str(rate)]
        part = {}
        for reps in (1, 2):
            with Server(["--replicas", str(reps), *engine], tmp, f"scale-{reps}") as s:
                run = bench(s.url, load, os.path.join(tmp, f"scale-{reps}.json"))
            sm = run["summary"]
            part[reps] = {"output_tok_s": sm["output_throughput"], "req_s": sm["request_throughput"],
                          "p99_ttft_ms": sm.get("p99_ttft_ms"), "failed": sm.get("failed", 0)}
            print(f"  {reps} replica(s): {part[reps]}", flush=True)
        print(f"  2 vs 1: throughput {ratio(part[2]['output_tok_s'], part[1]['output_tok_s'])}, "
              f"P99 TTFT {ratio(part[2]['p99_ttft_ms'], part[1]['p99_ttft_ms'])}")
        results["scale_out"] = part

    if 2 in parts:
        print("\n2. prefix affinity on/off: 2 replicas, shared-prefix dataset", flush=True)
        load = ["--dataset", "shared-prefix", "--num-prefixes", str(args.num_prefixes), "--prefix-len", "256" if q else "512",
                "--input-len", "32", "--output-len", out_len, "--num-prompts", str(n),
                "--request-rate", str(rate)]
        part = {}
        for routing in ("prefix-affinity", "least-loaded"):
            with Server(["--replicas", "2", "--routing", routing, *engine], tmp, f"affinity-{routing}") as s:
                before = s.metrics()
                run = bench(s.url, load, os.path.join(tmp, f"affinity-{routing}.json"))
                after = s.metrics()
            hits = after["prefix_cache_hits_total"] - before["prefix_cache_hits_total"]
            queries = after["prefix_cache_queries_total"] - before["prefix_cache_queries_total"]
            part[routing] = {"p50_ttft_ms": run["summary"].get("p50_ttft_ms"),
                             "cache_hit_rate": hits / queries if queries else None,
                             "failed": run["summary"].get("failed", 0)}
            print(f"  {routing}: {part[routing]}", flush=True)
        on, off = part["prefix-affinity"], part["least-loaded"]
        print(f"  affinity on vs off: P50 TTFT {ratio(on['p50_ttft_ms'], off['p50_ttft_ms'])}, "
              f"hit rate {on['cache_hit_rate']} vs {off['cache_hit_rate']}")
        results["prefix_affinity"] = part

    if 3 in parts:
        long_len = 768 if q else 1536
        threshold = long_len // 2
        print(f"\n3. long pool on/off: 2 replicas, 5% prompts of {long_len} tokens", flush=True)
        load = ["--dataset", "mixed", "--long-fraction", "0.05", "--long-input-len", str(long_len),
                "--input-len", "128", "--output-len", out_len, "--num-prompts", str(max(n, 40)),
                "--request-rate", str(rate)]
        part = {}
        for name, flags in (("long pool", ["--replicas", "1", "--long-replicas", "1",
                                           "--long-prompt-threshold", str(threshold)]),
                            ("no long pool", ["--replicas", "2"])):
            with Server([*flags, "--max-model-len", str(long_len + 256), *engine], tmp, name.replace(" ", "-")) as s:
                run = bench(s.url, load, os.path.join(tmp, name.replace(" ", "-") + ".json"))
            short = [r["ttft_ms"] for r in run.get("requests", []) if r["tag"] == "short" and r["success"]]
            part[name] = {"short_p99_ttft_ms": pct(short, 99), "short_requests": len(short),
                          "failed": run["summary"].get("failed", 0)}
            print(f"  {name}: {part[name]}", flush=True)
        print(f"  long pool on vs off: short P99 TTFT "
              f"{ratio(part['long pool']['short_p99_ttft_ms'], part['no long pool']['short_p99_ttft_ms'])}")
        results["long_pool"] = part

    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
