"""lm-evaluation-harness against the server: `local-completions` on a local multiple-choice task
(tests/data/lm_eval: a jsonl and a task YAML, no download), its tokenizer found through /tokenizer_info.

Every loglikelihood lm-eval computes must equal the offline engine's prompt logprobs within 1e-4.
Skipped when lm-eval (`pip install "lm-eval[api]"`) is not installed.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'lm-eval[api]')")

from tokenfab import SamplingParams  # noqa: E402
from tokenfab.server.app import build_app  # noqa: E402
from tokenfab.server.config import ServerConfig  # noqa: E402
from tokenfab.server.launch import ServerThread  # noqa: E402

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]   # ~2 min here, most of it lm-eval's imports
TASK_DIR = Path(__file__).parent / "data" / "lm_eval"
DOCS = [json.loads(line) for line in (TASK_DIR / "capitals.jsonl").read_text().splitlines()]


def _context(doc: dict) -> str:
    return f"Question: {doc['question']}\nAnswer:"


@pytest.fixture(scope="module")
def expected(bundled_llm, bundled_tokenizer):
    """(context, continuation) -> loglikelihood, from the offline engine, tokenized as lm-eval does it
    (its _encode_pair: encode context + continuation, split at the context's length; no BOS)."""
    enc = lambda text: list(bundled_tokenizer(text, add_special_tokens=False).input_ids)  # noqa: E731
    out = {}
    for doc in DOCS:
        for choice in doc["choices"]:
            ctx, cont = _context(doc), " " + choice
            whole, n_ctx = enc(ctx + cont), len(enc(ctx))
            res = bundled_llm.generate([whole], SamplingParams(max_tokens=0, prompt_logprobs=0), use_tqdm=False)[0]
            out[(ctx, cont)] = sum(res.prompt_logprobs[i][whole[i]].logprob for i in range(n_ctx, len(whole)))
    return out


@pytest.fixture(scope="module")
def server(bundled_llm, expected):
    app = build_app(bundled_llm.engine, ServerConfig(access_log=False))
    with ServerThread(app) as srv:
        yield srv
    assert bundled_llm.engine.block_manager.num_used_blocks() == 0


def test_lm_eval_local_completions_loglikelihoods_equal_the_offline_engine(server, expected, monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")         # nothing may be downloaded: the tokenizer is the server's
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(TASK_DIR)                       # the YAML's data_files path is relative
    results = simple_evaluate(
        model="local-completions",
        model_args=f"model=SmolLM2-135M-Instruct,base_url={server.url}/v1/completions,num_concurrent=1,"
                   "max_retries=1,tokenized_requests=True",
        tasks=["tokenfab_capitals"], task_manager=TaskManager(include_path=str(TASK_DIR)),
        log_samples=True, num_fewshot=0, batch_size=1)
    samples = results["samples"]["tokenfab_capitals"]
    assert len(samples) == len(DOCS)
    for s in samples:
        doc = s["doc"]
        got = [float(r[0]) for r in s["filtered_resps"]]
        want = [expected[(_context(doc), " " + c)] for c in doc["choices"]]
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert abs(g - w) < 1e-4, (doc["question"], got, want)
    acc = results["results"]["tokenfab_capitals"]["acc,none"]
    print(f"lm-eval acc on {len(DOCS)} local questions: {acc:.2f}")
