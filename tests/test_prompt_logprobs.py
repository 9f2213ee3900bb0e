"""Prompt logprobs (SamplingParams.prompt_logprobs) against transformers' log-softmax, float32.

A tiny random Llama (HF folder) is the model: its logits are those of transformers up to float
rounding, so every prompt token's logprob must match within 1e-4, whether the prompt runs in one
prefill, in chunks, or after a prefix-cache hit, and whatever else is in the batch.
"""
from __future__ import annotations

import pytest
import torch

from tests.oracle import make_tiny_model
from tokenfab import LLM, SamplingParams

pytestmark = pytest.mark.timeout(300)

PROMPT = [5, 17, 300, 4000, 99, 12, *range(100, 150), 7, 8, 9]   # 59 tokens: several 16-token blocks
TOP = 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, bundled_tokenizer):
    folder = tmp_path_factory.mktemp("tiny-llama")
    hf = make_tiny_model("llama", str(folder), bundled_tokenizer)
    return str(folder), hf


@pytest.fixture(scope="module")
def hf_logprobs(tiny):
    _, hf = tiny
    with torch.inference_mode():
        logits = hf(input_ids=torch.tensor([PROMPT])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)   # row p scores token p + 1


def _check(prompt_logprobs, ref: torch.Tensor, top: int = TOP) -> None:
    assert prompt_logprobs[0] is None
    assert len(prompt_logprobs) == len(PROMPT)
    for i in range(1, len(PROMPT)):
        entry, row, tok = prompt_logprobs[i], ref[i - 1], PROMPT[i]
        assert abs(entry[tok].logprob - row[tok].item()) < 1e-4, i
        # rank: 1 + tokens more likely, up to tokens within float rounding of it
        assert int((row > row[tok] + 1e-4).sum()) + 1 <= entry[tok].rank <= int((row > row[tok] - 1e-4).sum()) + 1
        top_v, top_i = row.topk(top)
        for v, t in zip(top_v.tolist(), top_i.tolist()):
            assert abs(entry[t].logprob - v) < 1e-4
        assert set(entry) <= set(top_i.tolist()) | {tok}


def _llm(folder: str, **kw) -> LLM:
    return LLM(model=folder, max_model_len=256, num_kv_blocks=64, block_size=16, **kw)


def test_prompt_logprobs_in_one_pass_equal_transformers_log_softmax(tiny, hf_logprobs):
    llm = _llm(tiny[0])
    out = llm.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=TOP), use_tqdm=False)[0]
    _check(out.prompt_logprobs, hf_logprobs)
    assert len(out.outputs[0].token_ids) == 2
    assert llm.engine.block_manager.num_used_blocks() == 0


def test_prompt_logprobs_over_chunked_prefill_equal_one_pass(tiny, hf_logprobs):
    # 8-token budget: the 59-token prompt runs in 8 chunks, beside a second request sharing the steps.
    llm = _llm(tiny[0], max_num_batched_tokens=8)
    outs = llm.generate([PROMPT, [3, 4, 5, 6, 7, 8, 9, 10, 11]],
                        [SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=TOP),
                         SamplingParams(max_tokens=3, temperature=0)], use_tqdm=False)
    _check(outs[0].prompt_logprobs, hf_logprobs)
    assert outs[1].prompt_logprobs is None
    assert llm.engine.block_manager.num_used_blocks() == 0


def test_prompt_logprobs_after_a_prefix_cache_hit_are_recomputed_and_equal(tiny, hf_logprobs):
    llm = _llm(tiny[0], enable_prefix_caching=True)
    warm = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)[0]
    assert warm.num_cached_tokens == 0
    # The cache now holds the prompt's full blocks; the scoring request recomputes them.
    scored = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0),
                          use_tqdm=False)[0]
    _check(scored.prompt_logprobs, hf_logprobs, top=0)
    assert scored.num_cached_tokens == 0
    # ... and still leaves its blocks cached for requests that do not score the prompt.
    again = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)[0]
    assert again.num_cached_tokens == 48
    assert llm.engine.block_manager.num_used_blocks() == 0


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(tiny, hf_logprobs):
    llm = _llm(tiny[0], max_num_batched_tokens=16)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=0, prompt_logprobs=1), use_tqdm=False)[0]
    _check(out.prompt_logprobs, hf_logprobs, top=1)
    assert out.outputs[0].token_ids == [] and out.outputs[0].text == ""
    assert out.outputs[0].finish_reason == "length"
    assert llm.engine.block_manager.num_used_blocks() == 0


def test_prompt_logprobs_survive_preemption_without_duplicates(tiny, hf_logprobs):
    # 6 blocks of 16 for two 59-token prompts generating 30 tokens each: one is preempted and recomputed.
    llm = LLM(model=tiny[0], max_model_len=96, num_kv_blocks=6, block_size=16, max_num_batched_tokens=16)
    p = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate([PROMPT, PROMPT], p, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for out in outs:
        _check(out.prompt_logprobs, hf_logprobs, top=1)
    assert llm.engine.block_manager.num_used_blocks() == 0


def test_prompt_logprobs_out_of_range_is_a_value_error():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
