"""gpt-oss (model/families/gpt_oss.py): attention sinks against a reference softmax, its routing, and the tiny
random model against transformers through the engine (paged KV, batched, prompts and decodes past the
sliding window, chunked prefill) from an HF folder, from the original checkpoint's MXFP4 experts, and from
GGUF files as llama.cpp's converter writes them (float and MXFP4 experts); the configs refused by name."""
import json

import gguf
import numpy as np
import pytest
import torch

from tests.oracle import FAMILY_PROMPTS, assert_greedy_matches_transformers, make_tiny_model
from tests.test_moe import _gguf_files, _quantize
from tokenfab import LLM, kernels
from tokenfab.model.attention import sink_attention
from tokenfab.model.loader import ModelLoadError, load_hf_folder
from tokenfab.model.moe import route

LONG = list(range(100, 160))            # 60 tokens: past the tiny model's window of 16


# ---- the pieces ------------------------------------------------------------------------------------------

def test_sink_attention_adds_the_sink_to_the_denominator_only():
    """Against the formula written out per head and query: p_j = e^{s_j} / (sum_i e^{s_i} + e^{sink}), with
    grouped KV heads and a mask that hides some keys."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    mask = torch.ones(2, 1, 3, 5, dtype=torch.bool)
    mask[0, 0, :, :2] = False
    out = sink_attention(q, k, v, mask, 0.3, sinks)
    want = torch.zeros_like(out)
    for b in range(2):
        for h in range(4):
            for i in range(3):
                keep = mask[b, 0, i]
                s = (q[b, h, i] @ k[b, h // 2].T * 0.3)[keep]
                p = s.exp() / (s.exp().sum() + sinks[h].exp())
                want[b, h, i] = p @ v[b, h // 2][keep]
    assert torch.allclose(out, want, atol=1e-6)
    # a sink of -inf is plain attention
    plain = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    assert torch.allclose(sink_attention(q, k, v, mask, 0.3, torch.full((4,), -float("inf"))), plain, atol=1e-6)


def test_route_topk_then_softmax_weighs_the_k_largest_logits_by_their_own_softmax():
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0]])
    w, e = route(logits, 2, normalize=False, topk_then_softmax=True)
    assert e.tolist() == [[2, 3]]
    assert torch.allclose(w, torch.softmax(torch.tensor([[3.0, 2.0]]), -1))
    assert not torch.allclose(w, route(logits, 2, normalize=False)[0])       # not the full softmax's values


# ---- against transformers --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory, bundled_tokenizer):
    folder = tmp_path_factory.mktemp("gpt_oss")
    return str(folder), make_tiny_model("gpt_oss", str(folder), bundled_tokenizer)


@pytest.mark.parametrize("cpu_kernels", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_tiny_gpt_oss_matches_transformers_alone_and_batched(tiny_gpt_oss, monkeypatch, cpu_kernels):
    """The short prompt's decodes and the long prompt's prefill both pass the window of 16."""
    if not cpu_kernels:
        monkeypatch.setattr(kernels, "usable", lambda *tensors: False)
    folder, hf = tiny_gpt_oss
    llm = LLM(model=folder, max_model_len=128, num_kv_blocks=32)
    cfg = llm.engine.model.config
    assert (cfg.arch, cfg.num_experts, cfg.experts_per_token, cfg.hidden_act) == ("gpt-oss", 4, 2, "swiglu_oai")
    assert cfg.sliding_layers == [True, False, True] and cfg.sliding_window == 16 and cfg.swiglu_limit == 1.5
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["truncate"] is False
    assert len(LONG) > cfg.sliding_window and LONG in FAMILY_PROMPTS
    assert_greedy_matches_transformers(llm, hf, new_tokens=12)


def test_tiny_gpt_oss_chunked_prefill_past_the_window_matches_transformers(tiny_gpt_oss):
    """Prefill chunks of 8 tokens: each chunk's sink attention reads the cached context (and only the
    window's part of it on the sliding layers)."""
    folder, hf = tiny_gpt_oss
    llm = LLM(model=folder, max_model_len=128, num_kv_blocks=32, max_num_batched_tokens=8, max_num_seqs=2)
    assert_greedy_matches_transformers(llm, hf, prompts=[LONG, [5, 17, 300, 4000, 99, 12]], new_tokens=8)


