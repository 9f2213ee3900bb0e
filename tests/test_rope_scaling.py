"""Scaled RoPE (model/rope.py): linear, Llama 3's, YaRN and llama.cpp's per-frequency factors, against
transformers' own frequency functions and its greedy tokens, from HF folders and from GGUF metadata."""
import math

import numpy as np
import pytest
import torch

from tests.oracle import assert_greedy_matches_transformers, make_tiny_model, write_gguf_metadata
from tokenfab import LLM
from tokenfab.model import rope
from tokenfab.model.config import ModelConfig

LLAMA32 = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=8192)              # Llama 3.2's config.json


def _hf_inv_freq(model_type: str, head_dim: int, theta: float, params: dict, max_pos: int = 131072):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    cfg = AutoConfig.for_model(model_type, hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                               max_position_embeddings=max_pos, rope_parameters={**params, "rope_theta": theta})
    return ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu")


@pytest.mark.parametrize("head_dim,theta,params", [
    (64, 500000.0, LLAMA32),
    (128, 500000.0, {**LLAMA32, "factor": 8.0}),                    # Llama 3.1 8B
    (128, 1000000.0, dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768)),  # Qwen2.5
    (64, 10000.0, dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=4096, beta_fast=16,
                       beta_slow=2, attention_factor=1.3)),
    (64, 10000.0, dict(rope_type="yarn", factor=16.0, original_max_position_embeddings=4096, mscale=1.0,
                       mscale_all_dim=0.5, truncate=False)),
    (128, 10000.0, dict(rope_type="linear", factor=8.0)),           # Gemma 3 4B's global layers
])
def test_frequencies_equal_transformers(head_dim, theta, params):
    ref, ref_attn = _hf_inv_freq("llama", head_dim, theta, params)
    inv, attn = rope.inverse_frequencies(head_dim, theta, rope.normalize(params, 131072))
    torch.testing.assert_close(inv, ref.float(), rtol=1e-6, atol=0)
    assert attn == pytest.approx(ref_attn, rel=1e-7)


def test_llama_cpp_rope_freqs_give_llama3s_frequencies():
    """A GGUF file of Llama 3.x carries `rope_freqs.weight`: the divisor of each frequency, computed by
    llama.cpp's converter from the config (its formula, written out here)."""
    head_dim, theta, s = 64, 500000.0, LLAMA32
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    lo_wl, hi_wl = s["original_max_position_embeddings"] / s["low_freq_factor"], \
        s["original_max_position_embeddings"] / s["high_freq_factor"]
    factors = []
    for f in freqs.tolist():
        wl = 2 * math.pi / f
        if wl < hi_wl:
            factors.append(1.0)
        elif wl > lo_wl:
            factors.append(s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wl - s["low_freq_factor"]) / \
                (s["high_freq_factor"] - s["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / s["factor"] + smooth))
    assert 1.0 in factors and s["factor"] in factors and len(set(factors)) > 2     # all three bands
    inv, attn = rope.inverse_frequencies(head_dim, theta, rope.normalize({"rope_type": "freq_factors",
                                                                          "factors": factors}, 0))
    ref, _ = _hf_inv_freq("llama", head_dim, theta, LLAMA32)
    torch.testing.assert_close(inv, ref.float(), rtol=1e-6, atol=0)
    assert attn == 1.0


def test_unsupported_scalings_are_refused_by_name():
    with pytest.raises(ValueError, match=r"unsupported rope scaling 'dynamic'; supported: .*llama3.*yarn.*longrope"):
        ModelConfig.from_hf(dict(model_type="llama", vocab_size=10, hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=1, num_attention_heads=4,
                                 rope_scaling=dict(rope_type="dynamic", factor=2.0)))
    with pytest.raises(ValueError, match="'longrope' needs short_factor"):
        rope.normalize(dict(rope_type="longrope", factor=2.0), 0)
    with pytest.raises(ValueError, match="needs low_freq_factor"):
        rope.normalize(dict(rope_type="llama3", factor=8.0), 0)


@pytest.mark.parametrize("kind", ["llama3-rope", "qwen2-yarn", "llama-linear-rope"])
def test_scaled_rope_models_match_transformers_across_the_original_context(kind, tmp_path, bundled_tokenizer):
    """Greedy tokens equal transformers' in float32, on a short prompt and on one that crosses the
    original context (64 tokens here); batched equals alone."""
    hf = make_tiny_model(kind, str(tmp_path), bundled_tokenizer)
    llm = LLM(model=str(tmp_path), max_model_len=512, num_kv_blocks=64)
    expected = {"llama3-rope": "llama3", "qwen2-yarn": "yarn", "llama-linear-rope": "linear"}[kind]
    assert llm.engine.model.config.rope_scaling["rope_type"] == expected
    assert_greedy_matches_transformers(llm, hf, [[5, 17, 300, 4000, 99, 12], list(range(100, 190))])


def _write_gguf_config(path, extra: dict, rope_freqs=None):
    tensors = {} if rope_freqs is None else {"rope_freqs.weight": np.asarray(rope_freqs, np.float32)}
    write_gguf_metadata(path, "llama", {"llama.attention.head_count_kv": 2, "llama.rope.freq_base": 10000.0, **extra}, tensors)


def test_gguf_rope_scaling_is_read_from_the_file(tmp_path):
    from tokenfab.model.loader import ModelLoadError, gguf_config, open_gguf
    p = tmp_path / "freqs.gguf"
    _write_gguf_config(p, {}, rope_freqs=[1.0] * 4 + [2.0] * 4)
    cfg = gguf_config(open_gguf(str(p)), str(p))
    assert cfg.rope_scaling == {"rope_type": "freq_factors", "factors": [1.0] * 4 + [2.0] * 4}
    p = tmp_path / "yarn.gguf"
    _write_gguf_config(p, {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
                           "llama.rope.scaling.original_context_length": 1024})
    cfg = gguf_config(open_gguf(str(p)), str(p))
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    p = tmp_path / "odd.gguf"
    _write_gguf_config(p, {"llama.rope.scaling.type": "longrope", "llama.rope.scaling.factor": 4.0})
    with pytest.raises(ModelLoadError, match="unsupported rope scaling 'longrope'"):
        gguf_config(open_gguf(str(p)), str(p))


def test_gemma3_scales_its_global_layers_rope_only(tmp_path, bundled_tokenizer):
    """Gemma 3 4B and up: linear scaling (factor 8) on the global layers, the sliding layers' RoPE plain."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig
    cfg = Gemma3TextConfig(vocab_size=len(bundled_tokenizer), hidden_size=64, intermediate_size=128,
                           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           sliding_window=16, max_position_embeddings=1024, initializer_range=0.2,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                           rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                               "rope_theta": 1000000.0},
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                           bos_token_id=bundled_tokenizer.bos_token_id, eos_token_id=bundled_tokenizer.eos_token_id,
                           pad_token_id=0)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    hf.save_pretrained(str(tmp_path))
    bundled_tokenizer.save_pretrained(str(tmp_path))
    llm = LLM(model=str(tmp_path), max_model_len=512, num_kv_blocks=64)
    model = llm.engine.model
    assert model.config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert model.rope_local is not None          # the sliding layers keep an unscaled table
    assert_greedy_matches_transformers(llm, hf, new_tokens=16)
