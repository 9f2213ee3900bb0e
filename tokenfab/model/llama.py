"""The Llama-family decoder: Llama, SmolLM, Mistral, Qwen2 (QKV bias), Qwen3 (per-head q/k RMSNorm).

It runs a flat batch: `input_ids` and `positions` concatenated over all sequences of a step, with the
attention layout in an `AttentionMetadata` passed in by the runner. Projections are plain `nn.Linear`
modules (Q/K/V fused into `qkv_proj`, gate/up into `gate_up_proj`: fewer, larger matmuls per step),
so tokenfab.quant can swap them for quantized ones by name.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenfab import kernels
from tokenfab.model.attention import AttentionMetadata, TorchPagedAttention
from tokenfab.model.config import ModelConfig
from tokenfab.model.layers import RMSNorm, RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, block_size: int):
        super().__init__()
        self.h, self.kvh, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.h * self.d, self.kvh * self.d
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.attn = TorchPagedAttention(self.h, self.kvh, self.d, block_size)

    def forward(self, x, rope: RotaryEmbedding, rope_tables, kv: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        if (self.d <= kernels.MAX_HEAD_DIM and meta.positions is not None and isinstance(kv[0], torch.Tensor)
                and kernels.usable(qkv, kv[0])):
            return self.o_proj(self._fused(qkv.contiguous(), rope, kv, meta).reshape(T, self.q_size))
        v = qkv[:, self.q_size + self.kv_size:].view(T, self.kvh, self.d)
        if self.q_norm is None:
            # q and k sit side by side in each row: rotate them in one go.
            qk = rope.apply(qkv[:, :self.q_size + self.kv_size].view(T, self.h + self.kvh, self.d), rope_tables)
            q, k = qk[:, :self.h], qk[:, self.h:]
        else:
            q = self.q_norm(qkv[:, :self.q_size].view(T, self.h, self.d))
            k = self.k_norm(qkv[:, self.q_size:self.q_size + self.kv_size].view(T, self.kvh, self.d))
            q, k = rope.apply(q, rope_tables), rope.apply(k, rope_tables)
        o = self.attn(q, k, v, kv[0], kv[1], meta)
        return self.o_proj(o.reshape(T, self.q_size))

    def _fused(self, qkv: torch.Tensor, rope: RotaryEmbedding, kv, meta: AttentionMetadata) -> torch.Tensor:
        """The CPU kernels' path: RoPE and the KV write in one call, on the qkv rows in place."""
        T = qkv.shape[0]
        if self.q_norm is not None:
            qkv[:, :self.q_size] = self.q_norm(qkv[:, :self.q_size].view(T, self.h, self.d)).view(T, -1)
            k = qkv[:, self.q_size:self.q_size + self.kv_size].view(T, self.kvh, self.d)
            qkv[:, self.q_size:self.q_size + self.kv_size] = self.k_norm(k).view(T, -1)
        kernels.rope_write_kv(qkv, self.h, self.kvh, self.d, meta.positions, rope.cos, rope.sin_signed,
                              kv[0], kv[1], meta.slot_mapping)
        q = qkv[:, :self.q_size].view(T, self.h, self.d)
        k = qkv[:, self.q_size:self.q_size + self.kv_size].view(T, self.kvh, self.d)
        v = qkv[:, self.q_size + self.kv_size:].view(T, self.kvh, self.d)
        return self.attn.attend(q, k, v, kv[0], kv[1], meta)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if kernels.usable(gate_up):
            return self.down_proj(kernels.silu_mul(gate_up))
        gate, up = gate_up.split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, block_size: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, block_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, rope, rope_tables, kv, meta):
        x = x + self.self_attn(self.input_layernorm(x), rope, rope_tables, kv, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, block_size: int, max_positions: int):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, block_size) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, max_positions)
        self.requires_grad_(False)
        self.fused_decode = True           # one C call for the whole stack on small decode steps, where it can
        self._fused: tuple | None = None   # (KV pools' address, ctypes layers) once built; () if it can't

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata, logits_indices: torch.Tensor, num_layers: int | None = None) -> torch.Tensor:
        """Returns float32 logits for the tokens at `logits_indices` only (one per sampled sequence).

        `num_layers`: run only the first layers, then the final norm and LM head (self-speculative
        drafting, engine/spec/layerskip.py); their K/V go to those layers' caches as usual."""
        x = self.embed_tokens(input_ids)
        layers = self._fused_layers(x, kv_caches, meta)
        if layers is not None and num_layers is not None and num_layers < len(layers):
            layers = (kernels.Layer * num_layers).from_buffer(layers)   # a view of the first entries
        if layers is not None:
            cfg, attn = self.config, self.layers[0].self_attn.attn
            x = x.contiguous()
            kernels.decode_layers(x, layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                  cfg.intermediate_size, self.norm.eps, meta.positions, self.rope.cos,
                                  self.rope.sin_signed, meta.slot_mapping, meta.decode_block_tables,
                                  meta.decode_context_lens, attn.block_size, attn.scale)
        else:
            tables = self.rope.tables(positions, x.dtype)
            for layer, kv in zip(self.layers[:num_layers], kv_caches):
                x = layer(x, self.rope, tables, kv, meta)
        x = self.norm(x[logits_indices])
        return self.lm_head(x).float()

    def _fused_layers(self, x: torch.Tensor, kv_caches, meta: AttentionMetadata):
        """The ctypes layer table for kernels.decode_layers when this step can take that path: CPU
        float32, decodes only, at most QGEMM_MAX_ROWS of them, and every layer a plain pre-norm block
        whose four linears have tf_qgemm layouts (no bias, no q/k norm, no input scale); else None.
        The same kernels the per-layer path calls, in the same order: the same logits."""
        if (not self.fused_decode or meta.prefills or meta.positions is None or self._fused == ()
                or x.shape[0] > kernels.QGEMM_MAX_ROWS or not kernels.usable(x)):
            return None
        key = kv_caches[0][0].data_ptr() if isinstance(kv_caches[0][0], torch.Tensor) else None
        if self._fused is None or self._fused[0] != key:
            self._fused = self._build_fused(kv_caches) or ()
        return self._fused[1] if self._fused else None

    def _build_fused(self, kv_caches) -> tuple | None:
        cfg = self.config
        if cfg.qk_norm or cfg.qkv_bias or cfg.head_dim > kernels.MAX_HEAD_DIM or cfg.head_dim % 2:
            return None
        table = (kernels.Layer * len(self.layers))()
        keep = []                          # the layouts' tensors: the table holds their addresses
        for entry, layer, (k_cache, v_cache) in zip(table, self.layers, kv_caches):
            if not (isinstance(k_cache, torch.Tensor) and kernels.usable(k_cache, v_cache)):
                return None
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if any(n.eps != self.norm.eps or not kernels.usable(n.weight) for n in norms):
                return None
            linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            layouts = []
            for lin in linears:
                layout = lin.qgemm_layout() if hasattr(lin, "qgemm_layout") else None
                if (layout is None or lin.kernel not in ("auto", "cpu") or lin.bias is not None
                        or getattr(lin, "input_scale", None) is not None
                        or layout[0].shape[1] * (2 if layout[4] == 4 else 1) != lin.in_features):
                    return None
                layouts.append(kernels.QLinear.of(layout))
                keep.append(layout)
            entry.ln1, entry.ln2 = norms[0].weight.data_ptr(), norms[1].weight.data_ptr()
            entry.qkv, entry.o, entry.gate_up, entry.down = layouts
            entry.k_cache, entry.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        return kv_caches[0][0].data_ptr(), table, keep

    def load_hf_weights(self, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        """Copy HF-named weights in, fusing q/k/v and gate/up. Missing or misshapen tensors are errors."""
        cfg = self.config
        used: set[str] = set()

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"weight {name} is missing from the checkpoint")
            used.add(name)
            return weights[name]

        def put(module: nn.Module, value: torch.Tensor, name: str, attr: str = "weight") -> None:
            # The model may have been built on the meta device: replace the parameter, don't copy into it.
            want = tuple(getattr(module, attr).shape)
            if tuple(value.shape) != want:
                raise ValueError(f"weight {name} has shape {tuple(value.shape)}, expected {want}")
            setattr(module, attr, nn.Parameter(value.to(dtype).contiguous(), requires_grad=False))

        put(self.embed_tokens, take("model.embed_tokens.weight"), "model.embed_tokens.weight")
        put(self.norm, take("model.norm.weight"), "model.norm.weight")
        if cfg.tie_word_embeddings or "lm_head.weight" not in weights:
            self.lm_head.weight = self.embed_tokens.weight
        else:
            put(self.lm_head, take("lm_head.weight"), "lm_head.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a = layer.self_attn
            put(a.qkv_proj, torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]), p + "qkv_proj")
            if cfg.qkv_bias:
                put(a.qkv_proj, torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]), p + "qkv bias", "bias")
            put(a.o_proj, take(p + "self_attn.o_proj.weight"), p + "self_attn.o_proj.weight")
            if cfg.qk_norm:
                put(a.q_norm, take(p + "self_attn.q_norm.weight"), p + "self_attn.q_norm.weight")
                put(a.k_norm, take(p + "self_attn.k_norm.weight"), p + "self_attn.k_norm.weight")
            gate_up = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
            put(layer.mlp.gate_up_proj, gate_up, p + "mlp.gate_up_proj")
            put(layer.mlp.down_proj, take(p + "mlp.down_proj.weight"), p + "mlp.down_proj.weight")
            put(layer.input_layernorm, take(p + "input_layernorm.weight"), p + "input_layernorm.weight")
            put(layer.post_attention_layernorm, take(p + "post_attention_layernorm.weight"), p + "post_attention_layernorm.weight")


