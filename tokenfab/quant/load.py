"""Building a model with its weights as asked: which quantized layers replace the decoder's float linears.

`quantization` (EngineConfig / --quantization):
- "auto" (default): a GGUF file's blocks run as shipped ("gguf"); float checkpoints stay float ("none");
- "none": float weights in the compute dtype (GGUF blocks dequantized): token-exact with transformers;
- "gguf": the GGUF file's Q4_0 / Q4_1 / Q8_0 blocks run as shipped, no requantization. The packed
  CPU kernels take bfloat16 activations, so logits differ from "none" at bf16 precision (see docs/quant.md);
- "int8", "int4" (= int4-g32), "int4-g32", "int4-g64", "int4-g128": round-to-nearest weight-only
  quantization of every decoder linear (embeddings and LM head stay float);
- "q4_k", "q6_k": GGUF K-quant blocks written from the float weights (tokenfab/quant/kquants.py), run as
  stored; layers whose input width is not a multiple of 256 take int4-g32 / int8 instead;
- "w8a8": int8 weights per channel and int8 activations per token, an integer GEMM on CPU (fastest at
  large batches, at a measured quality cost: docs/quant.md);
- a folder written by `tokenfab quant` carries its own quantized layers and is applied automatically.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from tokenfab import registry
from tokenfab.model.llama import LlamaModel

QUANTIZATIONS = ("auto", "none", "gguf", "int8", "w8a8", "int4", "int4-g32", "int4-g64", "int4-g128", "q4_k", "q6_k")
registry.register("quantization", *QUANTIZATIONS)


def resolve_quantization(loaded, quantization: str | None) -> str:
    """The scheme `quantization` means for these files ("auto": "gguf" for a GGUF file's blocks, else
    "none"); ValueError for unknown names and for "gguf" without blocks to run."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    if quantization == "auto":
        return "gguf" if loaded.gguf_raw else "none"
    if quantization == "gguf" and not loaded.gguf_raw:
        raise ValueError(f"{loaded.path} has no Q4_0/Q4_1/Q5_0/Q8_0/Q2_K..Q6_K tensors to run natively; "
                         "use int8 or int4 to quantize float weights")
    return quantization


