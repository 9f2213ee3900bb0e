"""Attention backends: how a decoder layer turns its qkv rows into attention output, chosen once at load.

    backend = make_attention_backend("auto", device="cpu", dtype=torch.float32, kv_dtype=torch.float32)
    model.set_attention_backend(backend)

- **torch**: the portable path (model/attention.py): RoPE in torch, `index_copy_` K/V writes, gather +
  SDPA. Runs on CPU and CUDA, any dtype, the int8 KV cache; the reference every backend must match.
- **cpu**: tokenfab's C kernels (tokenfab/kernels): RoPE and the K/V write in one pass over the qkv
  rows, decode attention straight from the paged pools (no gather), and C RMSNorm and SiLU- or
  GeLU-and-multiply in every layer. On a decode step of few rows whose linears all run `tf_qgemm` (the
  measured plan says so; the default Q4_1 GGUF, Gemma 3 270M's Q4_K_M) it runs the whole decoder stack
  in one ctypes call (`tf_decode_layers`): the same kernels in the same order, the same logits,
  without ~10 Python calls per layer. Gemma 3's extra steps (q/k norms, norms on the attention and MLP
  outputs, GeGLU, sliding layers with their own pool and RoPE base) are per-layer fields of its layer
  table. Steps whose prefill chunks are short (context of at most `paged_prefill_max_context` tokens,
  128 by default) run all their attention, decodes and prefills, as one call of the paged decode
  kernel: every query token is a row reading its sequence's pools in place up to its own position
  (attention.token_rows), in float32. Longer chunks stay on torch's SDPA, in bfloat16 (AMX /
  AVX512-BF16) from the chunk size where the qkv projection already runs the lossy bf16 kernel
  (`prefill_attention_dtype`, see bf16_prefill_rows). float32 on the CPU only; the KV pools float32 or
  float16 (kv_cache_dtype, read by the layer path and the one-call stack alike); with the int8 KV cache attention falls back to the
  torch path (the C norms stay), and so do layers with attention sinks (gpt-oss: the C kernels have no sink
  term; model/attention.py's sink_attention runs them).

"auto" takes cpu where it can run (kernels built, CPU, float32), else torch. Every choice is made here,
once; the forward pass never asks again.
"""
from __future__ import annotations

import itertools
from typing import Protocol

import torch

from tokenfab import kernels, registry
from tokenfab.kernels.tuning import STACK_BIG_KERNELS
from tokenfab.model.attention import AttentionMetadata, TorchPagedAttention, token_rows

ATTENTION_BACKENDS = ("auto", "torch", "cpu")
registry.register("attention_backend", *ATTENTION_BACKENDS)
BF16_ACTIVATION_KERNELS = ("bf16", "qbf16")    # linear kernels that round their activations to bfloat16


class AttentionBackend(Protocol):
    name: str

    def install(self, model) -> None:
        """Set the per-module choices this backend implies (e.g. C norms), once."""

    def attention(self, layer, qkv: torch.Tensor, rope, rope_tables, kv, meta: AttentionMetadata) -> torch.Tensor:
        """qkv [T, (H + 2 KVH) D] (q/k norms applied) -> attention output [T, H, D]; writes the new K/V."""

    def run_stack(self, model, x: torch.Tensor, kv_caches, meta: AttentionMetadata,
                  num_layers: int | None = None) -> bool:
        """Run the decoder stack (its first `num_layers` layers, or all) on x in place if this backend
        has a one-call path for this step; False: the model runs its layers one by one."""

    def describe(self) -> str:
        ...


class TorchBackend:
    """The portable path: see the module docstring."""
    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int):
        self.paged = TorchPagedAttention(num_heads, num_kv_heads, head_dim, block_size)

    def install(self, model) -> None:
        _set_c_ops(model, False)

    def attention(self, layer, qkv, rope, rope_tables, kv, meta):
        T, h, kvh, d = qkv.shape[0], layer.h, layer.kvh, layer.d
        v = qkv[:, layer.q_size + layer.kv_size:].view(T, kvh, d)
        # q and k sit side by side in each row: rotate them in one go
        qk = rope.apply(qkv[:, :layer.q_size + layer.kv_size].view(T, h + kvh, d), rope_tables)
        return self.paged(qk[:, :h], qk[:, h:], v, kv[0], kv[1], meta, layer.window, layer.sinks)

    def run_stack(self, model, x, kv_caches, meta, num_layers=None) -> bool:
        return False

    def describe(self) -> str:
        return "torch (gather + SDPA)"