def _write_gpt_oss_gguf(path, hf, expert_type: str = "F32") -> None:
    """The tiny HF model as convert_hf_to_gguf.py's GptOssModel writes it (arch `gpt-oss`): no Q/K
    permutation, biases on q/k/v/o, `attn_sinks`, `post_attention_norm`, the router as `ffn_gate_inp` with
    its bias, each layer's experts transposed to [experts, rows, columns] with gate and up de-interleaved
    (`ffn_gate_exps` / `ffn_up_exps` / `ffn_down_exps`, their biases [experts, rows]), the sliding window,
    the experts' width and YaRN's factor and original context in the metadata; `expert_type`: F32 or MXFP4
    (the stacked weights; biases stay F32)."""
    cfg, arch = hf.config, "gpt-oss"
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in {"block_count": cfg.num_hidden_layers, "embedding_length": cfg.hidden_size,
                       "feed_forward_length": cfg.intermediate_size, "attention.head_count": cfg.num_attention_heads,
                       "attention.head_count_kv": cfg.num_key_value_heads, "attention.key_length": cfg.head_dim,
                       "attention.value_length": cfg.head_dim, "context_length": cfg.max_position_embeddings,
                       "expert_count": cfg.num_local_experts, "expert_used_count": cfg.num_experts_per_tok,
                       "expert_feed_forward_length": cfg.intermediate_size,
                       "attention.sliding_window": cfg.sliding_window,
                       "rope.scaling.original_context_length":
                           cfg.rope_parameters["original_max_position_embeddings"]}.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope_parameters["rope_theta"])
    w.add_string(f"{arch}.rope.scaling.type", "yarn")
    w.add_float32(f"{arch}.rope.scaling.factor", cfg.rope_parameters["factor"])
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"],
               "output.weight": sd["lm_head.weight"]}
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")):
            tensors[f"{b}{ours}.weight"] = sd[f"{p}self_attn.{theirs}.weight"]
            tensors[f"{b}{ours}.bias"] = sd[f"{p}self_attn.{theirs}.bias"]
        gate_up = np.ascontiguousarray(sd[p + "mlp.experts.gate_up_proj"].transpose(0, 2, 1))   # [E, 2I, H]
        gate_up_bias = sd[p + "mlp.experts.gate_up_proj_bias"]
        tensors.update({
            f"{b}attn_sinks.weight": sd[p + "self_attn.sinks"],
            f"{b}attn_norm.weight": sd[p + "input_layernorm.weight"],
            f"{b}post_attention_norm.weight": sd[p + "post_attention_layernorm.weight"],
            f"{b}ffn_gate_inp.weight": sd[p + "mlp.router.weight"], f"{b}ffn_gate_inp.bias": sd[p + "mlp.router.bias"],
            f"{b}ffn_gate_exps.weight": np.ascontiguousarray(gate_up[:, 0::2]),
            f"{b}ffn_up_exps.weight": np.ascontiguousarray(gate_up[:, 1::2]),
            f"{b}ffn_down_exps.weight": np.ascontiguousarray(sd[p + "mlp.experts.down_proj"].transpose(0, 2, 1)),
            f"{b}ffn_gate_exps.bias": np.ascontiguousarray(gate_up_bias[:, 0::2]),
            f"{b}ffn_up_exps.bias": np.ascontiguousarray(gate_up_bias[:, 1::2]),
            f"{b}ffn_down_exps.bias": sd[p + "mlp.experts.down_proj_bias"]})
    for name, array in tensors.items():
        if expert_type != "F32" and name.endswith("_exps.weight"):
            w.add_tensor(name, _quantize(array, expert_type), raw_dtype=gguf.GGMLQuantizationType[expert_type])
        else:
            w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _round_experts_through_mxfp4(hf) -> None:
    """The HF model's expert weights replaced by their MXFP4 round trip (gguf's quantizer, 32 values per
    block along the input dimension), so that it holds what an MXFP4 file gives back."""
    def rounded(rows_by_cols: torch.Tensor) -> torch.Tensor:      # [E, rows, cols]
        flat = rows_by_cols.reshape(-1, rows_by_cols.shape[-1]).numpy()
        q = gguf.quants.quantize(flat, gguf.GGMLQuantizationType.MXFP4)
        return torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.MXFP4)).reshape(rows_by_cols.shape)

    with torch.no_grad():
        for layer in hf.model.layers:
            x = layer.mlp.experts
            x.gate_up_proj.copy_(rounded(x.gate_up_proj.transpose(1, 2).contiguous()).transpose(1, 2))
            x.down_proj.copy_(rounded(x.down_proj.transpose(1, 2).contiguous()).transpose(1, 2))


