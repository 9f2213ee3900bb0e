"""SmolLM3: the Llama decoder with no RoPE on every 4th layer, run through every RoPE path with tables that
rotate nothing (RotaryEmbedding.identity): against transformers' SmolLM3, on the C decode stack and on the
layer-by-layer torch path, and read from GGUF as llama.cpp does (its constant step of 4)."""
import pytest

from tests.oracle import (FAMILY_PROMPTS, assert_greedy_matches_transformers, hf_greedy, make_tiny_model,
                          write_gguf_metadata)
from tokenfab import LLM, SamplingParams, kernels


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_tiny_smollm3_matches_transformers_batched_and_alone(tmp_path, bundled_tokenizer, monkeypatch, cpu_kernels):
    if not cpu_kernels:            # the portable torch path (what CUDA runs)
        monkeypatch.setattr(kernels, "usable", lambda *tensors: False)
    hf = make_tiny_model("smollm3", str(tmp_path), bundled_tokenizer)
    llm = LLM(model=str(tmp_path), max_model_len=512, num_kv_blocks=64)
    model = llm.engine.model
    assert model.config.nope_layers == [False, False, False, True] and model.rope_none is not None
    assert_greedy_matches_transformers(llm, hf)


def test_smollm3_gguf_takes_llama_cpps_nope_step(tmp_path):
    from tokenfab.model.loader import gguf_config, open_gguf
    path = tmp_path / "smollm3.gguf"
    write_gguf_metadata(path, "smollm3", {"smollm3.block_count": 8})
    cfg = gguf_config(open_gguf(str(path)), str(path))
    assert cfg.arch == "smollm3" and [i for i in range(8) if cfg.is_nope(i)] == [3, 7]


@pytest.mark.skipif(not kernels.enabled(), reason="tokenfab's C kernels are not built here")
def test_one_call_decode_stack_runs_the_nope_layers(tmp_path, bundled_tokenizer, monkeypatch):
    """int8 weights (tf_qgemm layouts): decode steps run the whole stack in one tf_decode_layers call, the
    NoPE layer reading the third view's tables; tokens equal transformers on the weights the int8 layers
    represent, and the layer-by-layer path's."""
    from tests.test_gemma3 import _dequantized_hf
    hf = make_tiny_model("smollm3", str(tmp_path), bundled_tokenizer)
    llm = LLM(model=str(tmp_path), quantization="int8", attention_backend="cpu", kernel_autotune=False,
              max_model_len=512, num_kv_blocks=64)
    backend = llm.engine.model.attention_backend
    calls = []
    decode_layers = kernels.decode_layers
    monkeypatch.setattr(kernels, "decode_layers", lambda x, *a, **k: (calls.append(x.shape[0]), decode_layers(x, *a, **k)))
    prompts = FAMILY_PROMPTS
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    stacked = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert backend.stack_rows > 0 and calls, "the decodes missed the stack"
    ref = _dequantized_hf(hf, llm.engine.model)
    assert stacked == [hf_greedy(ref, p, 24) for p in prompts]
    backend.fused_decode = False                     # the same steps, layer by layer
    calls.clear()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == stacked and not calls


def test_smollm3_config_round_trip():
    from tokenfab.model.config import ModelConfig
    from tokenfab.quant.export import hf_config_dict
    cfg = ModelConfig.from_hf(dict(model_type="smollm3", vocab_size=10, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=6, num_attention_heads=4, no_rope_layers=[1, 0, 1, 1, 0, 1]))
    assert [i for i in range(6) if cfg.is_nope(i)] == [1, 4]
    assert ModelConfig.from_hf(hf_config_dict(cfg)) == cfg
