"""The model families the decoder runs (model/llama.py), one file each, registered here by name.

A family is the Llama decoder plus what makes it itself: the config.json keys and GGUF metadata it reads
into ModelConfig's switches, llama.cpp's tensor names for its layers, and whether llama.cpp's converter
permuted its Q/K rows. ModelConfig.from_hf and the GGUF loader (model/loader.py) read the keys every family
shares, then hand the rest to the family found here by `model_type` / `general.architecture`. Adding a
family is one file in this folder and one line in the import below.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

# llama.cpp's per-layer tensor names -> HF's, for the Llama layout (a family may extend them)
LLAMA_LAYER_NAMES: Mapping[str, str] = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",          # a mixture-of-experts layer's router (model/moe.py)
}

# llama.cpp's mixture-of-experts tensors hold every expert of a layer, stacked [experts, rows, columns]; the
# loader reads each expert's slice under HF's per-expert name, `mlp.experts.{e}.<proj>` (the fused gate/up
# form, `ffn_gate_up_exps`, splits into both)
STACKED_EXPERT_NAMES: Mapping[str, tuple[str, ...]] = {
    "ffn_gate_exps": ("gate_proj",), "ffn_up_exps": ("up_proj",), "ffn_down_exps": ("down_proj",),
    "ffn_gate_up_exps": ("gate_proj", "up_proj"),
}


def _same(cfg: dict) -> dict:
    return cfg


def _nothing(*_args) -> None:
    return None


@dataclass(frozen=True)
class Family:
    arch: str                                   # ModelConfig.arch and GGUF's general.architecture
    hf_model_types: tuple[str, ...]             # config.json `model_type` values it reads
    # config.json rewritten before the shared keys are read (Gemma 3's multimodal wrapper, its per-layer RoPE)
    prepare_hf: Callable[[dict], dict] = _same
    from_hf: Callable = _nothing                # (config.json dict, ModelConfig): the family's keys, in place
    from_gguf: Callable = _nothing              # (field(key, default), ModelConfig): its GGUF metadata, in place
    gguf_layer_names: Mapping[str, str] = field(default_factory=lambda: LLAMA_LAYER_NAMES)
    rope_permuted: bool = False                 # llama.cpp's converter permuted Q/K rows (its Llama RoPE layout)
    # (ModelConfig, weights, raw GGUF blocks): the family's fused tensors split into the Llama names, in place
    split_weights: Callable = _nothing


_BY_ARCH: dict[str, Family] = {}
_BY_HF: dict[str, Family] = {}


def register(family: Family) -> Family:
    _BY_ARCH[family.arch] = family
    for t in family.hf_model_types:
        _BY_HF[t] = family
    return family


def supported() -> tuple[str, ...]:
    return tuple(_BY_ARCH)


def for_hf(model_type: str) -> Family:
    """The family of a config.json's `model_type`; ValueError naming the supported ones."""
    if model_type not in _BY_HF:
        raise ValueError(f"unsupported architecture {model_type!r}; supported: {', '.join(supported())}")
    return _BY_HF[model_type]


def for_gguf(arch: str | None) -> Family | None:
    """The family of a GGUF file's `general.architecture`, or None."""
    return _BY_ARCH.get(arch or "")


from tokenfab.model.families import (  # noqa: E402,F401  (they register)
    gemma3, gpt_oss, granite, llama, mixtral, olmoe, phi3, qwen, qwen3_moe, smollm3)