@pytest.mark.parametrize("expert_type", [pytest.param("F32", marks=pytest.mark.slow), "MXFP4"])
def test_gpt_oss_gguf_as_llama_cpp_writes_it_matches_transformers(tmp_path, bundled_tokenizer, expert_type, caplog):
    hf = make_tiny_model("gpt_oss", str(tmp_path / "hf"), bundled_tokenizer)
    if expert_type == "MXFP4":
        _round_experts_through_mxfp4(hf)
    path = tmp_path / "m.gguf"
    _write_gpt_oss_gguf(path, hf, expert_type)
    with caplog.at_level("WARNING"):
        files = _gguf_files(path, bundled_tokenizer)
    assert ("MXFP4 tensors are dequantized to float at load" in caplog.text) == (expert_type == "MXFP4")
    assert files.file_dtypes.get("MXFP4", 0) == (3 * 3 if expert_type == "MXFP4" else 0)
    cfg = files.config
    assert (cfg.arch, cfg.num_experts, cfg.experts_per_token, cfg.sliding_layers) == ("gpt-oss", 4, 2, [True, False, True])
    assert cfg.attn_sinks and cfg.o_bias and cfg.qkv_bias and cfg.expert_bias and cfg.router_bias
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 32,
                                "truncate": False}
    cfg.swiglu_limit = hf.config.swiglu_limit     # the tiny model's limit: a GGUF file carries none (7.0 is gpt-oss's)
    llm = LLM(max_model_len=128, num_kv_blocks=32, loaded=files)
    assert_greedy_matches_transformers(llm, hf, new_tokens=8)


def test_the_original_checkpoints_mxfp4_experts_load_as_transformers_dequantizes_them(tmp_path, bundled_tokenizer):
    """openai/gpt-oss-* ship their experts as `*_blocks` (uint8 [E, rows, G, 16]) and `*_scales` (uint8
    [E, rows, G]) with quantization_config mxfp4: they read as transformers' own dequantization gives them."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    hf = make_tiny_model("gpt_oss", str(tmp_path), bundled_tokenizer)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            x = layer.mlp.experts
            for proj in ("gate_up_proj", "down_proj"):
                rows, cols = getattr(x, proj).shape[2], getattr(x, proj).shape[1]
                blocks = torch.randint(0, 256, (4, rows, cols // 32, 16), dtype=torch.uint8, generator=gen)
                scales = torch.randint(122, 126, (4, rows, cols // 32), dtype=torch.uint8, generator=gen)
                getattr(x, proj).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                p = f"model.layers.{i}.mlp.experts.{proj}"
                del sd[p]
                sd[p + "_blocks"], sd[p + "_scales"] = blocks, scales
    (tmp_path / "model.safetensors").unlink()
    save_file(sd, str(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert_greedy_matches_transformers(LLM(model=str(tmp_path), max_model_len=128, num_kv_blocks=32), hf,
                                       prompts=[[5, 17, 300, 4000, 99, 12], LONG], new_tokens=8)


# ---- what is refused ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("change,message", [
    (dict(layer_types=["sliding_attention", "chunked_attention", "full_attention"]), "layer_types must name"),
    (dict(layer_types=["sliding_attention"]), "for each of the 3 layers"),
    (dict(quantization_config={"quant_method": "awq"}), "unsupported quantization_config 'awq'"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok=5 must be between 1 and num_experts=4"),
])
def test_gpt_oss_configs_it_cannot_run_are_refused_by_name(tmp_path, change, message):
    cfg = {**dict(model_type="gpt_oss", vocab_size=100, hidden_size=64, intermediate_size=32, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                  num_experts_per_tok=2), **change}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=message):
        load_hf_folder(str(tmp_path))
