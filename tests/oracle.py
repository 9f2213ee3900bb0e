"""The correctness oracle: Hugging Face `transformers`, greedy, float32, same weights and prompts."""
from __future__ import annotations

import json
import os

import torch


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Plain greedy decoding with the HF KV cache, never stopping early (as ignore_eos=True)."""
    ids = torch.tensor([prompt_ids])
    out: list[int] = []
    past = None
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            res = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            tok = int(res.logits[0, -1].argmax())
            out.append(tok)
            ids = torch.tensor([[tok]])
    return out


def load_hf_gguf(path: str):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    m = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    return m.eval()


TINY_CONFIGS = {
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rope_theta=1000000.0, tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1000000.0,
                  tie_word_embeddings=True),
    "mistral": dict(model_type="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, sliding_window=None),
    # scaled RoPE, with an original context of 64 so that prompts of 40-90 tokens cross it and the tiny
    # head's frequencies fall on both sides of each threshold (model/rope.py)
    "llama3-rope": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                                             high_freq_factor=4.0, original_max_position_embeddings=64)),
    "qwen2-yarn": dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                       rope_parameters=dict(rope_type="yarn", rope_theta=1000000.0, factor=4.0,
                                            original_max_position_embeddings=64)),
    # SmolLM3: RoPE left out on every 4th layer (4 layers: the last is NoPE)
    "smollm3": dict(model_type="smollm3", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=True,
                    pad_token_id=None),
    # Granite's four multipliers, each far from 1 (model/families/granite.py)
    "granite": dict(model_type="granite", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=True,
                    embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625,
                    logits_scaling=8.0, rms_norm_eps=0.05),   # an eps large enough to matter (it becomes eps / r^2)
    # Phi-3 / Phi-4-mini: fused qkv and gate_up, RoPE on half of each 16-wide head, longrope over an original
    # context of 64 (short factors up to 64 positions served, long ones beyond)
    "phi3": dict(model_type="phi3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, pad_token_id=None,
                 partial_rotary_factor=0.5, original_max_position_embeddings=64,
                 rope_scaling=dict(type="longrope", short_factor=[1.0, 1.3, 2.2, 3.1], long_factor=[1.5, 4.0, 9.0, 20.0])),
    "phi3-window": dict(model_type="phi3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, pad_token_id=None,
                        partial_rotary_factor=0.75, original_max_position_embeddings=64, sliding_window=48,
                        rope_scaling=dict(type="longrope", short_factor=[1.0, 1.1, 1.9, 2.5, 3.0, 3.3],
                                          long_factor=[1.2, 2.0, 5.0, 11.0, 17.0, 30.0])),
    # mixture of experts (model/moe.py): 8 experts of width 32, 2 per token; Qwen3-MoE with q/k norms per head
    "qwen3_moe": dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1000000.0,
                      tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True),
    # its first layer dense (mlp_only_layers), 3 experts per token, tied embeddings
    "qwen3_moe-dense0": dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1000000.0,
                             tie_word_embeddings=True, num_experts=8, num_experts_per_tok=3,
                             moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[0]),
    "mixtral": dict(model_type="mixtral", hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, rope_theta=1000000.0, tie_word_embeddings=False,
                    num_local_experts=6, num_experts_per_tok=2, sliding_window=None),
    # OLMoE: q/k norms over the whole projection, no renormalisation
    "olmoe": dict(model_type="olmoe", hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, rope_theta=10000.0, tie_word_embeddings=False,
                  num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, pad_token_id=None),
    # gpt-oss: 4 experts of width 32, 2 per token, routed top-k-then-softmax with a router bias; sliding window
    # of 16 on layers 0 and 2; YaRN over an original context of 32; a SwiGLU limit low enough that the
    # clamps bite on these weights (biases and sinks made non-zero by make_tiny_model)
    "gpt_oss": dict(model_type="gpt_oss", hidden_size=64, intermediate_size=32, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=16, swiglu_limit=1.5, tie_word_embeddings=False,
                    rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0,
                                         beta_slow=1.0, truncate=False, original_max_position_embeddings=32)),
    "llama-linear-rope": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                              rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0)),
}


def make_tiny_model(kind: str, folder: str, tokenizer, seed: int = 0, **overrides):
    """A random-weight HF model of `kind` (config keys changed by `overrides`) saved to `folder` with the
    given tokenizer; returns the HF model.

    Weights use a larger init scale than HF's default so logits are peaked and greedy choices are
    not near-ties that float rounding could flip.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(TINY_CONFIGS[kind], **overrides)
    model_type = kw.pop("model_type")
    cfg = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), max_position_embeddings=1024,
                               initializer_range=0.2, bos_token_id=tokenizer.bos_token_id,
                               eos_token_id=tokenizer.eos_token_id, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    if model_type == "qwen2":  # exercise the QKV bias path with non-zero biases
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    if model_type == "gpt_oss":  # HF initialises its biases to zero: give every bias and sink a value
        with torch.no_grad():
            for layer in model.model.layers:
                a, x = layer.self_attn, layer.mlp.experts
                for t in (a.q_proj.bias, a.k_proj.bias, a.v_proj.bias, a.o_proj.bias):
                    t.normal_(0, 0.5)
                a.sinks.normal_(0, 1.0)
                x.gate_up_proj_bias.normal_(0, 0.5)
                x.down_proj_bias.normal_(0, 0.5)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    with open(os.path.join(folder, "config.json")) as f:
        assert json.load(f)["model_type"] == model_type
    return model


