"""ModelConfig: the architecture numbers of a Llama-family decoder, from GGUF metadata or config.json.

SmolLM3 is the Llama decoder with RoPE left out on every 4th layer (`nope_layers`).
Granite is the Llama decoder with four multipliers, folded into the embedding scale, the norms' eps and
the final norm (`use_granite`). Gemma 3 is the same decoder with a few switches (model/llama.py reads them): (1 + weight) norms,
four norms per layer, GeGLU, q/k norms, sliding-window attention on most layers with its own RoPE
base, embeddings scaled by sqrt(hidden) and attention scaled by query_pre_attn_scalar.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenfab.model import rope as rope_scalings

# Architectures the decoder in llama.py runs, by HF `model_type` / GGUF `general.architecture`.
SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "granite", "smollm3")
SMOLLM3_NOPE_STEP = 4           # SmolLM3: every 4th layer has no RoPE (HF's default interval, llama.cpp's constant)
GEMMA3_SLIDING_PATTERN = 6      # every 6th layer global, the rest sliding (HF's default, llama.cpp's constant)
GEMMA3_LOCAL_ROPE_THETA = 10000.0


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
    # Granite's multipliers (use_granite): logits divided by this, folded into the final norm's weight at load
    logits_scaling: float | None = None
    granite: dict | None = None              # the multipliers and eps as the checkpoint states them

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
        norms = (4 if self.sandwich_norms else 2) * h + (2 * self.head_dim if self.qk_norm else 0)
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return L * (attn + mlp + norms) + emb + h

    def kv_bytes_per_token(self, bytes_per_element: float) -> int:
        """K and V for every layer: 2 x layers x kv_heads x head_dim x element size."""
        return int(2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element)

    def use_gemma3(self, sliding_window: int | None, layer_types: list[str] | None, local_theta: float,
                   query_pre_attn_scalar: float | None, hidden_act: str = "gelu_pytorch_tanh") -> None:
        """Gemma 3's switches, in place."""
        self.arch, self.hidden_act, self.norm_offset, self.sandwich_norms, self.qk_norm = \
            "gemma3", hidden_act, 1.0, True, True
        self.embed_scale = self.hidden_size ** 0.5
        self.attn_scale = float(query_pre_attn_scalar or self.head_dim) ** -0.5
        self.sliding_window = int(sliding_window) if sliding_window else None
        if layer_types is None:
            layer_types = ["full_attention" if (i + 1) % GEMMA3_SLIDING_PATTERN == 0 else "sliding_attention"
                           for i in range(self.num_layers)]
        self.sliding_layers = [t == "sliding_attention" for t in layer_types]
        self.rope_local_theta = float(local_theta)

    def use_granite(self, embedding: float, residual: float, attention: float, logits: float) -> None:
        """Granite's four multipliers, in place, without a new code path: the residual stream is carried
        divided by `residual` (u = h / r). RMSNorm(h) with eps equals RMSNorm(u) with eps / r^2, and h + r f
        becomes u + f, so the decoder runs unchanged with the embedding scaled by embedding / r and every
        norm's eps divided by r^2; attention scales scores by `attention`; logits / `logits` is the final
        norm's weight divided by it (model/llama.py)."""
        self.granite = {"embedding_multiplier": embedding, "residual_multiplier": residual,
                        "attention_multiplier": attention, "logits_scaling": logits, "rms_norm_eps": self.rms_norm_eps}
        self.embed_scale = embedding / residual
        self.rms_norm_eps = self.rms_norm_eps / residual ** 2
        self.attn_scale = attention
        self.logits_scaling = logits if logits != 1.0 else None

    def kv_bytes_for_context(self, context: int, bytes_per_element: float, windowed: bool) -> int:
        """K and V of one sequence of `context` tokens; `windowed`: sliding layers holding only their
        window (what the engine's sliding pool holds, engine/sliding_kv.py, up to block rounding)."""
        per_layer_token = 2 * self.num_kv_heads * self.head_dim * bytes_per_element
        tokens = sum(min(context, self.sliding_window) if windowed and self.is_sliding(i) else context
                     for i in range(self.num_layers))
        return int(tokens * per_layer_token)

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        if cfg.get("model_type") == "gemma3" and "text_config" in cfg:     # the multimodal wrapper
            cfg = {**cfg["text_config"], "model_type": "gemma3_text"}
        if cfg.get("model_type") == "gemma3_text":
            return cls._from_hf_gemma3(cfg)
        arch = cfg.get("model_type", "")
        if arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        max_pos = cfg.get("max_position_embeddings", 2048)
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        if cfg.get("mlp_bias"):
            raise ValueError(f"unsupported mlp_bias=True in {arch!r} (the decoder's MLP has no biases)")
        out = cls(
            arch=arch,
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
            qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            name=cfg.get("_name_or_path", ""),
        )
        if arch == "smollm3":       # no_rope_layers: 1 where a layer uses RoPE
            use = cfg.get("no_rope_layers") or [int((i + 1) % cfg.get("no_rope_layer_interval", SMOLLM3_NOPE_STEP) != 0)
                                                for i in range(out.num_layers)]
            out.nope_layers = [not u for u in use]
            if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
                raise ValueError("unsupported: SmolLM3 with use_sliding_window")
        if arch == "granite":
            out.use_granite(float(cfg.get("embedding_multiplier", 1.0)), float(cfg.get("residual_multiplier", 1.0)),
                            float(cfg.get("attention_multiplier", 1.0)), float(cfg.get("logits_scaling", 1.0)))
        return out

    @classmethod
    def _from_hf_gemma3(cls, cfg: dict) -> "ModelConfig":
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
        out = cls.from_hf({**cfg, "model_type": "llama", "rope_parameters": None, "rope_scaling": None,
                           "rope_theta": glob.get("rope_theta", cfg.get("rope_theta", 1000000.0))})
        out.use_gemma3(cfg.get("sliding_window"), cfg.get("layer_types"),
                       local.get("rope_theta", cfg.get("rope_local_base_freq", GEMMA3_LOCAL_ROPE_THETA)),
                       cfg.get("query_pre_attn_scalar"), cfg.get("hidden_activation") or "gelu_pytorch_tanh")
        out.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", True))
        out.rope_scaling = rope_scalings.normalize(glob, out.max_position_embeddings)   # 4B and up: linear, global layers
        return out
