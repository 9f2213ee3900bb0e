"""What the web page costs the server: `tokenfab bench serve` throughput with the dashboard open and
polling `/metrics` every second, against no page, on one `tokenfab serve` of the bundled model.

The two conditions alternate (none, page, none, page, ...) against the same server, so drift in a
shared machine's load lands on both; printed: output tok/s and median TTFT of each run, the mean of
each condition, and page / none as ratios. Needs Debian's chromium and the `playwright` package.

    python benchmarks/ui_overhead.py                       # 2 pairs of 24 requests, 8 in flight
    python benchmarks/ui_overhead.py --pairs 3 --num-prompts 48
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.serve_process import serve  # noqa: E402
from tests.test_web_ui import CHROMIUM_ARGS, _chromium  # noqa: E402


def bench(url: str, args, out: str) -> dict:
    subprocess.run([sys.executable, "-m", "tokenfab", "bench", "serve", "--base-url", url,
                    "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
                    "--output-len", str(args.output_len), "--max-concurrency", str(args.concurrency),
                    "--no-progress", "--seed", "0", "--out", out], check=True, capture_output=True, timeout=600)
    return json.load(open(out))["runs"][0]["summary"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--serve-flags", default="--max-num-seqs 8 --max-model-len 512")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright
    tmp = tempfile.mkdtemp()
    rows: dict[str, list[dict]] = {"none": [], "page": []}
    with serve(os.path.join(tmp, "serve.log"), *args.serve_flags.split()) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), args=CHROMIUM_ARGS)
        bench(url, argparse.Namespace(**{**vars(args), "num_prompts": 4}), os.path.join(tmp, "warm.json"))
        for i in range(args.pairs):
            for cond in ("none", "page"):
                page = None
                if cond == "page":
                    page = browser.new_page()
                    page.goto(url + "/")
                    page.click("button[data-tab=dash]")
                    page.wait_for_function("window.tf.dash.samples >= 2")
                s = bench(url, args, os.path.join(tmp, f"{cond}{i}.json"))
                polls = page.evaluate("window.tf.dash.samples") if page else 0
                if page:
                    page.close()
                rows[cond].append(s)
                print(f"{cond:5s} run {i}: {s['output_throughput']:7.1f} out tok/s, median TTFT "
                      f"{s['median_ttft_ms']:7.1f} ms, {s['completed']} ok" + (f", {polls} dashboard polls" if page else ""),
                      flush=True)
        browser.close()
    mean = {c: statistics.mean(r["output_throughput"] for r in rs) for c, rs in rows.items()}
    ttft = {c: statistics.mean(r["median_ttft_ms"] for r in rs) for c, rs in rows.items()}
    print(f"\nmean out tok/s: none {mean['none']:.1f}, page {mean['page']:.1f} -> page/none {mean['page'] / mean['none']:.3f}")
    print(f"mean median TTFT: none {ttft['none']:.1f} ms, page {ttft['page']:.1f} ms -> page/none "
          f"{ttft['page'] / ttft['none']:.3f}")
    spread = [r["output_throughput"] for r in rows["none"]]
    if len(spread) > 1:
        print(f"run-to-run spread without the page: {min(spread):.1f}-{max(spread):.1f} tok/s")


if __name__ == "__main__":
    main()
