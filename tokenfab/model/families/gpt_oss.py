"""gpt-oss (openai/gpt-oss-20b, -120b): the Llama decoder with mixture-of-experts MLPs in every layer
(model/moe.py) and these differences, each matched to transformers' GptOssForCausalLM:

- routing: the router (with a bias) picks the top `num_experts_per_tok` logits, and their softmax weighs the
  chosen experts (`ModelConfig.moe_topk_then_softmax`);
- experts of width `intermediate_size`, with biases on both projections, and a clamped SwiGLU ("swiglu_oai":
  gate clamped above at `swiglu_limit`, up clamped on both sides, gate * sigmoid(`swiglu_alpha` * gate) *
  (up + 1)); HF stores each layer's experts stacked and transposed, gate and up interleaved by column
  (`gate_up_proj` [E, H, 2I]), split here into the per-expert names (`split`);
- biases on q, k, v and the attention output (`attention_bias`);
- a learned sink logit per head in every attention softmax (`self_attn.sinks`: model/attention.py's
  sink_attention; no C kernel has the term, so these layers attend on the torch path);
- sliding-window attention on the layers `layer_types` names (every other one, the first included);
- YaRN RoPE (its config's `rope_parameters`, `truncate` false).

llama.cpp's `gpt-oss` files carry the same tensors under its names (`attn_sinks`, `post_attention_norm`,
`ffn_gate_inp` with a bias, stacked `ffn_{gate,up,down}_exps` with biases), the experts de-interleaved, often
as MXFP4 blocks, which the loader dequantizes (model/loader.py). They hold no layer pattern, SwiGLU constants
or YaRN truncation: llama.cpp's constants are used, which are gpt-oss's.
"""
from __future__ import annotations

import logging

import torch

from tokenfab.model.families import LLAMA_LAYER_NAMES, Family, register

log = logging.getLogger(__name__)

SLIDING_PATTERN = 2          # every 2nd layer global, starting with a sliding one (HF's default, llama.cpp's)
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0
ROPE_THETA = 150000.0        # GptOssConfig's default base
DEFAULT_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}