class CpuPagedAttention(TorchPagedAttention):
    """Decodes (sliding windows too) read the float32 or float16 pools in place through
    tf_paged_decode_attention; prefills use SDPA, in bfloat16 for chunks of at least `bf16_rows` tokens
    (None: never; see bf16_prefill_rows) while `bf16_now` (CpuBackend sets it per step under "auto":
    this step's qkv projection ran the bf16 kernel)."""
    bf16_rows: int | None = None
    bf16_now: bool = True
    bf16_out: bool = False    # a bf16 chunk's output may stay bfloat16 (CpuBackend: the o projection takes it)

    def _prefill(self, q, k, v, k_cache, v_cache, p, window=None, sinks=None):
        if self.bf16_rows is None or not self.bf16_now or p.query_len < self.bf16_rows or sinks is not None:
            return super()._prefill(q, k, v, k_cache, v_cache, p, window, sinks)
        b = torch.bfloat16        # a cached context is gathered and cast to q's dtype by the base class
        o = super()._prefill(q.to(b), k.to(b), v.to(b), k_cache, v_cache, p, window)
        return o if self.bf16_out else o.to(q.dtype)

    # The base class's _decode_any picks between these two (a window that covers every context is none)
    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        return self._decode_window(q, k_cache, v_cache, meta, None)

    def _decode_window(self, q, k_cache, v_cache, meta: AttentionMetadata, window: int | None) -> torch.Tensor:
        # straight from the paged pools, no gather copy; a sliding layer's window is the kernel's start offset
        return kernels.decode_attention(q.reshape(q.shape[0], -1), k_cache, v_cache, meta.decode_block_tables,
                                        meta.decode_context_lens, self.num_heads, self.num_kv_heads, self.scale,
                                        window)


