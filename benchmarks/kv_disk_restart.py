"""The disk tier after a restart: TTFT of a prompt whose long system prompt an earlier engine saved, against
the same prompt computed cold, on the bundled model (issue 41's persistent-prefix measurement).

An engine on an empty --kv-disk-dir answers system prompt + question 1 (cold: nothing cached anywhere) and
is closed (its queued block writes finish); a new engine on the same directory answers system prompt +
question 2, its system prompt's blocks read from disk. A third engine, without the tier, answers question 2
cold: the baseline. Prints both TTFTs (arrival to first token, one token generated), their ratio, the
blocks loaded, and whether the two answers to question 2 agree (greedy).

    python benchmarks/kv_disk_restart.py                     # a 4,000-token system prompt
    python benchmarks/kv_disk_restart.py --system-tokens 1000
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenfab import LLM, SamplingParams  # noqa: E402
from tokenfab.files.bundled import bundled_model_path  # noqa: E402
from tokenfab.model.loader import load_model_files  # noqa: E402

FILLER = ("Section {i}. The device keeps its settings in the front panel menu; hold the reset key for five "
          "seconds to restore them, and consult the maintenance chapter before opening the case. ")


def ttft(llm: LLM, prompt: str, greedy: SamplingParams) -> tuple[float, list[int], int]:
    out = llm.generate(prompt, greedy, use_tqdm=False)[0]
    m = out.metrics
    return m.first_token_time - m.arrival_time, out.outputs[0].token_ids, out.num_cached_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--system-tokens", type=int, default=4000)
    ap.add_argument("--max-tokens", type=int, default=4, help="tokens generated per answer (TTFT is the first)")
    args = ap.parse_args()
    files = load_model_files(bundled_model_path())
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    kw = dict(loaded=files, max_model_len=args.system_tokens + 512)
    with tempfile.TemporaryDirectory() as d:
        first = LLM(kv_disk_dir=d, **kw)
        system, i = "", 0
        while len(first.tokenizer.encode(system)) < args.system_tokens:
            system += FILLER.format(i=i)
            i += 1
        q1, q2 = system + "Question: where is the reset key?", system + "Question: how long do I hold it?"
        t_first, _, _ = ttft(first, q1, greedy)
        first.close()
        second = LLM(kv_disk_dir=d, **kw)
        t_disk, disk_ids, cached = ttft(second, q2, greedy)
        stats = second.engine.stats()
        second.close()
    cold = LLM(**kw)
    t_cold, cold_ids, _ = ttft(cold, q2, greedy)
    n = len(cold.engine.tokenize(q2))
    print(f"prompt {n} tokens; first engine (cold, saving) TTFT {t_first:.2f} s")
    print(f"after restart: TTFT {t_disk:.2f} s, {cached} tokens from disk ({stats.kv_disk_hit_blocks} blocks, "
          f"{stats.kv_disk_bytes_read / 2**20:.1f} MiB, {stats.kv_disk_load_seconds:.3f} s reading)")
    print(f"cold: TTFT {t_cold:.2f} s; ratio {t_disk / t_cold:.3f}x (target <= 0.2x); "
          f"greedy answers {'equal' if disk_ids == cold_ids else 'DIFFER'}")
    print("command: python benchmarks/kv_disk_restart.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
