"""ModelConfig: the architecture numbers of a Llama-family decoder, from GGUF metadata or config.json."""
from __future__ import annotations

from dataclasses import dataclass, field

# Architectures the decoder in llama.py runs, by HF `model_type` / GGUF `general.architecture`.
SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3")


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
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False         # Qwen2
    qk_norm: bool = False          # Qwen3: RMSNorm over each head's q and k
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = ""

    def num_params(self) -> int:
        h, i, L = self.hidden_size, self.intermediate_size, self.num_layers
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0)
        mlp = 3 * h * i
        norms = 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return L * (attn + mlp + norms) + emb + h

    def kv_bytes_per_token(self, bytes_per_element: float) -> int:
        """K and V for every layer: 2 x layers x kv_heads x head_dim x element size."""
        return int(2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element)

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        arch = cfg.get("model_type", "")
        if arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"unsupported rope scaling {rope_type!r} (only the default RoPE is implemented)")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            name=cfg.get("_name_or_path", ""),
        )