def record_steps(llm) -> list:
    """Wrap `llm`'s scheduler so every ScheduledBatch it returns is appended to the returned list."""
    steps = []
    original = llm.engine.scheduler.schedule

    def spy():
        batch = original()
        steps.append(batch)
        return batch

    llm.engine.scheduler.schedule = spy
    return steps


def write_gguf_tensors(w, tensors: dict, blocks=None) -> None:
    """Add `tensors` to the gguf.GGUFWriter `w` and write its file. `blocks(name, array)` gives a tensor's
    quantized (uint8 blocks, GGMLQuantizationType), or None to store the array as it is."""
    for name, array in tensors.items():
        q = blocks(name, array) if blocks is not None else None
        if q is None:
            w.add_tensor(name, array)
        else:
            w.add_tensor(name, q[0], raw_dtype=q[1])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_gguf_metadata(path, arch: str, fields: dict, tensors: dict | None = None) -> None:
    """A GGUF file with `arch`'s minimal model keys (1 layer, 64 wide, 4 heads, an 8-token vocabulary, a
    zero token embedding), then `fields` ("{arch}.x" keys: int -> uint32, float -> float32, str -> string)
    and `tensors` (name -> numpy array): enough for `gguf_config` to read a file's metadata."""
    import gguf
    import numpy as np
    w = gguf.GGUFWriter(str(path), arch)
    base = {f"{arch}.block_count": 1, f"{arch}.embedding_length": 64, f"{arch}.feed_forward_length": 128,
            f"{arch}.attention.head_count": 4, f"{arch}.context_length": 4096}
    for key, value in {**base, **fields}.items():
        add = w.add_float32 if isinstance(value, float) else w.add_string if isinstance(value, str) else w.add_uint32
        add(key, value)
    w.add_token_list([f"t{i}" for i in range(8)])
    write_gguf_tensors(w, {"token_embd.weight": np.zeros((8, 64), np.float32), **(tensors or {})})


FAMILY_PROMPTS = [[5, 17, 300, 4000, 99, 12], list(range(100, 160))]


def assert_greedy_matches_transformers(llm, hf, prompts=FAMILY_PROMPTS, new_tokens: int = 24) -> list[list[int]]:
    """Greedy tokens of `prompts` batched equal transformers' (`hf`), and each prompt alone equals its
    batched tokens; no KV block stays held. Returns the tokens."""
    from tokenfab import SamplingParams
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for p, out in zip(prompts, outs):
        assert out == hf_greedy(hf, p, new_tokens), len(p)
    assert [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts] == outs
    assert llm.engine.block_manager.num_used_blocks() == 0
    return outs
