"""The Llama-family decoder: Llama, SmolLM, Mistral, Qwen2 (QKV bias), Qwen3 (per-head q/k RMSNorm), and
Gemma 3 as a configuration of it (ModelConfig's switches: (1 + weight) norms, four norms per layer,
GeGLU, q/k norms, sliding-window layers with their own RoPE base, scaled embeddings and attention).
Mixture-of-experts layers (Qwen3-MoE, Mixtral, OLMoE, gpt-oss) replace a layer's MLP by model/moe.py's
`MoE`, whose experts are this file's `MLP`. gpt-oss adds biases on the attention output and the experts, the
clamped SwiGLU, and a learned sink logit per head (`Attention.sinks`, run by the torch attention path).

It runs a flat batch: `input_ids` and `positions` concatenated over all sequences of a step, with the
attention layout in an `AttentionMetadata` passed in by the runner. Projections are plain `nn.Linear`
modules (Q/K/V fused into `qkv_proj`, gate/up into `gate_up_proj`: fewer, larger matmuls per step),
so tokenfab.quant can swap them for quantized ones by name. Which kernels run the linears and the
attention is chosen once at load, behind two seams below this module: `tokenfab.kernels.linear`
(each linear's plan) and `tokenfab.model.backends` (the attention backend). The model imports no
quantization code; tokenfab.quant.load builds quantized models on top of it.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from tokenfab import kernels
from tokenfab.model.attention import AttentionMetadata
from tokenfab.model.config import ModelConfig
from tokenfab.model.layers import RMSNorm, RotaryEmbedding
from tokenfab.model.moe import MoE

ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "swiglu_oai")


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, block_size: int, index: int = 0):
        super().__init__()
        # a sliding layer's query attends to the last `window` positions, itself included (else None)
        self.window = cfg.sliding_window if cfg.is_sliding(index) else None
        self.h, self.kvh, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.h * self.d, self.kvh * self.d
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        # gpt-oss: per head, a logit that joins every softmax's denominator and weighs no value
        self.sinks = nn.Parameter(torch.zeros(self.h), requires_grad=False) if cfg.attn_sinks else None
        # per head (Qwen3, Gemma 3), or over the whole projection (OLMoE: qk_norm_full)
        self.qk_full = cfg.qk_norm_full
        q_width, k_width = (self.q_size, self.kv_size) if self.qk_full else (self.d, self.d)
        self.q_norm = RMSNorm(q_width, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_width, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.block_size = block_size
        self.backend = None                 # the model's AttentionBackend (model/backends.py), set at load
        self.o_bf16 = False                 # the backend may hand o_proj bfloat16 rows (set at load by it)

    def forward(self, x, rope: RotaryEmbedding, rope_tables, kv: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.q_norm is not None and self.qk_full:
            qkv = qkv.contiguous()
            qkv[:, :self.q_size] = self.q_norm(qkv[:, :self.q_size])
            qkv[:, self.q_size:self.q_size + self.kv_size] = self.k_norm(qkv[:, self.q_size:self.q_size + self.kv_size])
        elif self.q_norm is not None:
            qkv = qkv.contiguous()
            qkv[:, :self.q_size] = self.q_norm(qkv[:, :self.q_size].view(T, self.h, self.d)).view(T, -1)
            k = qkv[:, self.q_size:self.q_size + self.kv_size].view(T, self.kvh, self.d)
            qkv[:, self.q_size:self.q_size + self.kv_size] = self.k_norm(k).view(T, -1)
        o = self.backend.attention(self, qkv, rope, rope_tables, kv, meta)
        return self.o_proj(o.reshape(T, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None, bias: bool = False):
        """`intermediate_size`: a mixture-of-experts expert's width (default: the dense MLP's); `bias`: both
        projections have one (gpt-oss's experts)."""
        super().__init__()
        self.inter = intermediate_size or cfg.intermediate_size
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {cfg.hidden_act!r}; supported: {', '.join(ACTIVATIONS)}")
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"       # GeGLU (Gemma) instead of SwiGLU
        # gpt-oss's clamped SwiGLU (torch only: the C kernels have the plain two)
        self.clamped = (cfg.swiglu_alpha, cfg.swiglu_limit) if cfg.hidden_act == "swiglu_oai" else None
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=bias)
        self.down_proj = nn.Linear(self.inter, cfg.hidden_size, bias=bias)
        self.c_kernel = False               # C SwiGLU / GeGLU; set once at load by the cpu backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.clamped is not None:        # as transformers' GptOssExperts, op for op
            alpha, limit = self.clamped
            gate, up = gate_up.split(self.inter, dim=-1)
            gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
            return self.down_proj((up + 1) * (gate * torch.sigmoid(gate * alpha)))
        if self.c_kernel:       # the one-call decode stack's kernels, so both paths give the same logits
            if gate_up.dtype == torch.bfloat16:    # x came bf16 from the norm (RMSNorm.feeds), for the bf16 GEMM
                if not self.gelu and self.down_proj.takes_bf16(gate_up.shape[0]):
                    return self.down_proj(kernels.silu_mul(gate_up)).float()   # bf16 in, bf16 out, same bits
                gate_up = gate_up.float()
            return self.down_proj(kernels.gelu_tanh_mul(gate_up) if self.gelu else kernels.silu_mul(gate_up))
        if self.gelu:
            gate, up = gate_up.split(self.inter, dim=-1)
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        gate, up = gate_up.split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, block_size: int, index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, block_size, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = (MoE(cfg, lambda: MLP(cfg, cfg.moe_intermediate_size, cfg.expert_bias)) if cfg.is_moe(index)
                    else MLP(cfg))
        # Gemma: post_attention_layernorm normalizes the attention output, and the MLP gets its own
        # pre and post norms (Llama's post_attention_layernorm is the MLP's input norm)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, rope, rope_tables, kv, meta):
        if self.sandwich:
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, rope_tables, kv, meta))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        h, x = self.post_attention_layernorm.add_forward(x, self.self_attn(self.input_layernorm(x), rope,
                                                                             rope_tables, kv, meta))
        return x + self.mlp(h)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, block_size: int, max_positions: int):
        super().__init__()
        self.config = cfg
        # an uninitialised weight: Embedding's own init (normal_) on the meta device imports torch._dynamo
        # (the loader replaces the weight anyway)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, block_size, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.make_ropes(max_positions)
        self.requires_grad_(False)
        self.attention_backend = None      # chosen once at load: set_attention_backend

    def make_ropes(self, max_positions: int) -> None:
        """RoPE tables for every position: one base (scaled as `rope_scaling` says), (Gemma 3) a second,
        unscaled one for the sliding layers, and (SmolLM3) tables that rotate nothing for its NoPE layers."""
        cfg = self.config
        with torch.device("cpu"):       # real tables even while the model is built on the meta device: torch's
            self._make_ropes(cfg, max_positions)     # meta kernels import torch._dynamo (2 s of every start)

    def _make_ropes(self, cfg: ModelConfig, max_positions: int) -> None:
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, max_positions, cfg.rope_scaling, cfg.rotary_dim)
        self.rope_local = (RotaryEmbedding(cfg.head_dim, cfg.rope_local_theta, max_positions)
                           if cfg.rope_local_theta and (cfg.rope_local_theta != cfg.rope_theta or cfg.rope_scaling)
                           else None)
        self.rope_none = RotaryEmbedding.identity(cfg.head_dim, max_positions) if any(cfg.nope_layers) else None

    def set_attention_backend(self, backend) -> None:
        """Install an AttentionBackend (model/backends.py) in every layer, once, at load."""
        self.attention_backend = backend
        for layer in self.layers:
            layer.self_attn.backend = backend
        backend.install(self)

    def default_backend(self, name: str = "auto", kv_dtype: torch.dtype | None = None, **opts):
        from tokenfab.model.backends import make_attention_backend
        cfg, w = self.config, self.embed_tokens.weight
        return make_attention_backend(name, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                                      head_dim=cfg.head_dim, block_size=self.layers[0].self_attn.block_size,
                                      device=w.device.type,
                                      dtype=w.dtype, kv_dtype=kv_dtype or w.dtype, scale=cfg.attn_scale, **opts)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata, logits_indices: torch.Tensor, num_layers: int | None = None) -> torch.Tensor:
        """Returns float32 logits for the tokens at `logits_indices` only (one per sampled sequence).

        `num_layers`: run only the first layers, then the final norm and LM head (self-speculative
        drafting, engine/spec/layerskip.py); their K/V go to those layers' caches as usual."""
        x = self.embed_tokens(input_ids)
        if self.config.embed_scale is not None:     # as HF: the scale rounded to the compute dtype first
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        if self.attention_backend is None:          # built by hand, not loaded: the automatic choice, once
            self.set_attention_backend(self.default_backend())
        # the cpu backend's one-call decode stack, else the layers one by one
        if not self.attention_backend.run_stack(self, x, kv_caches, meta, num_layers):
            tables = self.rope.tables(positions, x.dtype)
            local = self.rope_local
            local_tables = local.tables(positions, x.dtype) if local is not None else None
            # sliding layers read their own pool when the runner gave them one (engine/sliding_kv.py)
            sliding_meta = meta.sliding or meta
            none = self.rope_none
            none_tables = none.tables(positions, x.dtype) if none is not None else None
            for i, (layer, kv) in enumerate(zip(self.layers[:num_layers], kv_caches)):
                if none is not None and self.config.is_nope(i):
                    x = layer(x, none, none_tables, kv, meta)
                elif local is not None and layer.self_attn.window is not None:
                    x = layer(x, local, local_tables, kv, sliding_meta)
                elif layer.self_attn.window is not None:
                    x = layer(x, self.rope, tables, kv, sliding_meta)
                else:
                    x = layer(x, self.rope, tables, kv, meta)
        x = self.norm(x[logits_indices])
        return self.lm_head(x).float()

    def load_hf_weights(self, weights: Mapping[str, torch.Tensor], dtype: torch.dtype) -> None:
        """Copy HF-named weights in, fusing q/k/v and gate/up. Missing or misshapen tensors are errors.

        Layers already replaced (quant/load.py swaps a GGUF file's native layers in first) are left
        as they are, and their float weights are never read."""
        cfg = self.config

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"weight {name} is missing from the checkpoint")
            return weights[name]

        def put(module: nn.Module, value: torch.Tensor, name: str, attr: str = "weight",
                as_dtype: torch.dtype | None = None) -> None:
            # The model may have been built on the meta device: replace the parameter, don't copy into it.
            want = tuple(getattr(module, attr).shape)
            if tuple(value.shape) != want:
                raise ValueError(f"weight {name} has shape {tuple(value.shape)}, expected {want}")
            setattr(module, attr, nn.Parameter(value.to(as_dtype or dtype).contiguous(), requires_grad=False))

        def put_linear(owner: nn.Module, attr: str, sources: list[str], name: str) -> None:
            module = getattr(owner, attr)
            if type(module) is not nn.Linear:     # a quantized layer already in place
                return
            put(module, torch.cat([take(s + ".weight") for s in sources]), name)
            if module.bias is not None:
                put(module, torch.cat([take(s + ".bias") for s in sources]), name + " bias", "bias")

        def put_norm(module: nn.Module, name: str) -> None:
            w = take(name)
            if cfg.norm_offset:            # Gemma: x * (1 + w), computed in float32 as HF does
                w = cfg.norm_offset + w.float()
            put(module, w, name)

        if type(self.embed_tokens) is nn.Embedding:    # else served from the quantized head's rows
            put(self.embed_tokens, take("model.embed_tokens.weight"), "model.embed_tokens.weight")
        put_norm(self.norm, "model.norm.weight")
        if cfg.logits_scaling:          # Granite: logits / s, as the final norm's weight / s (the head is linear)
            self.norm.weight = nn.Parameter(self.norm.weight / cfg.logits_scaling, requires_grad=False)
        if cfg.tie_word_embeddings or "lm_head.weight" not in weights:
            if type(self.lm_head) is nn.Linear:
                self.lm_head.weight = self.embed_tokens.weight
        else:
            put_linear(self, "lm_head", ["lm_head"], "lm_head.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a = layer.self_attn
            put_linear(a, "qkv_proj", [p + f"self_attn.{n}_proj" for n in "qkv"], p + "qkv_proj")
            put_linear(a, "o_proj", [p + "self_attn.o_proj"], p + "self_attn.o_proj.weight")
            if a.sinks is not None:
                put(a, take(p + "self_attn.sinks"), p + "self_attn.sinks", "sinks", torch.float32)
            if cfg.qk_norm:
                put_norm(a.q_norm, p + "self_attn.q_norm.weight")
                put_norm(a.k_norm, p + "self_attn.k_norm.weight")
            if isinstance(layer.mlp, MoE):    # the router stays float32 (model/moe.py); each expert an MLP
                put(layer.mlp, take(p + "mlp.gate.weight"), p + "mlp.gate.weight", "router", torch.float32)
                if layer.mlp.router_bias is not None:
                    put(layer.mlp, take(p + "mlp.gate.bias"), p + "mlp.gate.bias", "router_bias", torch.float32)
                experts = [(expert, f"{p}mlp.experts.{e}.") for e, expert in enumerate(layer.mlp.experts)]
            else:
                experts = [(layer.mlp, p + "mlp.")]
            for mlp, q in experts:
                put_linear(mlp, "gate_up_proj", [q + "gate_proj", q + "up_proj"], q + "gate_up_proj")
                put_linear(mlp, "down_proj", [q + "down_proj"], q + "down_proj.weight")
            put_norm(layer.input_layernorm, p + "input_layernorm.weight")
            put_norm(layer.post_attention_layernorm, p + "post_attention_layernorm.weight")
            if layer.sandwich:
                put_norm(layer.pre_feedforward_layernorm, p + "pre_feedforward_layernorm.weight")
                put_norm(layer.post_feedforward_layernorm, p + "post_feedforward_layernorm.weight")


@torch.inference_mode()
def full_logits(model: LlamaModel, token_ids: list[int], block_size: int = 16,
                kv_dtype: torch.dtype | None = None) -> torch.Tensor:
    """float32 logits at every position of one sequence, [T, vocab], through a throwaway KV cache
    (of the model's dtype, or `kv_dtype`: e.g. float16 pools).

    For quality evaluation (perplexity, KL against another model), not for serving.
    """
    from tokenfab.model.attention import AttentionMetadata, PrefillChunk

    cfg = model.config
    device = model.embed_tokens.weight.device
    T = len(token_ids)
    nblocks = -(-T // block_size)
    kv = torch.zeros(cfg.num_layers, 2, nblocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                     dtype=kv_dtype or model.embed_tokens.weight.dtype, device=device)
    caches = [(kv[i, 0], kv[i, 1]) for i in range(cfg.num_layers)]
    table = torch.arange(nblocks, device=device)
    positions = torch.arange(T, device=device)
    meta = AttentionMetadata(slot_mapping=torch.arange(T, device=device), num_decode_tokens=0,
                             decode_block_tables=None, decode_context_lens=None, decode_max_context=0,
                             prefills=[PrefillChunk(0, T, T, table)], positions=positions)
    ids = torch.tensor(token_ids, device=device)
    return model(ids, positions, caches, meta, positions)