def use_gguf_blocks(model, raw: dict[str, tuple[str, np.ndarray]], weights=None,
                    dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> int:
    """Replace each decoder linear whose source tensors are all GGUF blocks of one type by the native
    layer (fused q/k/v and gate/up concatenate their raw rows). Returns how many were replaced.

    On a model still on the meta device (build_model does this before loading the float weights, so
    the replaced layers never get float copies), biases come from `weights` and a tied embedding
    served from the head's blocks computes in `dtype`. Q4_K and Q4_0 tensors load as stored or as int4
    blocks as `blocks_as_stored(device)` says."""
    from tokenfab.quant.kquants import blocks_as_stored
    from tokenfab.quant.linear import gguf_linear

    stored = blocks_as_stored(device)

    def bias_of(sources: list[str], linear):
        if linear.bias is None:
            return None
        if not linear.bias.is_meta:
            return linear.bias.data
        return torch.cat([weights[s.removesuffix("weight") + "bias"] for s in sources])

    def native(sources: list[str], linear) -> bool:
        parts = [raw.get(s) for s in sources]
        if any(p is None for p in parts):
            return False
        bias = bias_of(sources, linear)
        if len({p[0] for p in parts}) == 1:      # one block type: the rows concatenate into one layer
            data = np.concatenate([p[1] for p in parts], axis=0)
            layer = gguf_linear(data, parts[0][0], linear.out_features, linear.in_features, bias, stored)
        else:                                    # llama.cpp's mixed files, e.g. Q4_K q/k with a Q6_K v
            layer = mixed_gguf_linear(parts, linear.in_features, bias, stored)
        if layer is None:
            return False
        owner, attr = holder[linear]
        setattr(owner, attr, layer)
        return True

    holder = {}
    plan: list[tuple[list[str], torch.nn.Module]] = []
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        a = layer.self_attn
        holder.update({a.qkv_proj: (a, "qkv_proj"), a.o_proj: (a, "o_proj")})
        plan += [([p + f"self_attn.{n}_proj.weight" for n in "qkv"], a.qkv_proj),
                 ([p + "self_attn.o_proj.weight"], a.o_proj)]
        # a dense MLP, or each expert of a mixture-of-experts layer (llama.cpp's stacked tensors, read per
        # expert by the loader); the router stays float (model/moe.py)
        experts = getattr(layer.mlp, "experts", None)
        mlps = ([(m, f"{p}mlp.experts.{e}.") for e, m in enumerate(experts)] if experts is not None
                else [(layer.mlp, p + "mlp.")])
        for m, q in mlps:
            holder.update({m.gate_up_proj: (m, "gate_up_proj"), m.down_proj: (m, "down_proj")})
            plan += [([q + "gate_proj.weight", q + "up_proj.weight"], m.gate_up_proj),
                     ([q + "down_proj.weight"], m.down_proj)]
    holder[model.lm_head] = (model, "lm_head")
    head_src = "lm_head.weight" if "lm_head.weight" in raw else "model.embed_tokens.weight"
    plan.append(([head_src], model.lm_head))
    replaced = sum(native(srcs, lin) for srcs, lin in plan)
    if head_src == "model.embed_tokens.weight" and hasattr(model.lm_head, "embedding"):
        # tied: the head's blocks are the embedding's, so lookups read them; the float copy goes
        from tokenfab.model.layers import HeadRowsEmbedding
        model.embed_tokens = HeadRowsEmbedding(model.lm_head, dtype or model.embed_tokens.weight.dtype)
    return replaced


class ConcatLinear(nn.Module):
    """Row blocks of one fused projection stored in different block types (llama.cpp's mixed files):
    each part runs its own kernels, the outputs are concatenated. The one-call decode stack takes a qkv
    projection of two parts (Q4_K q and k, Q6_K v), each with its own tf_qgemm layout."""

    def __init__(self, parts: list[nn.Module], bias: torch.Tensor | None):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([p(x) for p in self.parts], dim=-1)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def mixed_gguf_linear(parts: list[tuple[str, np.ndarray]], in_features: int, bias,
                      as_stored: bool = False) -> nn.Module | None:
    """One projection from row blocks of different GGUF types: a single Q8_0-form layer when every part
    decodes to it (Q8_0, Q5_0), else a ConcatLinear of native layers; None if a part has none."""
    from tokenfab.quant.linear import Q8_0Linear, gguf_linear
    runs: list[tuple[str, np.ndarray]] = []     # adjacent parts of one kind concatenate (q and k of Q4_K)
    for kind, data in parts:
        if runs and runs[-1][0] == kind:
            runs[-1] = (kind, np.concatenate([runs[-1][1], data], axis=0))
        else:
            runs.append((kind, data))
    layers = []
    for kind, data in runs:
        layer = gguf_linear(data, kind, np.asarray(data).shape[0], in_features, as_stored=as_stored)
        if layer is None:
            return None
        layers.append(layer)
    if all(isinstance(m, Q8_0Linear) for m in layers):
        return Q8_0Linear(torch.cat([m.qweight for m in layers]), torch.cat([m.scales for m in layers]), bias)
    return ConcatLinear(layers, bias)


def build_model(loaded, dtype: torch.dtype, device: str, block_size: int, max_positions: int,
                quantization: str = "auto", tp: tuple[int, int] | None = None) -> LlamaModel:
    """Build on the meta device (no wasted random init), put a GGUF file's native layers in, move the
    float weights in, then quantize the float linears as asked (`quantization`, module docstring).

    `tp` = (rank, size): build only that tensor-parallel rank's shard (tokenfab/distributed/shard.py)."""
    from tokenfab.quant.checkpoint import apply_checkpoint, is_quantized_checkpoint

    cfg = loaded.config
    if tp is not None and tp[1] > 1:
        return _build_shard(loaded, dtype, device, block_size, max_positions, quantization, *tp)
    with torch.device("meta"):
        model = LlamaModel(cfg, block_size, max_positions=1)
    model.make_ropes(max_positions)
    if is_quantized_checkpoint(loaded.path):     # written by `tokenfab quant`: our own layer names
        if quantization not in ("auto", "none"):
            raise ValueError(f"{loaded.path} is already quantized; leave quantization unset")
        if cfg.tie_word_embeddings:      # tie before loading, so apply_checkpoint keeps one copy
            model.lm_head.weight = model.embed_tokens.weight
        apply_checkpoint(model, loaded.path)
        _cast_float_parameters(model, dtype)
    else:
        scheme = resolve_quantization(loaded, quantization)
        if scheme == "gguf":       # before the float weights: the layers it replaces never get float copies
            use_gguf_blocks(model, loaded.gguf_raw, loaded.weights, dtype, device)
        model.load_hf_weights(loaded.weights, dtype)
        if scheme not in ("none", "gguf"):
            from tokenfab.quant.apply import quantize_model
            quantize_model(model, "int4-g32" if scheme == "int4" else scheme)
    model = model.to(device)
    model.set_attention_backend(model.default_backend())
    return model


def _build_shard(loaded, dtype, device, block_size, max_positions, quantization, rank: int, size: int) -> LlamaModel:
    """One tensor-parallel rank's model: its share of the float weights, quantized after sharding
    (so every quantized block lies within one shard), with the all-reduces in place."""
    from tokenfab.distributed.shard import shard_config, shard_weights, wrap_row_parallel
    from tokenfab.quant.checkpoint import is_quantized_checkpoint

    if is_quantized_checkpoint(loaded.path):
        raise ValueError(f"{loaded.path} is a tokenfab quant checkpoint; tensor parallelism shards float "
                         "weights: use the float model with --quantization int8/int4 instead")
    if quantization == "gguf":
        raise ValueError("quantization 'gguf' (the file's blocks as shipped) does not shard yet; with "
                         "tensor_parallel_size > 1 use 'auto' or 'none' (float) or int8/int4")
    if quantization == "auto" and loaded.gguf_raw:
        import logging
        logging.getLogger("tokenfab.engine").warning(
            "tensor parallelism: the GGUF file's blocks are dequantized to float and then sharded")
    cfg = shard_config(loaded.config, size)
    with torch.device("meta"):
        model = LlamaModel(cfg, block_size, max_positions=1)
    model.make_ropes(max_positions)
    model.load_hf_weights(shard_weights(loaded.weights, loaded.config, rank, size), dtype)
    if quantization not in ("auto", "none"):
        from tokenfab.quant.apply import quantize_model
        quantize_model(model, "int4-g32" if quantization == "int4" else quantization)
    wrap_row_parallel(model)
    model = model.to(device)
    model.set_attention_backend(model.default_backend())
    return model


def _cast_float_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Float parameters outside the quantized linears to the compute dtype (checkpoints store
    float32), in place so that tied parameters stay tied; quantized layers keep their scales."""
    from tokenfab.quant.linear import QuantLinear

    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            continue
        for p in mod.parameters(recurse=False):
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
