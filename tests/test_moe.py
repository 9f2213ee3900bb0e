"""Mixture of experts (model/moe.py; families qwen3_moe, mixtral, olmoe): routing, experts grouped per step
against a token-by-token loop, the three families against transformers from HF folders and from GGUF files as
llama.cpp's converter writes them (stacked expert tensors, float and Q8_0), and the configs refused by name."""
import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.oracle import assert_greedy_matches_transformers, make_tiny_model, write_gguf_tensors
from tokenfab import LLM, kernels
from tokenfab.model.config import ModelConfig
from tokenfab.model.llama import MLP
from tokenfab.model.moe import MoE, group_by_expert, route


# ---- the layer --------------------------------------------------------------------------------------------

def _moe(num_experts=6, k=2, hidden=64, inter=32, normalize=True, seed=0) -> MoE:
    cfg = ModelConfig(arch="qwen3moe", vocab_size=8, hidden_size=hidden, intermediate_size=128, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=16)
    cfg.set_experts(num_experts, k, inter, normalize)
    torch.manual_seed(seed)
    moe = MoE(cfg, lambda: MLP(cfg, inter))
    moe.router.data = torch.randn(num_experts, hidden)
    for m in moe.experts:
        m.gate_up_proj.weight.data.normal_(0, 0.2)
        m.down_proj.weight.data.normal_(0, 0.2)
    return moe


def _naive(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: softmax over the router, the top k, each chosen expert on its one row."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(F.linear(x[t], moe.router), dim=-1)
        top = torch.topk(probs, moe.top_k)
        w = top.values / top.values.sum() if moe.normalize else top.values
        for weight, e in zip(w.tolist(), top.indices.tolist()):
            out[t] += weight * moe.experts[e](x[t:t + 1])[0]
    return out


def test_route_renormalises_the_top_k_only_when_asked():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 0.0, 0.0, -1.0]])
    w, e = route(logits, 2, normalize=True)
    assert e.tolist() == [[3, 2], [0, 1]] and torch.allclose(w.sum(-1), torch.ones(2))
    w_raw, _ = route(logits, 2, normalize=False)
    probs = torch.softmax(logits, -1)
    assert torch.allclose(w_raw, torch.stack([probs[0, [3, 2]], probs[1, [0, 1]]]))


def test_group_by_expert_orders_pairs_by_expert_and_counts_each():
    experts = torch.tensor([[2, 0], [2, 1], [0, 2]])
    order, counts = group_by_expert(experts, 4)
    assert counts == [2, 1, 3, 0]
    assert experts.reshape(-1)[order].tolist() == [0, 0, 1, 2, 2, 2]
    assert order.tolist() == [1, 4, 3, 0, 2, 5]        # stable: tokens in order within an expert


@pytest.mark.parametrize("tokens", [1, 7, 64, 512])
@pytest.mark.parametrize("normalize", [True, False])
def test_grouped_experts_equal_a_token_by_token_loop(tokens, normalize):
    moe = _moe(normalize=normalize)
    x = torch.randn(tokens, 64)
    assert torch.allclose(moe(x), _naive(moe, x), atol=1e-5, rtol=1e-4)