def build_model(loaded, dtype: torch.dtype, device: str, block_size: int, max_positions: int,
                quantization: str = "auto") -> LlamaModel:
    """Build on the meta device (no wasted random init), move the real weights in, then swap in
    quantized layers as asked (see tokenfab.model.quantize)."""
    from tokenfab.model.quantize import apply_quantization
    from tokenfab.quant.checkpoint import apply_checkpoint, is_quantized_checkpoint

    cfg = loaded.config
    with torch.device("meta"):
        model = LlamaModel(cfg, block_size, max_positions=1)
    model.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, max_positions)
    if is_quantized_checkpoint(loaded.path):     # written by `tokenfab quant`: our own layer names
        if quantization not in ("auto", "none"):
            raise ValueError(f"{loaded.path} is already quantized; leave quantization unset")
        if cfg.tie_word_embeddings:      # tie before loading, so apply_checkpoint keeps one copy
            model.lm_head.weight = model.embed_tokens.weight
        apply_checkpoint(model, loaded.path)
        _cast_float_parameters(model, dtype)
    else:
        model.load_hf_weights(loaded.weights, dtype)
        apply_quantization(model, loaded, quantization)
    return model.to(device)


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


@torch.inference_mode()
def full_logits(model: LlamaModel, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """float32 logits at every position of one sequence, [T, vocab], through a throwaway KV cache.

    For quality evaluation (perplexity, KL against another model), not for serving.
    """
    from tokenfab.model.attention import AttentionMetadata, PrefillChunk

    cfg = model.config
    device = model.embed_tokens.weight.device
    T = len(token_ids)
    nblocks = -(-T // block_size)
    kv = torch.zeros(cfg.num_layers, 2, nblocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                     dtype=model.embed_tokens.weight.dtype, device=device)
    caches = [(kv[i, 0], kv[i, 1]) for i in range(cfg.num_layers)]
    table = torch.arange(nblocks, device=device)
    positions = torch.arange(T, device=device)
    meta = AttentionMetadata(slot_mapping=torch.arange(T, device=device), num_decode_tokens=0,
                             decode_block_tables=None, decode_context_lens=None, decode_max_context=0,
                             prefills=[PrefillChunk(0, T, T, table)], positions=positions)
    ids = torch.tensor(token_ids, device=device)
    return model(ids, positions, caches, meta, positions)
