"""Greedy output is token-exact against transformers (float32), on the bundled model and tiny random models."""
import pytest

from tests.oracle import hf_greedy, load_hf_gguf, make_tiny_model
from tokenfab import LLM, SamplingParams, kernels

NEW_TOKENS = 64
RAW_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
CHATS = [[{"role": "user", "content": "Write a short poem about the sea."}],
         [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "List three prime numbers."}]]
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_bundled(bundled_path):
    return load_hf_gguf(bundled_path)


@pytest.fixture(scope="module")
def hf_raw_tokens(bundled_llm, hf_bundled):
    """transformers' greedy tokens for each raw prompt, by prompt: two tests compare against them."""
    ids = [bundled_llm.engine.tokenize(p) for p in RAW_PROMPTS]
    return {p: hf_greedy(hf_bundled, i, NEW_TOKENS) for p, i in zip(RAW_PROMPTS, ids)}


def test_bundled_raw_prompts_match_transformers(bundled_llm, hf_raw_tokens):
    outs = bundled_llm.generate(RAW_PROMPTS, GREEDY)
    for prompt, out in zip(RAW_PROMPTS, outs):
        assert len(out.outputs[0].token_ids) == NEW_TOKENS
        assert out.outputs[0].token_ids == hf_raw_tokens[prompt]


def test_bundled_chat_prompts_match_transformers(bundled_llm, hf_bundled, bundled_tokenizer):
    outs = bundled_llm.chat(CHATS, GREEDY)
    for conv, out in zip(CHATS, outs):
        expected_prompt = bundled_tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        expected_prompt = list(expected_prompt["input_ids"] if hasattr(expected_prompt, "keys") else expected_prompt)
        assert out.prompt_token_ids == expected_prompt
        assert out.outputs[0].token_ids == hf_greedy(hf_bundled, out.prompt_token_ids, NEW_TOKENS)


@pytest.mark.skipif(kernels.f16_pools(64) is not None, reason=f"float16 pools: {kernels.f16_pools(64)}")
def test_bundled_default_float16_pools_keep_greedy_output_equal_to_transformers(bundled_files, hf_raw_tokens):
    # kv_cache_dtype "auto" is float16 on the cpu backend (the others pin float32): K/V rounded to
    # float16 still leave these prompts' 64 greedy tokens as transformers' float32 ones
    import torch
    llm = LLM(max_model_len=2048, num_kv_blocks=256, quantization="none", loaded=bundled_files)
    assert llm.engine.runner.kv.dtype == torch.float16
    for prompt, out in zip(RAW_PROMPTS, llm.generate(RAW_PROMPTS, GREEDY)):
        assert out.outputs[0].token_ids == hf_raw_tokens[prompt]
    assert llm.engine.block_manager.num_used_blocks() == 0


def test_bundled_prompt_tokens_match_transformers_tokenizer(bundled_llm, bundled_path):
    from transformers import AutoTokenizer
    import os
    hf_tok = AutoTokenizer.from_pretrained(os.path.dirname(bundled_path), gguf_file=os.path.basename(bundled_path))
    for p in RAW_PROMPTS + ["naïve café — 日本語 🙂", "  leading spaces\n\ttabs"]:
        assert bundled_llm.engine.tokenize(p) == list(hf_tok(p).input_ids)


@pytest.mark.parametrize("kind,cpu_kernels", [("llama", True), ("qwen2", True), ("qwen3", True), ("mistral", True),
                                              ("llama", False), ("qwen3", False)])
def test_tiny_random_model_matches_transformers(kind, cpu_kernels, tmp_path, bundled_tokenizer, monkeypatch):
    # cpu_kernels False: the portable torch path (what CUDA runs) on CPU
    if not cpu_kernels:
        monkeypatch.setattr(kernels, "usable", lambda *tensors: False)
    hf = make_tiny_model(kind, str(tmp_path), bundled_tokenizer)
    llm = LLM(model=str(tmp_path), max_model_len=512, num_kv_blocks=64)
    prompts = [[5, 17, 300, 4000, 99, 12], list(range(100, 140))]
    outs = llm.generate(prompts, GREEDY)
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, p, NEW_TOKENS)
    assert llm.engine.block_manager.num_used_blocks() == 0