class CpuBackend(TorchBackend):
    """tokenfab's C kernels: see the module docstring."""
    name = "cpu"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, *,
                 c_attention: bool = True, fused_decode: bool = True, fused_max_tokens: int = 16,
                 fused_big_max_tokens: int = 0, bf16_prefill_rows: int | None = None,
                 bf16_prefill_auto: bool = False, paged_prefill_max_context: int = 0):
        super().__init__(num_heads, num_kv_heads, head_dim, block_size)
        self.c_attention = c_attention and head_dim <= kernels.MAX_HEAD_DIM
        self.cpu_paged = CpuPagedAttention(num_heads, num_kv_heads, head_dim, block_size)
        self.cpu_paged.bf16_rows = bf16_prefill_rows
        # auto: bf16 attention only in steps whose qkv projection ran the bf16 kernel (a plan forced
        # after load, e.g. set_kernel(model, "dequant") in the tests, keeps the step float32)
        self.bf16_follows_qkv = bf16_prefill_auto and bf16_prefill_rows is not None
        self.fused_decode = fused_decode and self.c_attention
        self.fused_max_tokens = fused_max_tokens
        self.fused_big_max_tokens = fused_big_max_tokens
        self.paged_prefill_max_context = paged_prefill_max_context if self.c_attention else 0
        self._stack: tuple | None = None    # (KV pools' address, row counts, ctypes layers, kept tensors) or ()

    def install(self, model) -> None:
        _set_c_ops(model, True)
        _set_bf16_feeds(model)
        self._stack = None

    def attention(self, layer, qkv, rope, rope_tables, kv, meta):
        qkv = qkv.float()           # bf16 rows from the bf16 GEMM on a norm's bf16 output (_set_bf16_feeds)
        # attention sinks (gpt-oss) have no C kernel: those layers attend on the torch path
        if not self.c_attention or meta.positions is None or layer.sinks is not None:
            return super().attention(layer, qkv, rope, rope_tables, kv, meta)
        qkv = qkv.contiguous()
        T = qkv.shape[0]
        kernels.rope_write_kv(qkv, layer.h, layer.kvh, layer.d, meta.positions, rope.cos, rope.sin_signed,
                              kv[0], kv[1], meta.slot_mapping)
        q = qkv[:, :layer.q_size].view(T, layer.h, layer.d)
        k = qkv[:, layer.q_size:layer.q_size + layer.kv_size].view(T, layer.kvh, layer.d)
        v = qkv[:, layer.q_size + layer.kv_size:].view(T, layer.kvh, layer.d)
        if meta.prefills and self._paged_prefill(meta, layer.window):
            bt, ctx = token_rows(meta)   # every token a row of the decode kernel, reading the pools in place
            return kernels.decode_attention(qkv[:, :layer.q_size], kv[0], kv[1], bt, ctx, layer.h, layer.kvh,
                                            self.cpu_paged.scale, layer.window)
        if meta.prefills and kv[0].dtype != qkv.dtype:   # float16 pools: prefills attend to what they hold
            k, v = k.to(kv[0].dtype).to(qkv.dtype), v.to(kv[1].dtype).to(qkv.dtype)
        if self.bf16_follows_qkv and meta.prefills:
            plan = getattr(layer.qkv_proj, "plan", None)
            self.cpu_paged.bf16_now = plan is not None and plan.kernel_at(T).kernel.name in BF16_ACTIVATION_KERNELS
            self.cpu_paged.bf16_out = layer.o_bf16 and layer.o_proj.takes_bf16(T)
        return self.cpu_paged.attend(q, k, v, kv[0], kv[1], meta, layer.window)

    def _paged_prefill(self, meta: AttentionMetadata, window: int | None) -> bool:
        """Whether this step's prefill chunks are short enough for the paged decode kernel: each context
        (cached + new tokens) at most paged_prefill_max_context, and within a sliding layer's window (its
        pool may hold only the window, so a longer chunk's first tokens may be overwritten by its last)."""
        limit = self.paged_prefill_max_context if window is None else min(self.paged_prefill_max_context, window)
        return all(p.context_len <= limit for p in meta.prefills)

    def run_stack(self, model, x, kv_caches, meta, num_layers=None) -> bool:
        if not self.fused_decode or meta.prefills or meta.positions is None or self._stack == ():
            return False
        key = kv_caches[0][0].data_ptr()
        if self._stack is None or self._stack[0] != key:
            self._stack = _build_stack(model, kv_caches, self.fused_max_tokens, self.fused_big_max_tokens) or ()
            if not self._stack:
                return False
        if x.shape[0] not in self._stack[1]:
            return False
        cfg, paged = model.config, self.cpu_paged
        layers = self._stack[2]
        if num_layers is not None and num_layers < len(layers):   # self-speculative drafting: a prefix view
            layers = (kernels.Layer * num_layers).from_buffer(layers)
        # global layers read the step's metadata and RoPE; sliding ones (Gemma 3) their own pool's
        # metadata when the runner gave one (engine/sliding_kv.py) and the local RoPE base where it differs
        # and NoPE layers (SmolLM3) the global metadata with tables that rotate nothing
        views = (kernels.StepView * 3)(kernels.StepView.of(meta, model.rope),
                                       kernels.StepView.of(meta.sliding or meta, model.rope_local or model.rope),
                                       kernels.StepView.of(meta, model.rope_none or model.rope))
        kernels.decode_layers(x, layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                              cfg.intermediate_size, model.norm.eps, cfg.hidden_act, views, paged.block_size,
                              paged.scale)
        return True

    @property
    def stack_rows(self) -> int:
        """The most rows a decode step may have and take the one-call stack (0: none, or not built yet)."""
        return max(self._stack[1]) if self._stack else 0

    def describe(self) -> str:
        attn = "C decode attention, RoPE+KV write" if self.c_attention else "torch attention (int8 KV)"
        stack = (f"one-call decode stack at {_row_ranges(self._stack[1])} rows" if self.stack_rows
                 else "one-call decode stack " + ("checked at the first decode step" if self._stack is None else "off"))
        if self.paged_prefill_max_context:
            attn += f"; prefill chunks of up to {self.paged_prefill_max_context} tokens of context by the decode kernel"
        rows = self.cpu_paged.bf16_rows
        if rows is not None:
            attn += f"; prefill attention in bfloat16 from {rows} tokens"
        return f"cpu ({attn}, C norms; {stack})" if self.fused_decode else f"cpu ({attn}, C norms)"


