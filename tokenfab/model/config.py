"""ModelConfig: the architecture numbers of a Llama-family decoder, from GGUF metadata or config.json.

The fields every family shares come first; the switches after them (norm offset, sandwich norms, GeGLU,
sliding windows, NoPE layers, multipliers, mixture-of-experts layers) are set by the families
(model/families/), which read their own keys. `from_hf` reads the shared config.json keys and hands the rest
to the family.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenfab.model import rope as rope_scalings

@dataclass(slots=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None         # model/rope.py: None (default RoPE) or {"rope_type": ..., ...}
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False         # Qwen2
    qk_norm: bool = False          # Qwen3: RMSNorm over each head's q and k
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = ""
    # Gemma 3's switches (defaults: the Llama decoder)
    hidden_act: str = "silu"                 # "silu" (SwiGLU) | "gelu_pytorch_tanh" (GeGLU)
    norm_offset: float = 0.0                 # RMSNorm multiplies by (norm_offset + weight)
    sandwich_norms: bool = False             # norms after attention and MLP too (four per layer)
    embed_scale: float | None = None         # embeddings multiplied by this (Gemma: sqrt(hidden))
    attn_scale: float | None = None          # attention scale (None: head_dim ** -0.5)
    sliding_window: int | None = None        # tokens a sliding layer attends to, itself included
    sliding_layers: list[bool] = field(default_factory=list)   # per layer: sliding (True) or global
    rope_local_theta: float | None = None    # RoPE base of the sliding layers
    nope_layers: list[bool] = field(default_factory=list)   # per layer: no RoPE (SmolLM3's NoPE layers)
    rotary_dim: int | None = None            # RoPE on this many of a head's dimensions (Phi-3's partial
                                             # rotary); None: all of them
    # Granite's multipliers (model/families/granite.py): logits divided by this, folded into the final norm's
    # weight at load
    logits_scaling: float | None = None
    granite: dict | None = None              # the multipliers and eps as the checkpoint states them
    # mixture of experts (model/moe.py; Qwen3-MoE, Mixtral, OLMoE): 0 experts is the dense MLP everywhere
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0           # each expert's MLP width
    norm_topk_prob: bool = True              # the k chosen router probabilities renormalised to sum to 1
    moe_layers: list[bool] = field(default_factory=list)   # per layer: experts (True) or the dense MLP
    qk_norm_full: bool = False               # OLMoE: the q/k norms span the whole projection, not each head
    # gpt-oss (model/families/gpt_oss.py): the router's top k logits softmaxed (not the softmax's top k), a
    # bias on the router and on every expert projection, the clamped SwiGLU (hidden_act "swiglu_oai": gate
    # clamped above, up on both sides at swiglu_limit, gate * sigmoid(swiglu_alpha * gate) * (up + 1)), a bias
    # on the attention output, and a learned sink logit per head in every attention softmax's denominator
    moe_topk_then_softmax: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    o_bias: bool = False
    attn_sinks: bool = False

    def is_moe(self, layer: int) -> bool:
        return self.num_experts > 0 and layer < len(self.moe_layers) and self.moe_layers[layer]

    def set_experts(self, num_experts: int, per_token: int, intermediate_size: int, normalize: bool,
                    layers: list[bool] | None = None) -> None:
        """Mixture-of-experts layers (`layers`: which; None: all); ValueError naming the key that is off."""
        if num_experts < 1 or not 0 < per_token <= num_experts:
            raise ValueError(f"num_experts_per_tok={per_token} must be between 1 and num_experts={num_experts}")
        if intermediate_size < 1:
            raise ValueError(f"moe_intermediate_size={intermediate_size} must be positive")
        self.num_experts, self.experts_per_token = int(num_experts), int(per_token)
        self.moe_intermediate_size, self.norm_topk_prob = int(intermediate_size), bool(normalize)
        self.moe_layers = list(layers) if layers is not None else [True] * self.num_layers

    def is_nope(self, layer: int) -> bool:
        return layer < len(self.nope_layers) and self.nope_layers[layer]

    def is_sliding(self, layer: int) -> bool:
        return bool(self.sliding_window) and layer < len(self.sliding_layers) and self.sliding_layers[layer]

    def num_params(self) -> int:
        h, i, L = self.hidden_size, self.intermediate_size, self.num_layers
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0)
        mlp = 3 * h * i
        moe = self.num_experts * (3 * h * self.moe_intermediate_size + h)     # the experts and the router
        qk = (q + kv if self.qk_norm_full else 2 * self.head_dim) if self.qk_norm else 0
        norms = (4 if self.sandwich_norms else 2) * h + qk
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return sum(attn + norms + (moe if self.is_moe(n) else mlp) for n in range(L)) + emb + h

    def num_active_params(self) -> int:
        """The parameters one token's forward reads: a mixture-of-experts layer's k experts, not all of them."""
        unused = (self.num_experts - self.experts_per_token) * 3 * self.hidden_size * self.moe_intermediate_size
        return self.num_params() - unused * sum(map(self.is_moe, range(self.num_layers)))

    def kv_bytes_per_token(self, bytes_per_element: float) -> int:
        """K and V for every layer: 2 x layers x kv_heads x head_dim x element size."""
        return int(2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element)

    def kv_bytes_for_context(self, context: int, bytes_per_element: float, windowed: bool) -> int:
        """K and V of one sequence of `context` tokens; `windowed`: sliding layers holding only their
        window (what the engine's sliding pool holds, engine/sliding_kv.py, up to block rounding)."""
        per_layer_token = 2 * self.num_kv_heads * self.head_dim * bytes_per_element
        tokens = sum(min(context, self.sliding_window) if windowed and self.is_sliding(i) else context
                     for i in range(self.num_layers))
        return int(tokens * per_layer_token)

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """From a config.json dict: the keys every family shares, then the family's own
        (model/families/); ValueError for an architecture or a setting the decoder does not run."""
        from tokenfab.model import families
        family = families.for_hf(cfg.get("model_type", ""))
        cfg = family.prepare_hf(cfg)
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        max_pos = cfg.get("max_position_embeddings", 2048)
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        if cfg.get("mlp_bias"):
            raise ValueError(f"unsupported mlp_bias=True in {family.arch!r} (the decoder's MLP has no biases)")
        out = cls(
            arch=family.arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rope_scaling=rope_scalings.normalize(rope, max_pos),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            name=cfg.get("_name_or_path", ""),
        )
        family.from_hf(cfg, out)
        return out
