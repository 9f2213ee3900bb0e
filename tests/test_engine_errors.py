"""Bad input gets a clear ValueError, changes nothing, and the engine keeps working."""
import json
import os
import shutil

import pytest

from tokenfab import LLM, SamplingParams
from tokenfab.model.loader import ModelLoadError, load_model_files

OK = SamplingParams(max_tokens=4, temperature=0)


def assert_still_usable(llm):
    out = llm.generate("Hello", OK)[0]
    assert len(out.outputs[0].token_ids) >= 1
    assert llm.engine.block_manager.num_used_blocks() == 0
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("prompt, message", [
    ("", "prompt is empty"),
    ([], "non-empty"),
    ([1, 2, 10**9], "not in [0, 49152)"),
    ([1, -5], "not in"),
])
def test_bad_prompt_is_rejected_and_engine_stays_usable(bundled_llm, prompt, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        bundled_llm.generate([prompt], OK)
    assert_still_usable(bundled_llm)


def test_prompt_longer_than_max_model_len_names_both_numbers(bundled_llm):
    ids = [28] * 3000
    with pytest.raises(ValueError, match=r"prompt has 3000 tokens but max_model_len is 2048"):
        bundled_llm.generate([ids], OK)
    assert_still_usable(bundled_llm)


def test_bad_prompt_in_a_batch_queues_nothing(bundled_llm):
    with pytest.raises(ValueError):
        bundled_llm.generate(["fine", ""], OK)
    assert not bundled_llm.engine.has_unfinished_requests()
    assert_still_usable(bundled_llm)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=-1), "max_tokens must be an integer >= 0"),   # 0 scores the prompt only
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.5), "temperature must be a number >= 0"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=-7), "top_k"),
    (dict(n=0), "n must be"),
    (dict(logprobs=99), "logprobs"),
    (dict(temperature=float("nan")), "temperature"),
])
def test_bad_sampling_values_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_unknown_sampling_parameter_is_named():
    with pytest.raises(ValueError, match="unknown sampling parameter.*'temprature'"):
        SamplingParams.from_kwargs(temprature=0.5)


def test_unknown_engine_option_is_named():
    with pytest.raises(ValueError, match="unknown engine option.*'max_num_seq'"):
        LLM(max_num_seq=4)


def test_max_tokens_is_clamped_to_the_context_and_finishes_by_length(bundled_llm):
    ids = [28] * 2040
    out = bundled_llm.generate([ids], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 2048 - 2040
    assert out.outputs[0].finish_reason == "length"


def test_missing_model_file_is_one_line_naming_it(tmp_path):
    path = str(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError, match="nope.gguf: no such file"):
        load_model_files(path)


def test_truncated_gguf_names_file_and_problem(tmp_path, bundled_path):
    path = tmp_path / "cut.gguf"
    with open(bundled_path, "rb") as src:
        path.write_bytes(src.read(1_000_000))
    with pytest.raises(ModelLoadError) as e:
        load_model_files(str(path))
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_garbage_file_is_not_a_gguf(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"this is not a model" * 100)
    with pytest.raises(ModelLoadError, match="junk.gguf: not a readable GGUF file"):
        load_model_files(str(path))


def test_unsupported_architecture_in_hf_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        load_model_files(str(tmp_path))


def test_hf_folder_without_weights(tmp_path, bundled_tokenizer):
    from tests.oracle import TINY_CONFIGS
    cfg = dict(TINY_CONFIGS["llama"], vocab_size=100, model_type="llama")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model_files(str(tmp_path))


def test_corrupt_safetensors_names_file(tmp_path, bundled_tokenizer):
    from tests.oracle import make_tiny_model
    make_tiny_model("llama", str(tmp_path), bundled_tokenizer)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match="model.safetensors: cannot read safetensors"):
        load_model_files(str(tmp_path))


def test_prompt_that_can_never_fit_in_the_pool_is_rejected_not_hung(bundled_files):
    llm = LLM(loaded=bundled_files, quantization="none", num_kv_blocks=4, block_size=16)
    with pytest.raises(ValueError, match=r"prompt has 100 tokens but max_model_len is 64, limited by the KV pool"):
        llm.generate([[28] * 100], OK)
    # A prompt that fits runs to the pool's limit and stops by length instead of waiting forever.
    out = llm.generate([[28] * 60], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 4
    assert llm.engine.block_manager.num_used_blocks() == 0


def test_without_chunked_prefill_a_prompt_over_the_step_budget_is_rejected_not_hung(bundled_files):
    llm = LLM(loaded=bundled_files, quantization="none", enable_chunked_prefill=False, max_num_batched_tokens=64,
              num_kv_blocks=32, block_size=16)
    with pytest.raises(ValueError, match=r"prompt has 100 tokens but max_model_len is 64, limited by the token "
                                         r"budget of 64 per step \(chunked prefill is off\)"):
        llm.generate([[28] * 100], OK)
    out = llm.generate([[28] * 60], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 4
    assert llm.engine.block_manager.num_used_blocks() == 0


@pytest.mark.parametrize("kwargs", [dict(temperature=float("inf")), dict(temperature=1e300),
                                    dict(repetition_penalty=1e-132), dict(repetition_penalty=float("inf")),
                                    dict(top_p=float("inf")), dict(min_p=float("nan"))])
def test_sampling_values_that_would_make_logits_non_finite_are_rejected(kwargs):
    # found by the API fuzz test: repetition_penalty 5e-132 turned logits into inf and drew an id past the vocabulary
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)