def _row_ranges(rows) -> str:
    """{1, 2, 3, 5} -> "1-3, 5"."""
    out = []
    for _, run in itertools.groupby(enumerate(sorted(rows)), lambda p: p[1] - p[0]):
        run = [r for _, r in run]
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)


def _set_c_ops(model, on: bool) -> None:
    from tokenfab.model.layers import RMSNorm
    from tokenfab.model.llama import MLP
    for m in model.modules():
        if isinstance(m, (RMSNorm, MLP)):
            m.c_kernel = on
            if isinstance(m, RMSNorm):
                m.feeds = None
    for layer in model.layers:
        layer.self_attn.o_bf16 = False


def _set_bf16_feeds(model) -> None:
    """Let each layer's pre-attention and pre-MLP norm write bfloat16 rows in steps where the linear it
    feeds runs the bf16 kernel (KernelLinear.takes_bf16, decided per call by row count), and the SwiGLU
    kernel read and write bf16 between the gate/up and down GEMMs: the kernels round as `.to(bfloat16)`
    did, so the logits are unchanged, and a 512-token prefill skips four float32 round trips per layer.
    A bf16 prefill chunk's attention output likewise stays bf16 into the o projection, whose bf16 result
    the residual add reads as it is (RMSNorm.add_forward). Not for q/k-norm layers (their norms read the
    qkv rows in float32 before attention), nor the o projection of sandwich-norm layers (a norm reads it)."""
    from tokenfab.kernels.linear import KernelLinear
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        mlp_norm = layer.pre_feedforward_layernorm if layer.sandwich else layer.post_attention_layernorm
        attn.o_bf16 = not layer.sandwich and isinstance(attn.o_proj, KernelLinear)
        if attn.q_norm is None and isinstance(attn.qkv_proj, KernelLinear):
            layer.input_layernorm.feeds = attn.qkv_proj
        if isinstance(getattr(mlp, "gate_up_proj", None), KernelLinear) and isinstance(mlp.down_proj, KernelLinear):
            mlp_norm.feeds = mlp.gate_up_proj       # a dense MLP (an MoE layer's router reads float32 rows)


def _stack_reach(plan, cap: int) -> tuple[tuple[tuple[int, int], ...], int]:
    """At which row counts up to cap the one-call stack can run this plan, as ranges ((lo, hi), ...), and
    from which row count it runs the layout's big-batch kernel (0: never): the first choice's rows (a
    stack kernel, the caller checked), then the rows of every choice of that layout's big-batch kernel
    (STACK_BIG_KERNELS: a qtile layout's `qbf16`, a qgemm layout's `qmadd`). Rows another kernel takes in
    between (a float copy the table picked at 17-32 rows, say) are left out, and the stack runs the
    ranges on either side; once the big-batch kernel has started, the first kernel again ends the reach."""
    first, runs, big_from, lo = plan.choices[0], [], 0, 1
    for c in plan.choices:
        hi = cap if c.max_rows is None else min(c.max_rows, cap)
        big = c is not first and c.state is first.state and c.kernel.name in STACK_BIG_KERNELS
        if c is not first and not big and big_from and c.state is first.state:
            break                       # back to the first kernel: tf_stack_linear would run the big one
        if c is first or big:
            big_from = big_from or (lo if big else 0)
            if runs and runs[-1][1] == lo - 1:
                runs[-1] = (runs[-1][0], hi)
            else:
                runs.append((lo, hi))
        lo = hi + 1
        if lo > cap:
            break
    return tuple(runs), big_from


