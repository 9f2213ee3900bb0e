"""What the disk tier costs a decoding engine: throughput at 8 streams with --kv-disk-dir on against off, on
the bundled model (issue 41's tier-cost measurement; target: within 3 %).

Two engines in one process, the same settings but the tier; each round runs the same 8 distinct prompts
(short, so the time is decode) on one engine and then the other, alternating which goes first. With the tier,
every block that fills is copied in the step and written by the writer thread. Prints output tokens per
second for each round and the ratio of the medians.

    python benchmarks/kv_disk_overhead.py                    # 8 streams, 64 tokens each, 3 rounds
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenfab import LLM, SamplingParams  # noqa: E402
from tokenfab.files.bundled import bundled_model_path  # noqa: E402
from tokenfab.model.loader import load_model_files  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    files = load_model_files(bundled_model_path())
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as d:
        engines = {"off": LLM(loaded=files), "on": LLM(loaded=files, kv_disk_dir=d)}
        rates: dict[str, list[float]] = {"off": [], "on": []}
        binding, in_step = engines["on"].engine.kv_connector, [0.0]
        save = binding.save_new_blocks

        def timed_save() -> None:                        # the tier's own time inside the steps
            t = time.perf_counter()
            save()
            in_step[0] += time.perf_counter() - t
        binding.save_new_blocks = timed_save
        wall_on = 0.0
        for r in range(args.rounds + 1):                  # round 0 warms both up and is not counted
            order = ("off", "on") if r % 2 else ("on", "off")
            for name in order:
                prompts = [f"Round {r}, stream {i}: write a long story about a lighthouse keeper." for i in range(args.streams)]
                t0 = time.perf_counter()
                outs = engines[name].generate(prompts, greedy, use_tqdm=False)
                dt = time.perf_counter() - t0
                if r:
                    rates[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
                    wall_on += dt if name == "on" else 0.0
                elif name == "on":
                    in_step[0] = 0.0
        stats = engines["on"].engine.stats()
        engines["on"].close()
    for name in ("off", "on"):
        print(f"tier {name}: " + ", ".join(f"{x:.1f}" for x in rates[name]) + " tok/s")
    ratio = statistics.median(rates["on"]) / statistics.median(rates["off"])
    print(f"on / off (medians): {ratio:.3f}x (target >= 0.97x); {stats.kv_disk_bytes_written / 2**20:.1f} MiB "
          f"written, {stats.kv_disk_dropped_saves} saves dropped")
    print(f"in the steps, handing blocks to the tier (copying them): {in_step[0]:.3f} s of {wall_on:.1f} s "
          f"({in_step[0] / wall_on:.2%}); the rest of any difference is the writer thread's CPU, or noise")
    print("command: python benchmarks/kv_disk_overhead.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
