"""lm-eval's wall time for the local multiple-choice task (tests/data/lm_eval) against any OpenAI-compatible
server: `local-completions`, loglikelihoods through `echo` + `logprobs`, nothing downloaded.

Run it against tokenfab and against vLLM-CPU serving the same weights, one after the other, on a quiet
machine (the two servers must not run at the same time):

    tokenfab serve --port 8011 &
    python benchmarks/lm_eval_wall.py --base-url http://127.0.0.1:8011 --model SmolLM2-135M-Instruct

    /work/shared/anchors/vllm-cpu.sh serve 8012 &
    python benchmarks/lm_eval_wall.py --base-url http://127.0.0.1:8012 --model smol \
        --tokenizer ~/.cache/tokenfab-anchors/smollm2-hf-bf16

Without --tokenizer, lm-eval finds the tokenizer through the server's GET /tokenizer_info (tokenfab
serves it; vLLM only with --enable-tokenizer-info-endpoint, hence the HF copy). The task's 4 questions
are repeated --repeat times (a temporary copy of the task) so the run is long enough to time; the wall
time covers lm-eval's `simple_evaluate` only, not its imports. The ratio of the two runs' wall times is
the number to quote, with both commands.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

TASK_DIR = Path(__file__).resolve().parent.parent / "tests" / "data" / "lm_eval"
TASK = "tokenfab_capitals"


def wait_ready(base_url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(base_url.rstrip("/") + "/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            sys.exit(f"no server answered {base_url}/v1/models within {timeout_s:.0f} s")
        time.sleep(1)


def repeated_task(tmp: str, repeat: int) -> int:
    """Copy the task into `tmp` with its docs repeated; returns the number of docs."""
    docs = (TASK_DIR / "capitals.jsonl").read_text().splitlines()
    shutil.copy(TASK_DIR / f"{TASK}.yaml", tmp)
    Path(tmp, "capitals.jsonl").write_text("\n".join(docs * repeat) + "\n")
    return len(docs) * repeat


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8011")
    ap.add_argument("--model", required=True, help="the served model name")
    ap.add_argument("--tokenizer", help="a local HF tokenizer folder (default: the server's /tokenizer_info)")
    ap.add_argument("--repeat", type=int, default=25, help="times the 4 questions are repeated (default: 25)")
    ap.add_argument("--num-concurrent", type=int, default=1, help="lm-eval's concurrent requests (default: 1)")
    ap.add_argument("--wait", type=float, default=300, help="seconds to wait for the server (default: 300)")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    if args.tokenizer and not Path(os.path.expanduser(args.tokenizer)).is_dir():
        ap.error(f"--tokenizer {args.tokenizer}: no such folder")
    try:
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager
    except ImportError:
        sys.exit("lm-eval is not installed: pip install 'lm-eval[api]'")

    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"   # nothing may be downloaded
    wait_ready(args.base_url, args.wait)
    model_args = (f"model={args.model},base_url={args.base_url.rstrip('/')}/v1/completions,"
                  f"num_concurrent={args.num_concurrent},max_retries=1,tokenized_requests=True")
    if args.tokenizer:
        model_args += f",tokenizer={os.path.expanduser(args.tokenizer)},tokenizer_backend=huggingface"
    with tempfile.TemporaryDirectory() as tmp:
        n_docs = repeated_task(tmp, args.repeat)
        cwd = os.getcwd()
        os.chdir(tmp)                              # the YAML's data_files path is relative
        try:
            tasks = TaskManager(include_path=tmp)
            t0 = time.perf_counter()
            results = simple_evaluate(model="local-completions", model_args=model_args, tasks=[TASK],
                                      task_manager=tasks, num_fewshot=0, batch_size=1)
            wall = time.perf_counter() - t0
        finally:
            os.chdir(cwd)
    acc = results["results"][TASK]["acc,none"]
    n_req = sum(len(json.loads(line)["choices"]) for line in
                (TASK_DIR / "capitals.jsonl").read_text().splitlines()) * args.repeat
    print(f"lm-eval {TASK}: {n_docs} questions, {n_req} loglikelihood requests, acc {acc:.3f}")
    print(f"wall time {wall:.2f} s ({n_req / wall:.1f} requests/s) against {args.base_url} (model {args.model})")
    print("command: python benchmarks/lm_eval_wall.py " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
