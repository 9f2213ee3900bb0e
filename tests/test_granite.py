"""Granite: the Llama decoder with four multipliers (embedding, residual, attention, logits), run through the
unchanged decoder by carrying the residual stream divided by the residual multiplier (model/families/granite.py),
checked against transformers' Granite and read from GGUF metadata as llama.cpp names it."""
import pytest
import torch

from tests.oracle import FAMILY_PROMPTS, assert_greedy_matches_transformers, make_tiny_model, write_gguf_metadata
from tokenfab import LLM, kernels
from tokenfab.model.config import ModelConfig


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_tiny_granite_matches_transformers_batched_and_alone(tmp_path, bundled_tokenizer, monkeypatch, cpu_kernels):
    if not cpu_kernels:            # the portable torch path (what CUDA runs)
        monkeypatch.setattr(kernels, "usable", lambda *tensors: False)
    hf = make_tiny_model("granite", str(tmp_path), bundled_tokenizer)
    llm = LLM(model=str(tmp_path), max_model_len=512, num_kv_blocks=64)
    cfg = llm.engine.model.config
    assert cfg.arch == "granite" and cfg.logits_scaling == 8.0 and cfg.attn_scale == 0.015625
    assert_greedy_matches_transformers(llm, hf)
    # the logits too, not only their argmax: logits_scaling divides them
    from tokenfab.model.llama import full_logits
    ids = FAMILY_PROMPTS[1]
    with torch.inference_mode():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(full_logits(llm.engine.model, ids), ref, rtol=1e-3, atol=1e-3 * float(ref.abs().max()))


def test_granite_multipliers_survive_a_config_round_trip():
    from tokenfab.quant.export import hf_config_dict
    raw = dict(model_type="granite", vocab_size=10, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
               num_attention_heads=4, rms_norm_eps=1e-6, embedding_multiplier=12.0, residual_multiplier=0.25,
               attention_multiplier=0.5, logits_scaling=4.0)
    cfg = ModelConfig.from_hf(raw)
    assert cfg.embed_scale == 48.0 and cfg.rms_norm_eps == pytest.approx(1.6e-5) and cfg.logits_scaling == 4.0
    assert ModelConfig.from_hf(hf_config_dict(cfg)) == cfg
    with pytest.raises(ValueError, match="mlp_bias"):
        ModelConfig.from_hf({**raw, "mlp_bias": True})


def test_granite_gguf_metadata(tmp_path):
    from tokenfab.model.loader import gguf_config, open_gguf
    path = tmp_path / "granite.gguf"
    write_gguf_metadata(path, "granite", {"granite.embedding_scale": 12.0, "granite.residual_scale": 0.25,
                                          "granite.attention.scale": 0.5, "granite.logit_scale": 4.0,
                                          "granite.attention.layer_norm_rms_epsilon": 1e-6})
    cfg = gguf_config(open_gguf(str(path)), str(path))
    assert (cfg.arch, cfg.embed_scale, cfg.attn_scale, cfg.logits_scaling) == ("granite", 48.0, 0.5, 4.0)
    assert cfg.rms_norm_eps == pytest.approx(1.6e-5)
