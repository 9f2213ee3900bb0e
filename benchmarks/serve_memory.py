"""Resident memory of `tokenfab serve` after one request, and where it goes (issue 12's memory target).

Starts `tokenfab serve` (default flags `--max-num-seqs 8 --max-model-len 8192`, the same slots and
context as `llama-server -np 8 -c 8192`), sends one 64-token completion, then reads the server's
/proc/<pid>/status (VmRSS, VmHWM) and /proc/<pid>/smaps_rollup (anonymous vs file-backed pages) and
prints them with the start-up line the engine logs ("memory: ...": KV pool, weights, float copies).
Target: RSS at most 2x llama.cpp's 311 MB (622 MB).

    python benchmarks/serve_memory.py
    python benchmarks/serve_memory.py -- --max-num-seqs 8 --max-model-len 8192 --quantization none
    python benchmarks/serve_memory.py --llama-server /path/to/llama-server   # the anchor, same request

Linux only (/proc). Numbers move a few MB from run to run (allocator arenas, import order).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

import httpx

DEFAULT_FLAGS = ["--max-num-seqs", "8", "--max-model-len", "8192"]


def proc_memory(pid: int) -> dict[str, int]:
    """kB figures from /proc: VmRSS, VmHWM and smaps_rollup's anonymous / file-backed split."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:", "RssAnon:", "RssFile:")):
                k, v = line.split(":")
                out[k] = int(v.split()[0])
    return out


def start_tokenfab(flags: list[str]) -> tuple[subprocess.Popen, str, list[str]]:
    proc = subprocess.Popen([sys.executable, "-m", "tokenfab.cli", "serve", "--port", "0", "--no-access-log", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = []
    for line in proc.stdout:
        log.append(line.rstrip())
        m = re.search(r"curl (http://\S+)/v1/chat/completions", line)
        if m:
            return proc, m.group(1), log
    raise RuntimeError(f"the server exited with {proc.wait()} before it was ready:\n" + "\n".join(log[-20:]))


def start_llama_server(binary: str, model: str, slots: int, ctx: int) -> tuple[subprocess.Popen, str, list[str]]:
    port = 18000 + os.getpid() % 1000
    proc = subprocess.Popen([binary, "-m", model, "-np", str(slots), "-c", str(ctx), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=1, trust_env=False).status_code == 200:
                return proc, url, []
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("llama-server did not become healthy")


def one_request(url: str) -> None:
    r = httpx.post(url + "/v1/completions", json={"prompt": "Write a short story about a lighthouse.",
                                                  "max_tokens": 64, "temperature": 0}, timeout=300, trust_env=False)
    r.raise_for_status()


def measure(proc: subprocess.Popen, url: str) -> dict[str, int]:
    before = proc_memory(proc.pid)
    one_request(url)
    time.sleep(0.5)
    after = proc_memory(proc.pid)
    return {"idle_rss_kb": before["VmRSS"], **{k + "_kb": v for k, v in after.items()}}


def report(name: str, m: dict[str, int], log: list[str]) -> None:
    print(f"{name}: RSS idle {m['idle_rss_kb'] / 1024:.0f} MiB, after one request {m['VmRSS_kb'] / 1024:.0f} MiB "
          f"(anonymous {m.get('RssAnon_kb', 0) / 1024:.0f} MiB, file-backed {m.get('RssFile_kb', 0) / 1024:.0f} MiB), "
          f"peak {m['VmHWM_kb'] / 1024:.0f} MiB")
    for line in log:
        if "memory:" in line or "reserved" in line:
            print("   ", line.split("] ")[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", default=None, help="also measure this llama-server binary on the bundled GGUF")
    ap.add_argument("flags", nargs="*", help="tokenfab serve flags (after --); default: " + " ".join(DEFAULT_FLAGS))
    args = ap.parse_args()
    flags = args.flags or DEFAULT_FLAGS
    proc, url, log = start_tokenfab(flags)
    try:
        report("tokenfab serve " + " ".join(flags), measure(proc, url), log)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    if args.llama_server:
        from tokenfab.files.bundled import bundled_model_path
        proc, url, log = start_llama_server(args.llama_server, bundled_model_path(), 8, 8192)
        try:
            report("llama-server -np 8 -c 8192", measure(proc, url), log)
        finally:
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
