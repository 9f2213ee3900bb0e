"""Phi-3 / Phi-3.5 / Phi-4-mini: the Llama decoder with q, k and v fused into one projection (`qkv_proj`; llama.cpp's
`attn_qkv`) and gate and up into one (`gate_up_proj`, gate first; llama.cpp's `ffn_up`), RoPE on part of each
head (`partial_rotary_factor`: Phi-4-mini rotates 96 of 128 dimensions), longrope scaling (model/rope.py) and,
on some, a sliding window on every layer. The fused tensors are split on load (`split`), so the decoder
fuses them back its own way; the partial rotary is the loader's row move plus tables that pass the other
dimensions through (loader.partial_rotary_rows, layers.RotaryEmbedding)."""
from tokenfab.model.families import LLAMA_LAYER_NAMES, Family, register

LAYER_NAMES = {**LLAMA_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}


def _prepare(cfg: dict) -> dict:
    """HF keeps longrope's original context beside the scaling (transformers 5 moves it in)."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if rope and cfg.get("original_max_position_embeddings"):
        rope.setdefault("original_max_position_embeddings", cfg["original_max_position_embeddings"])
    return {**cfg, "rope_parameters": rope or None, "rope_scaling": None}


def _window(out, window) -> None:
    if window and int(window) < out.max_position_embeddings:
        out.sliding_window = int(window)
        out.sliding_layers = [True] * out.num_layers


def _from_hf(cfg: dict, out) -> None:
    rope = cfg.get("rope_parameters") or {}
    factor = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    if factor != 1.0:
        out.rotary_dim = int(out.head_dim * factor)
    _window(out, cfg.get("sliding_window"))


def _from_gguf(field, out) -> None:
    # llama.cpp writes the rotated width as rope.dimension_count, which the shared reader took as head_dim
    out.head_dim = out.hidden_size // out.num_heads
    rot = field("phi3.rope.dimension_count")
    if rot and int(rot) != out.head_dim:
        out.rotary_dim = int(rot)
    _window(out, field("phi3.attention.sliding_window"))


def split(cfg, weights, raw) -> None:
    """qkv_proj -> q_proj, k_proj, v_proj and gate_up_proj -> gate_proj, up_proj, by rows: the float weights
    (read lazily where the mapping defers) and the raw GGUF blocks (each row's blocks stand alone)."""
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    parts = {"self_attn.qkv_proj": [("self_attn.q_proj", 0, q), ("self_attn.k_proj", q, q + kv),
                                    ("self_attn.v_proj", q + kv, q + 2 * kv)],
             "mlp.gate_up_proj": [("mlp.gate_proj", 0, inter), ("mlp.up_proj", inter, 2 * inter)]}
    for i in range(cfg.num_layers):
        for fused, pieces in parts.items():
            for suffix in ("weight", "bias"):
                name = f"model.layers.{i}.{fused}.{suffix}"
                if name in weights:
                    _split_rows(weights, name, [(f"model.layers.{i}.{p}.{suffix}", a, b) for p, a, b in pieces])
                if name in raw:
                    kind, blocks = raw.pop(name)
                    for p, a, b in pieces:
                        raw[f"model.layers.{i}.{p}.{suffix}"] = (kind, blocks[a:b])


def _split_rows(weights, name: str, pieces) -> None:
    defer = getattr(weights, "defer", None)
    if defer is None:                                # a plain dict: HF's safetensors, already read
        full = weights.pop(name)
        for part, a, b in pieces:
            weights[part] = full[a:b]
        return
    read = weights.reader(name)                      # LazyWeights: each part reads the fused tensor when asked
    del weights[name]
    for part, a, b in pieces:
        defer(part, lambda read=read, a=a, b=b: read()[a:b])


register(Family("phi3", ("phi3",), prepare_hf=_prepare, from_hf=_from_hf, from_gguf=_from_gguf,
                gguf_layer_names=LAYER_NAMES, split_weights=split))