def test_each_picked_expert_runs_once_per_step_on_all_its_tokens_and_unpicked_ones_never():
    """Uneven routing: the router's bias sends every token to experts 1 and 4 (1 first), none to the rest."""
    moe = _moe(num_experts=6, k=2)
    moe.router.data[:] = 0
    x = torch.randn(9, 64).abs() + 0.1               # positive rows: a positive router row wins for every token
    moe.router.data[1] = 2.0
    moe.router.data[4] = 1.0
    calls = {}
    for e, m in enumerate(moe.experts):
        m.register_forward_hook(lambda mod, inp, out, e=e: calls.setdefault(e, []).append(inp[0].shape[0]))
    y = moe(x)
    assert calls == {1: [9], 4: [9]}
    calls.clear()
    assert torch.allclose(y, _naive(moe, x), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("scheme,width", [("int8", 64), ("q4_k", 256)])
def test_grouped_experts_through_the_kernel_seam_equal_the_loop_on_the_same_layers(scheme, width):
    """Quantized experts (quant/apply.py swaps each expert's linears; the router stays float): grouped equals
    the token-by-token loop through the same quantized modules at 1, 7, 64 and 512 tokens, with expert 0 in
    every token's top k and the rest shared unevenly, up to the kernels' activation rounding, which depends on
    the row count (a kernel per row range)."""
    from tokenfab.quant.apply import quantize_model
    from tokenfab.quant.linear import QuantLinear
    moe = _moe(num_experts=6, k=2, hidden=width, inter=width)
    quantize_model(moe, scheme, keep_float=[])
    assert isinstance(moe.experts[0].gate_up_proj, QuantLinear) and isinstance(moe.router, torch.nn.Parameter)
    # positive rows: a constant router row gives expert 0 logits of ~3.2, the others N(0, 1), so expert 0 is in
    # every token's top 2 and the second choice still weighs ~0.1
    moe.router.data = torch.randn(6, width) / width ** 0.5
    moe.router.data[0] = 4.0 / width
    for tokens in (1, 7, 64, 512):
        x = torch.randn(tokens, width).abs()
        assert bool((route(F.linear(x, moe.router), 2, True)[1] == 0).any(-1).all())
        want = _naive(moe, x)
        assert float((moe(x) - want).abs().max()) < 2e-3 * float(want.abs().max()), tokens


# ---- the families against transformers --------------------------------------------------------------------

@pytest.mark.parametrize("kind,cpu_kernels", [("qwen3_moe", True), ("qwen3_moe", False), ("qwen3_moe-dense0", True),
                                              ("mixtral", True), ("olmoe", True)])
def test_tiny_moe_families_match_transformers_alone_and_batched(tmp_path, bundled_tokenizer, monkeypatch, kind,
                                                               cpu_kernels):
    if not cpu_kernels:
        monkeypatch.setattr(kernels, "usable", lambda *tensors: False)
    hf = make_tiny_model(kind, str(tmp_path), bundled_tokenizer)
    llm = LLM(model=str(tmp_path), max_model_len=128, num_kv_blocks=32)
    model = llm.engine.model
    hcfg = hf.config
    cfg = model.config
    assert (cfg.num_experts, cfg.experts_per_token) == (hcfg.num_local_experts if kind == "mixtral" else
                                                       hcfg.num_experts, hcfg.num_experts_per_tok)
    assert [type(layer.mlp).__name__ for layer in model.layers] == [
        "MLP" if i in getattr(hcfg, "mlp_only_layers", []) else "MoE" for i in range(hcfg.num_hidden_layers)]
    assert_greedy_matches_transformers(llm, hf, new_tokens=16)


def test_transformers_stacked_expert_tensors_load_as_the_per_expert_ones(tmp_path, bundled_tokenizer):
    """A state dict saved as transformers 5 holds it (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj`
    [E, H, I]) gives the same model as save_pretrained's per-expert names."""
    from safetensors.torch import save_file
    hf = make_tiny_model("qwen3_moe", str(tmp_path), bundled_tokenizer)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in sd
    (tmp_path / "model.safetensors").unlink()
    save_file(sd, str(tmp_path / "model.safetensors"))
    assert_greedy_matches_transformers(LLM(model=str(tmp_path), max_model_len=128, num_kv_blocks=32), hf,
                                       prompts=[[5, 17, 300, 4000, 99, 12]], new_tokens=12)


# ---- GGUF, as llama.cpp's converter writes it -------------------------------------------------------------

def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation for its Llama RoPE layout (LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_moe_gguf(path, hf, arch: str, expert_type: str = "F32", fuse_gate_up: bool = False) -> None:
    """The tiny HF model as convert_hf_to_gguf.py writes `arch` (qwen3moe, olmoe; Mixtral as llama with Q/K
    permuted): each layer's experts stacked [experts, rows, columns] as ffn_gate_exps / ffn_up_exps /
    ffn_down_exps, the router as ffn_gate_inp (float32), expert_count / expert_used_count /
    expert_feed_forward_length; `expert_type`: the stacked tensors' type (F32, Q8_0, Q4_K); `fuse_gate_up`:
    gate and up as one ffn_gate_up_exps (the converter's --fuse-gate-up-exps form)."""
    cfg = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    inter = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    for key, value in {"block_count": cfg.num_hidden_layers, "embedding_length": cfg.hidden_size,
                       "feed_forward_length": cfg.intermediate_size, "attention.head_count": heads,
                       "attention.head_count_kv": kv_heads, "attention.key_length": head_dim,
                       "attention.value_length": head_dim, "context_length": cfg.max_position_embeddings,
                       "expert_count": experts, "expert_used_count": cfg.num_experts_per_tok}.items():
        w.add_uint32(f"{arch}.{key}", value)
    if arch == "qwen3moe":
        w.add_uint32(f"{arch}.expert_feed_forward_length", inter)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope_parameters["rope_theta"])
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        tensors["output.weight"] = sd["lm_head.weight"]
    permute = arch == "llama"
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        q, k = sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"]
        tensors.update({f"blk.{i}.attn_q.weight": _permute(q, heads) if permute else q,
                        f"blk.{i}.attn_k.weight": _permute(k, kv_heads) if permute else k,
                        f"blk.{i}.attn_v.weight": sd[p + "self_attn.v_proj.weight"],
                        f"blk.{i}.attn_output.weight": sd[p + "self_attn.o_proj.weight"],
                        f"blk.{i}.attn_norm.weight": sd[p + "input_layernorm.weight"],
                        f"blk.{i}.ffn_norm.weight": sd[p + "post_attention_layernorm.weight"]})
        if p + "self_attn.q_norm.weight" in sd:
            tensors[f"blk.{i}.attn_q_norm.weight"] = sd[p + "self_attn.q_norm.weight"]
            tensors[f"blk.{i}.attn_k_norm.weight"] = sd[p + "self_attn.k_norm.weight"]
        if p + "mlp.gate.weight" in sd:
            gate_up = sd[p + "mlp.experts.gate_up_proj"]                  # [E, 2I, H], gate first
            tensors.update({f"blk.{i}.ffn_gate_inp.weight": sd[p + "mlp.gate.weight"],
                            f"blk.{i}.ffn_down_exps.weight": sd[p + "mlp.experts.down_proj"]})
            if fuse_gate_up:
                tensors[f"blk.{i}.ffn_gate_up_exps.weight"] = gate_up
            else:
                tensors.update({f"blk.{i}.ffn_gate_exps.weight": np.ascontiguousarray(gate_up[:, :inter]),
                                f"blk.{i}.ffn_up_exps.weight": np.ascontiguousarray(gate_up[:, inter:])})
        else:
            tensors.update({f"blk.{i}.ffn_gate.weight": sd[p + "mlp.gate_proj.weight"],
                            f"blk.{i}.ffn_up.weight": sd[p + "mlp.up_proj.weight"],
                            f"blk.{i}.ffn_down.weight": sd[p + "mlp.down_proj.weight"]})
    write_gguf_tensors(w, tensors, lambda name, array: (_quantize(array, expert_type), gguf.GGMLQuantizationType[
        expert_type]) if expert_type != "F32" and name.endswith("_exps.weight") else None)


def _quantize(stacked: np.ndarray, kind: str) -> np.ndarray:
    """[experts, rows, columns] float32 as GGUF blocks, uint8 [experts, rows, bytes]."""
    from tokenfab.quant.kquants import quantize_q4_k
    rows = stacked.reshape(-1, stacked.shape[-1])
    blocks = quantize_q4_k(rows) if kind == "Q4_K" else gguf.quants.quantize(rows, gguf.GGMLQuantizationType[kind])
    return blocks.reshape(*stacked.shape[:2], -1)


def _gguf_files(path, tokenizer):
    """The GGUF file read as load_model_files reads it, with the bundled tokenizer (the file's vocabulary is
    placeholder tokens)."""
    from tokenfab.model.loader import LoadedModel, gguf_config, load_gguf_weights, open_gguf, to_decoder_layout
    reader = open_gguf(str(path))
    cfg = gguf_config(reader, str(path))
    weights, types, raw = load_gguf_weights(reader, cfg, str(path))
    to_decoder_layout(cfg, weights, raw)
    return LoadedModel(path=str(path), config=cfg, weights=weights, tokenizer=tokenizer, file_dtypes=types,
                       gguf_raw=raw)


@pytest.mark.parametrize("kind,arch,fuse", [("qwen3_moe-dense0", "qwen3moe", False), ("mixtral", "llama", False),
                                            ("olmoe", "olmoe", True)])
def test_moe_gguf_as_llama_cpp_writes_it_matches_transformers(tmp_path, bundled_tokenizer, kind, arch, fuse):
    hf = make_tiny_model(kind, str(tmp_path / "hf"), bundled_tokenizer)
    path = tmp_path / "m.gguf"
    _write_moe_gguf(path, hf, arch, fuse_gate_up=fuse)
    files = _gguf_files(path, bundled_tokenizer)
    cfg = files.config
    experts = hf.config.num_local_experts if kind == "mixtral" else hf.config.num_experts
    assert (cfg.arch, cfg.num_experts, cfg.experts_per_token) == (arch, experts, hf.config.num_experts_per_tok)
    assert cfg.norm_topk_prob == (arch != "olmoe") and cfg.qk_norm_full == (arch == "olmoe")
    assert cfg.moe_layers == [i not in getattr(hf.config, "mlp_only_layers", []) for i in range(cfg.num_layers)]
    llm = LLM(max_model_len=128, num_kv_blocks=32, loaded=files)
    assert_greedy_matches_transformers(llm, hf, prompts=[[5, 17, 300, 4000, 99, 12], list(range(100, 140))],
                                       new_tokens=12)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K"])
def test_quantized_experts_run_as_stored_and_give_the_dequantized_models_logits(tmp_path, kind):
    """Quantized stacked experts (256 wide, as K-quants need): each expert's gate/up and down run as native
    layers behind the kernel seam (no float copy of them), and the logits stay within the kernels' activation
    rounding of the same file dequantized."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tokenfab.model.llama import full_logits
    from tokenfab.quant.linear import QuantLinear
    from tokenfab.quant.load import build_model
    config = AutoConfig.for_model("qwen3_moe", vocab_size=512, hidden_size=256, intermediate_size=512,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                                  norm_topk_prob=True, max_position_embeddings=128, initializer_range=0.1)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = tmp_path / "q.gguf"
    _write_moe_gguf(path, hf, "qwen3moe", kind)
    files = _gguf_files(path, None)
    assert files.gguf_raw["model.layers.1.mlp.experts.3.down_proj.weight"][0] == kind
    native = build_model(files, torch.float32, "cpu", 16, 128, quantization="gguf")
    floats = build_model(_gguf_files(path, None), torch.float32, "cpu", 16, 128, quantization="none")
    for layer in native.layers:
        for expert in layer.mlp.experts:
            assert isinstance(expert.gate_up_proj, QuantLinear) and isinstance(expert.down_proj, QuantLinear)
    ids = list(range(100, 130))
    a, b = full_logits(native, ids), full_logits(floats, ids)
    assert float((a - b).abs().max()) < 0.01 * float(b.abs().max())     # bf16 activations: ~0.4 % per GEMM
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


def test_the_planner_reads_experts_from_the_config_json_and_the_gguf_file(tmp_path, bundled_tokenizer):
    """`tokenfab plan` (plan/models.py): experts, experts per token and the experts' width from both files, so
    its active parameters are the k experts' and its total all of them."""
    from tokenfab.plan.models import from_gguf, from_hf_config
    hf = make_tiny_model("qwen3_moe", str(tmp_path / "hf"), bundled_tokenizer)
    _write_moe_gguf(tmp_path / "m.gguf", hf, "qwen3moe")
    for spec in (from_hf_config(str(tmp_path / "hf")), from_gguf(str(tmp_path / "m.gguf"))):
        assert (spec.num_experts, spec.experts_per_token, spec.intermediate) == (8, 2, 32)
        assert spec.total_params - spec.active_params == 2 * (8 - 2) * spec.expert_params


# ---- what is refused ---------------------------------------------------------------------------------------

_BASE = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


@pytest.mark.parametrize("cfg,message", [
    (dict(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
          use_sliding_window=True, sliding_window=64), "use_sliding_window"),
    (dict(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=9, moe_intermediate_size=32),
     "num_experts_per_tok=9 must be between 1 and num_experts=8"),
    (dict(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2), "moe_intermediate_size=0"),
    (dict(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
          decoder_sparse_step=0), "decoder_sparse_step=0"),
    (dict(model_type="mixtral", num_local_experts=8, num_experts_per_tok=2, sliding_window=4096),
     "sliding_window=4096"),
    (dict(model_type="olmoe", num_experts=8, num_experts_per_tok=2, clip_qkv=8.0), "clip_qkv=8.0"),
])
def test_unsupported_moe_configs_are_refused_naming_the_key(cfg, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**_BASE, **cfg})


