"""Phi-3 / Phi-4-mini: fused qkv and gate_up split on load, RoPE on part of each head (the loader's row move plus
tables that pass the rest through), longrope's two factor sets, a sliding window on every layer; against
transformers' Phi3 on the C kernels and the portable torch path, and read from GGUF as llama.cpp writes it."""
import numpy as np
import pytest
import torch

from tests.oracle import assert_greedy_matches_transformers, make_tiny_model, write_gguf_tensors
from tokenfab import LLM, kernels


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_tiny_phi3_matches_transformers_within_the_original_context(tmp_path, bundled_tokenizer, monkeypatch,
                                                                    cpu_kernels):
    """64 positions served (the original context): the short factors, as transformers uses up to there."""
    if not cpu_kernels:
        monkeypatch.setattr(kernels, "usable", lambda *tensors: False)
    hf = make_tiny_model("phi3", str(tmp_path), bundled_tokenizer)
    llm = LLM(model=str(tmp_path), max_model_len=64, num_kv_blocks=32)
    cfg = llm.engine.model.config
    assert (cfg.arch, cfg.rotary_dim, cfg.rope_scaling["rope_type"]) == ("phi3", 8, "longrope")
    assert_greedy_matches_transformers(llm, hf, prompts=[[5, 17, 300, 4000, 99, 12], list(range(100, 140))])


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_tiny_phi3_past_the_original_context_takes_the_long_factors_and_its_window(tmp_path, bundled_tokenizer,
                                                                                 monkeypatch, cpu_kernels):
    """512 positions served: the long factors, which transformers uses once a sequence passes 64 (prompts of
    70 and 90 tokens are past it from the first step); 12 of 16 dimensions rotated; a 48-token window."""
    if not cpu_kernels:
        monkeypatch.setattr(kernels, "usable", lambda *tensors: False)
    hf = make_tiny_model("phi3-window", str(tmp_path), bundled_tokenizer)
    llm = LLM(model=str(tmp_path), max_model_len=512, num_kv_blocks=64)
    cfg = llm.engine.model.config
    assert cfg.rotary_dim == 12 and cfg.sliding_window == 48 and all(cfg.sliding_layers)
    assert_greedy_matches_transformers(llm, hf, prompts=[list(range(200, 270)), list(range(1000, 1090))])


def test_partial_rotary_rows_pair_hf_halves_where_rotate_half_pairs_them():
    from tokenfab.model.loader import partial_rotary_rows
    perm = partial_rotary_rows(16, 12).tolist()
    assert sorted(perm) == list(range(16))
    # rotated pairs (j, j + 6) of HF's first 12 rows land at (j, j + 8); the 4 passed-through rows fill the rest
    assert [perm[j] for j in range(6)] == list(range(6)) and [perm[8 + j] for j in range(6)] == list(range(6, 12))
    assert sorted(perm[6:8] + perm[14:]) == [12, 13, 14, 15]


def _write_phi3_gguf(path, hf, q8_qkv: bool) -> None:
    """The tiny HF Phi-3 as llama.cpp's converter writes it: fused attn_qkv and ffn_up, rope.dimension_count the
    rotated width, the longrope factors as tensors, the original context and attention factor as metadata."""
    import gguf
    cfg = hf.config
    w = gguf.GGUFWriter(str(path), "phi3")
    rope = cfg.rope_parameters
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    for key, value in {"phi3.block_count": cfg.num_hidden_layers, "phi3.embedding_length": cfg.hidden_size,
                       "phi3.feed_forward_length": cfg.intermediate_size,
                       "phi3.attention.head_count": cfg.num_attention_heads,
                       "phi3.attention.head_count_kv": cfg.num_key_value_heads,
                       "phi3.context_length": cfg.max_position_embeddings,
                       "phi3.rope.dimension_count": int(head_dim * rope["partial_rotary_factor"]),
                       "phi3.rope.scaling.original_context_length": rope["original_max_position_embeddings"],
                       "phi3.attention.sliding_window": cfg.sliding_window or 0}.items():
        w.add_uint32(key, value)
    w.add_float32("phi3.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32("phi3.rope.freq_base", rope["rope_theta"])
    w.add_float32("phi3.rope.scaling.attn_factor", 1.25)
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"],
               "rope_factors_long.weight": np.array(rope["long_factor"], np.float32),
               "rope_factors_short.weight": np.array(rope["short_factor"], np.float32)}
    if "lm_head.weight" in sd and not cfg.tie_word_embeddings:
        tensors["output.weight"] = sd["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors.update({f"blk.{i}.attn_qkv.weight": sd[p + "self_attn.qkv_proj.weight"],
                        f"blk.{i}.attn_output.weight": sd[p + "self_attn.o_proj.weight"],
                        f"blk.{i}.ffn_up.weight": sd[p + "mlp.gate_up_proj.weight"],
                        f"blk.{i}.ffn_down.weight": sd[p + "mlp.down_proj.weight"],
                        f"blk.{i}.attn_norm.weight": sd[p + "input_layernorm.weight"],
                        f"blk.{i}.ffn_norm.weight": sd[p + "post_attention_layernorm.weight"]})
    q8 = gguf.GGMLQuantizationType.Q8_0
    write_gguf_tensors(w, tensors, lambda name, array: (gguf.quants.quantize(array, q8), q8)
                       if q8_qkv and name.endswith("attn_qkv.weight") else None)


def test_phi3_gguf_gives_the_hf_folders_tensors_and_config(tmp_path, bundled_tokenizer):
    """Float tensors equal the HF folder's after both are split and moved; Q8_0 blocks of the fused qkv are
    split and moved by rows as their float rows are (bit for bit once dequantized)."""
    import gguf

    from tokenfab.model.loader import gguf_config, load_gguf_weights, load_hf_folder, open_gguf, to_decoder_layout
    hf = make_tiny_model("phi3-window", str(tmp_path / "hf"), bundled_tokenizer)
    hcfg, hw, _ = load_hf_folder(str(tmp_path / "hf"))
    to_decoder_layout(hcfg, hw, {})
    for q8 in (False, True):
        path = tmp_path / f"phi3-{q8}.gguf"
        _write_phi3_gguf(path, hf, q8)
        reader = open_gguf(str(path))
        cfg = gguf_config(reader, str(path))
        weights, _, raw = load_gguf_weights(reader, cfg, str(path))
        to_decoder_layout(cfg, weights, raw)
        assert (cfg.head_dim, cfg.rotary_dim, cfg.sliding_window) == (16, 12, 48)
        assert cfg.rope_scaling["rope_type"] == "longrope" and cfg.rope_scaling["attention_factor"] == 1.25
        assert cfg.rope_scaling["long_factor"] == pytest.approx(hcfg.rope_scaling["long_factor"])
        assert cfg.rope_scaling["original_max_position_embeddings"] == 64
        for name, t in hw.items():
            if "embed" in name or "lm_head" in name:
                continue
            got = weights[name]
            tol = 2e-2 * float(t.abs().max()) if q8 and ("q_proj" in name or "k_proj" in name or "v_proj" in name) else 1e-6
            assert got.shape == t.shape and float((got - t).abs().max()) <= tol, name
        if q8:
            for proj in ("q_proj", "k_proj", "v_proj"):
                name = f"model.layers.1.self_attn.{proj}.weight"
                kind, blocks = raw[name]
                assert kind == "Q8_0"
                deq = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0)
                assert torch.equal(torch.from_numpy(np.ascontiguousarray(deq)).float(), weights[name]), proj
