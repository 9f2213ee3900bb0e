"""Gemma 3: the decoder with (1 + weight) norms (llama.cpp files store 1 + w; the loader reads HF's w back),
four norms per layer, GeGLU, q/k norms, sliding-window attention on 5 of every 6 layers with their own
RoPE base, embeddings times sqrt(hidden) and attention scaled by query_pre_attn_scalar ** -0.5. Its global
layers may scale their RoPE (4B and up: linear); the sliding layers' RoPE is plain. GGUF files carry neither
the layer pattern nor the local base: llama.cpp's constants are used."""
from tokenfab.model import rope as rope_scalings
from tokenfab.model.families import LLAMA_LAYER_NAMES, Family, register

SLIDING_PATTERN = 6         # every 6th layer global, the rest sliding (HF's default, llama.cpp's constant)
LOCAL_ROPE_THETA = 10000.0

# llama.cpp's ffn_norm is Gemma's pre-MLP norm, as for Llama, but HF names that pre_feedforward_layernorm
# and keeps post_attention_layernorm for the norm after attention
LAYER_NAMES = {**LLAMA_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}


def configure(out, sliding_window: int | None, layer_types: list[str] | None, local_theta: float,
              query_pre_attn_scalar: float | None, hidden_act: str = "gelu_pytorch_tanh") -> None:
    """Gemma 3's switches on a ModelConfig, in place."""
    out.arch, out.hidden_act, out.norm_offset, out.sandwich_norms, out.qk_norm = "gemma3", hidden_act, 1.0, True, True
    out.embed_scale = out.hidden_size ** 0.5
    out.attn_scale = float(query_pre_attn_scalar or out.head_dim) ** -0.5
    out.sliding_window = int(sliding_window) if sliding_window else None
    if layer_types is None:
        layer_types = ["full_attention" if (i + 1) % SLIDING_PATTERN == 0 else "sliding_attention"
                       for i in range(out.num_layers)]
    out.sliding_layers = [t == "sliding_attention" for t in layer_types]
    out.rope_local_theta = float(local_theta)


def _prepare(cfg: dict) -> dict:
    """The text model's config (the multimodal wrapper's text_config), with the global layers' RoPE as the
    one the shared keys read and the sliding layers' kept aside."""
    if "text_config" in cfg:
        cfg = {**cfg["text_config"], "model_type": "gemma3_text"}
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if "full_attention" in rope:          # transformers 5: one RoPE per layer type
        glob, local = rope["full_attention"], rope.get("sliding_attention", {})
    else:
        glob, local = rope, {}
    if rope_scalings.normalize(local, 0) is not None:
        raise ValueError(f"unsupported rope scaling {local.get('rope_type', local.get('type'))!r} on Gemma 3's "
                         "sliding layers (its global layers take one)")
    for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(cap):
            raise ValueError(f"unsupported {cap}={cfg[cap]} (Gemma 3 has none)")
    glob = {**glob, "rope_theta": glob.get("rope_theta", cfg.get("rope_theta", 1000000.0))}
    return {**cfg, "rope_parameters": glob, "rope_scaling": None, "_local_rope": local}


def _from_hf(cfg: dict, out) -> None:
    local = cfg["_local_rope"]
    configure(out, cfg.get("sliding_window"), cfg.get("layer_types"),
              local.get("rope_theta", cfg.get("rope_local_base_freq", LOCAL_ROPE_THETA)),
              cfg.get("query_pre_attn_scalar"), cfg.get("hidden_activation") or "gelu_pytorch_tanh")
    out.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", True))


def _from_gguf(field, out) -> None:       # llama.cpp's constants: the pattern, the local base, head_dim ** -0.5
    configure(out, field("gemma3.attention.sliding_window"), None, LOCAL_ROPE_THETA, None)


register(Family("gemma3", ("gemma3_text", "gemma3"), prepare_hf=_prepare, from_hf=_from_hf, from_gguf=_from_gguf,
                gguf_layer_names=LAYER_NAMES))