def test_moe_parameter_count_counts_every_expert_and_the_router():
    cfg = ModelConfig.from_hf({**_BASE, "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
                               "moe_intermediate_size": 32, "mlp_only_layers": [0], "head_dim": 16})
    dense = ModelConfig.from_hf({**_BASE, "model_type": "qwen3", "head_dim": 16})
    assert cfg.moe_layers == [False, True]
    assert cfg.num_params() - dense.num_params() == 8 * (3 * 64 * 32 + 64) - 3 * 64 * 128
    assert cfg.num_params() - cfg.num_active_params() == (8 - 2) * 3 * 64 * 32     # one MoE layer's idle experts


@pytest.mark.parametrize("kind", ["qwen3_moe-dense0", "mixtral", "olmoe"])
def test_moe_config_survives_the_quant_checkpoints_config_json(kind):
    """`tokenfab quant` writes config.json from the ModelConfig (quant/export.py); it reads back the same."""
    from transformers import AutoConfig

    from tests.oracle import TINY_CONFIGS
    from tokenfab.quant.export import hf_config_dict
    kw = dict(TINY_CONFIGS[kind])
    cfg = ModelConfig.from_hf(AutoConfig.for_model(kw.pop("model_type"), vocab_size=100, **kw).to_dict())
    assert cfg.num_experts and ModelConfig.from_hf(hf_config_dict(cfg)) == cfg


def test_tensor_parallelism_refuses_moe_by_name():
    from tokenfab.distributed.shard import check_divisible
    cfg = ModelConfig.from_hf({**_BASE, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2})
    with pytest.raises(ValueError, match="mixture-of-experts models .4 experts. are not sharded"):
        check_divisible(cfg, 2)


def test_a_gguf_file_asking_more_experts_per_token_than_it_has_is_one_clear_line(tmp_path):
    from tests.oracle import write_gguf_metadata
    from tokenfab.model.loader import ModelLoadError, gguf_config, open_gguf
    path = tmp_path / "bad.gguf"
    write_gguf_metadata(path, "qwen3moe", {"qwen3moe.expert_count": 4, "qwen3moe.expert_used_count": 6,
                                           "qwen3moe.expert_feed_forward_length": 32})
    with pytest.raises(ModelLoadError, match=r"bad.gguf: qwen3moe.expert_used_count=6 must be between 1 and "
                                             r"qwen3moe.expert_count=4"):
        gguf_config(open_gguf(str(path)), str(path))