LAYER_NAMES = {**LLAMA_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks"}


def configure(out, sliding_window, layer_types: list[str] | None, alpha: float, limit: float,
              attention_bias: bool = True) -> None:
    """gpt-oss's switches on a ModelConfig, in place (the experts' counts are set by the caller)."""
    out.hidden_act, out.swiglu_alpha, out.swiglu_limit = "swiglu_oai", float(alpha), float(limit)
    out.moe_topk_then_softmax = out.router_bias = out.expert_bias = out.attn_sinks = True
    out.norm_topk_prob = False          # the k weights are a softmax already
    out.qkv_bias = out.o_bias = bool(attention_bias)
    if layer_types is None:
        layer_types = ["full_attention" if (i + 1) % SLIDING_PATTERN == 0 else "sliding_attention"
                       for i in range(out.num_layers)]
    unknown = set(layer_types) - {"full_attention", "sliding_attention"}
    if unknown or len(layer_types) != out.num_layers:
        raise ValueError(f"layer_types must name full_attention or sliding_attention for each of the "
                         f"{out.num_layers} layers, got {layer_types}")
    out.sliding_window = int(sliding_window) if sliding_window else None
    out.sliding_layers = [t == "sliding_attention" for t in layer_types]


def _prepare(cfg: dict) -> dict:
    """GptOssConfig's defaults where config.json leaves them out: YaRN, its base."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or DEFAULT_YARN)
    rope.setdefault("rope_theta", cfg.get("rope_theta", ROPE_THETA))
    if cfg.get("quantization_config") and cfg["quantization_config"].get("quant_method") != "mxfp4":
        raise ValueError(f"unsupported quantization_config {cfg['quantization_config'].get('quant_method')!r} "
                         "in a gpt-oss config (tokenfab reads float and MXFP4 experts)")
    return {**cfg, "rope_parameters": rope, "rope_scaling": None, "attention_bias": cfg.get("attention_bias", True)}


def _from_hf(cfg: dict, out) -> None:
    out.set_experts(int(cfg.get("num_local_experts", 0)), int(cfg.get("num_experts_per_tok", 0)),
                    out.intermediate_size, False)
    configure(out, cfg.get("sliding_window", 128), cfg.get("layer_types"), cfg.get("swiglu_alpha", SWIGLU_ALPHA),
              cfg.get("swiglu_limit", SWIGLU_LIMIT), cfg["attention_bias"])


def _from_gguf(field, out) -> None:
    configure(out, field("gpt-oss.attention.sliding_window"), None, SWIGLU_ALPHA, SWIGLU_LIMIT,
              attention_bias=out.qkv_bias)
    if out.rope_scaling and out.rope_scaling["rope_type"] == "yarn":
        out.rope_scaling["truncate"] = False     # gpt-oss's YaRN ramp is not rounded to whole dimensions


def split(cfg, weights, raw) -> None:
    """HF's names and layout as the decoder's: `mlp.router` -> `mlp.gate`; each layer's stacked experts
    (`gate_up_proj` [E, H, 2I], gate and up interleaved by column, `down_proj` [E, I, H], their biases, or
    the original checkpoint's MXFP4 `*_blocks` / `*_scales`) -> `mlp.experts.{e}.{gate,up,down}_proj`; a GGUF
    file's `self_attn.sinks.weight` -> `self_attn.sinks`."""
    dequantized = 0
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for suffix in ("weight", "bias"):
            _rename(weights, f"{p}mlp.router.{suffix}", f"{p}mlp.gate.{suffix}")
        _rename(weights, f"{p}self_attn.sinks.weight", f"{p}self_attn.sinks")
        e = f"{p}mlp.experts."
        for proj in ("gate_up_proj", "down_proj"):
            if e + proj + "_blocks" in weights:             # the original checkpoint's MXFP4 experts
                weights[e + proj] = dequantize_mxfp4(weights.pop(e + proj + "_blocks"),
                                                     weights.pop(e + proj + "_scales")).transpose(1, 2)
                dequantized += 1
        if e + "gate_up_proj" not in weights:
            continue
        gate_up, gate_up_bias = weights.pop(e + "gate_up_proj"), weights.pop(e + "gate_up_proj_bias")
        down, down_bias = weights.pop(e + "down_proj"), weights.pop(e + "down_proj_bias")
        for x in range(gate_up.shape[0]):
            w = gate_up[x].t()                                   # [2I, H], rows gate, up, gate, up, ...
            weights[f"{e}{x}.gate_proj.weight"] = w[0::2].contiguous()
            weights[f"{e}{x}.up_proj.weight"] = w[1::2].contiguous()
            weights[f"{e}{x}.gate_proj.bias"] = gate_up_bias[x, 0::2].contiguous()
            weights[f"{e}{x}.up_proj.bias"] = gate_up_bias[x, 1::2].contiguous()
            weights[f"{e}{x}.down_proj.weight"] = down[x].t().contiguous()
            weights[f"{e}{x}.down_proj.bias"] = down_bias[x].contiguous()
    if dequantized:
        log.warning("gpt-oss: %d MXFP4 expert tensors dequantized to float at load (tokenfab has no MXFP4 "
                    "kernel; the experts take 8x their file size in float32)", dequantized)


# the 16 values of an MXFP4 (E2M1) nibble, as the OCP Microscaling spec and transformers' FP4_VALUES give them
_FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The original checkpoint's MXFP4 tensors as float32: `blocks` uint8 [..., G, 16] (32 values per group,
    the low nibble first), `scales` uint8 [..., G] (E8M0: 2 ** (s - 127)) -> [..., G * 32]."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not fit together")
    lut = torch.tensor(_FP4, dtype=torch.float32)
    b = blocks.to(torch.uint8).long()
    out = torch.stack((lut[b & 0x0F], lut[b >> 4]), dim=-1).reshape(*blocks.shape[:-1], 32)
    out = torch.ldexp(out, scales.to(torch.int32)[..., None] - 127)
    return out.reshape(*blocks.shape[:-2], -1)


def _rename(weights, old: str, new: str) -> None:
    if old not in weights:
        return
    reader = getattr(weights, "reader", None)
    if reader is None:                   # a plain dict: HF's safetensors
        weights[new] = weights.pop(old)
        return
    weights.defer(new, reader(old))      # LazyWeights: read when asked, under the new name
    del weights[old]


register(Family("gpt-oss", ("gpt_oss",), prepare_hf=_prepare, from_hf=_from_hf, from_gguf=_from_gguf,
                gguf_layer_names=LAYER_NAMES, split_weights=split))