def _build_stack(model, kv_caches, cap: int, big_cap: int = 0) -> tuple | None:
    """The ctypes layer table for kernels.decode_layers, and the most rows it may take: every layer a
    pre-norm block without bias or input scale (q/k norms, output norms, GeGLU and sliding windows are
    the table's per-layer fields: Qwen3, Gemma 3) whose four linears' plans run tf_qgemm (or tf_qdot,
    through tf_qgemm's flag) from 1 row up; the row counts (a set) are those at which the stack can run
    every linear (_stack_reach: a qgemm or qtile layout's range, then its big-batch kernel's), up to
    max(cap, big_cap).
    None if it can't."""
    from tokenfab.kernels.linear import KernelLinear
    from tokenfab.kernels.tuning import STACK_KERNELS, default_plan

    cfg = model.config
    # the C layer table has a dense MLP and per-head q/k norms: MoE models run layer by layer (model/moe.py)
    if cfg.qkv_bias or cfg.head_dim > kernels.MAX_HEAD_DIM or cfg.head_dim % 2 \
            or cfg.hidden_act not in kernels.ACTIVATIONS or cfg.num_experts or cfg.qk_norm_full or cfg.attn_sinks:
        return None
    limit = max(cap, big_cap)
    rows = set(range(1, limit + 1))
    table = (kernels.Layer * len(model.layers))()
    keep = []                          # the layouts' tensors: the table holds their addresses
    for i, (entry, layer, (k_cache, v_cache)) in enumerate(zip(table, model.layers, kv_caches)):
        if not isinstance(k_cache, torch.Tensor) or not (
                k_cache.dtype == torch.float32
                or (k_cache.dtype == torch.float16 and kernels.f16_pools(cfg.head_dim) is None)):
            return None
        attn = layer.self_attn
        # (input norm, MLP input norm, attention output norm, MLP output norm): Gemma 3's sandwich, or
        # Llama's two with no output norms
        if layer.sandwich:
            norms = (layer.input_layernorm, layer.pre_feedforward_layernorm,
                     layer.post_attention_layernorm, layer.post_feedforward_layernorm)
        else:
            norms = (layer.input_layernorm, layer.post_attention_layernorm, None, None)
        qk = (attn.q_norm, attn.k_norm) if attn.q_norm is not None else (None, None)
        if any(n is not None and (n.eps != model.norm.eps or n.weight.dtype != torch.float32
                                  or not n.weight.is_contiguous()) for n in norms + qk):
            return None
        qkv = attn.qkv_proj
        # a qkv of two block types (ConcatLinear, llama.cpp's mixed files): the stack runs each part's layout
        qkv_parts = list(qkv.parts) if getattr(qkv, "parts", None) is not None and qkv.bias is None else [qkv]
        if len(qkv_parts) > 2:
            return None
        linears = (*qkv_parts, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        layouts = []
        for lin in linears:
            if not isinstance(lin, KernelLinear) or lin.bias is not None or lin.input_scale_tensor is not None:
                return None
            if lin.plan is None:
                lin.plan = default_plan(lin)
            first = lin.plan.choices[0]
            layout = first.state
            if first.kernel.name not in STACK_KERNELS or kernels.layout_in_features(layout) != lin.in_features:
                return None
            reach, big_from = _stack_reach(lin.plan, limit)
            rows &= {r for lo, hi in reach for r in range(lo, hi + 1)}
            layouts.append(kernels.QLinear.of(layout, big_from))
            keep.append(layout)
        entry.ln1, entry.ln2, entry.attn_out_norm, entry.mlp_out_norm = (
            None if n is None else n.weight.data_ptr() for n in norms)
        entry.q_norm, entry.k_norm = (None if n is None else n.weight.data_ptr() for n in qk)
        entry.window = attn.window or 0
        entry.nope = int(model.config.is_nope(i))
        if len(qkv_parts) == 2:
            entry.qkv_rest, entry.qkv_split = layouts.pop(1), qkv_parts[0].out_features
        entry.qkv, entry.o, entry.gate_up, entry.down = layouts
        entry.k_cache, entry.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        entry.kv_half = int(k_cache.dtype == torch.float16)
    return kv_caches[0][0].data_ptr(), frozenset(rows), table, keep


def bf16_prefill_rows(model, setting: str = "auto") -> int | None:
    """From how many tokens a prefill chunk's attention runs in bfloat16 on the cpu backend (None: never).

    "bfloat16": from one token; "float32": never; "auto": where the step is at bf16 precision already,
    i.e. from the smallest row count at which the first layer's qkv projection runs a lossy kernel that
    rounds its activations to bf16 (BF16_ACTIVATION_KERNELS: "bf16" also hands back bf16 results, so V
    reaches attention bf16-exact; "qbf16" computes the same products and keeps float32 sums), on a CPU
    with bf16 units. SDPA over 512 tokens of SmolLM2-135M's heads takes 2.0 ms in bf16 (casts included)
    against 4.5 ms in float32 (one thread, Sapphire Rapids VM), a third of a 512-token prefill."""
    if setting == "bfloat16":
        return 1
    if setting == "float32" or not kernels.cpu_flags() & {"amx_bf16", "avx512_bf16"}:
        return None
    plan = getattr(model.layers[0].self_attn.qkv_proj, "plan", None)
    lower = 1
    for c in getattr(plan, "choices", ()):
        if c.kernel.name in BF16_ACTIVATION_KERNELS:
            return lower
        if c.max_rows is None:
            break
        lower = c.max_rows + 1
    return None


def c_float16_pools(attention_backend: str, device: str, head_dim: int, tensor_parallel_size: int = 1) -> bool:
    """Whether kv_cache_dtype "auto" takes float16 pools: the cpu backend will run (float32 compute is the
    caller's check) and its kernels read float16 pools for this head size. They halve the bytes decode
    attention reads, its biggest cost at 32-64 streams (benchmarks/batch_decode_step.py, docs/quant.md);
    the bundled model's greedy output still equals transformers' on the oracle prompts. Tensor-parallel
    ranks keep their compute dtype (every rank decides alike without asking the C build)."""
    return (attention_backend in ("auto", "cpu") and torch.device(device).type == "cpu" and tensor_parallel_size == 1
            and kernels.enabled() and kernels.f16_pools(head_dim) is None)


def make_attention_backend(name: str, *, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                           device: str, dtype: torch.dtype, kv_dtype: torch.dtype, fused_decode: bool = True,
                           fused_max_tokens: int = 16, fused_big_max_tokens: int = 0, scale: float | None = None,
                           bf16_prefill_rows: int | None = None, bf16_prefill_auto: bool = False,
                           paged_prefill_max_context: int = 0) -> AttentionBackend:
    """The backend `name` ("auto" | "torch" | "cpu") for this model and machine; ValueError saying why
    when "cpu" is asked for where it cannot run."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")
    why = None
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        why = "it needs float32 on the CPU"
    elif not kernels.enabled():
        why = "tokenfab's C kernels are not built (no C compiler, a failed build or TOKENFAB_CPU_KERNELS=0)"
    dims = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size)
    if name == "torch" or (name == "auto" and why):
        backend = TorchBackend(**dims)
    elif why:
        raise ValueError(f"attention_backend='cpu' cannot run here: {why}; use 'auto' or 'torch'")
    else:
        c_attention = kv_dtype == torch.float32 or (kv_dtype == torch.float16 and kernels.f16_pools(head_dim) is None)
        backend = CpuBackend(**dims, c_attention=c_attention, fused_decode=fused_decode,
                             fused_max_tokens=fused_max_tokens, fused_big_max_tokens=fused_big_max_tokens,
                             bf16_prefill_rows=bf16_prefill_rows, bf16_prefill_auto=bf16_prefill_auto,
                             paged_prefill_max_context=paged_prefill_max_context)
    if scale is not None:           # Gemma 3: query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5
        for paged in (backend.paged, getattr(backend, "cpu_paged", None)):
            if paged is not None:
                paged.scale = scale
    return backend
