"""tokenfab's CPU kernels (csrc/*.c): built with the machine's C compiler at first use, called via ctypes.

    from tokenfab import kernels
    if kernels.enabled():
        kernels.rms_norm(x, weight, eps)

The C sources live in csrc/: one file per section (pool.c, rowwise.c, attention.c, qgemm.c, kquant.c, qdot.c,
qmadd.c, decode_layers.c, amx_qtile.c, amx_bf16.c) and the header they share (common.h), compiled in one gcc
command into one shared library. It is cached under ~/.cache/tokenfab/kernels (or $TOKENFAB_CACHE), keyed by
every source and header file, the compiler flags and the CPU model, so editing any file rebuilds it and a copy
built for another CPU is never loaded.

Instruction sets: on x86-64 the same sources are built once per *ISA variant* (ISA_VARIANTS: AVX2,
AVX-VNNI, AVX-512 F/BW/VL, AVX-512 + VNNI; each its own .so, built when first asked for), and the
best one the CPU's flags allow is loaded. TOKENFAB_CPU_ISA=avx2 (or any lower variant) forces one,
so tests and benchmarks can run every path the machine has; `set_isa` does the same in-process.
What runs is `isa()`, shown by `tokenfab info`. Other architectures build one "native" variant. Without
a compiler, or when the build fails, `enabled()` is False (one warning in the log) and the model runs
its torch path. TOKENFAB_CPU_KERNELS=0 turns them off (the torch path is the reference in tests and
the baseline in benchmarks).

Modules: build.py (sources, ISA variants, compiling and the build cache), layouts.py (the weight layouts
the kernels read and their flags), linear.py (the linear-kernel seam and its registry), tuning.py (the
measured kernel table and the hand-made rules), select.py (each linear's kernels chosen at load). This
module holds which variant is loaded and the ctypes wrappers; the names of build.py and layouts.py are
re-exported here.

Every wrapper takes float32, contiguous CPU tensors (checked by the caller's `usable` test; `rms_norm`
may write and `silu_mul` take and write bfloat16, for the bf16 prefill GEMMs) and writes its output in
place; they are thin, because they run 60-120 times per decode step.
"""
from __future__ import annotations

import ctypes
import logging
import os

import torch

from tokenfab.kernels.build import (FLAGS, ISA_BITS, ISA_VARIANTS, NATIVE, SOURCE_DIR, _I, _P, _F, _cpu_model,  # noqa: F401
                                    available_isas, build_library, cpu_flags, source_digest, sources)
from tokenfab.kernels.layouts import (KQUANT_BLOCK_BYTES, KQUANT_TYPES, QDOT_FLAG, QDOT_KQUANT_TYPES,  # noqa: F401
                                      QTILE_FLAG, QTILE_HALF, QTILE_MAX_ROWS, layout_in_features, qtile_pack)

log = logging.getLogger(__name__)

MAX_HEAD_DIM = 512      # rope's scratch row (csrc/rowwise.c)

_lib = None
_tried = False
_isa: str | None = None             # the variant loaded
_forced_isa: str | None = None      # set_isa()
_qbf16_ready = False                # qbf16 asked for AMX bf16 once (the tile permission is per process)

QGEMM_MAX_ROWS = 16     # rows tf_qgemm takes (8 per pass over W, TF_MAX_ROWS in csrc/common.h); 2-core VM: beats the
                        # float32 GEMM by 25-37 % at 9-16 decode rows, even at 24, behind at 32


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP thread pool (libgomp's `omp_pause_resource_all`, hard pause).

    libgomp keeps one pool per thread that has run a parallel region, and once the process holds more
    OpenMP threads than there are cores it throttles their spin-wait: every parallel region then wakes
    its workers through the kernel. A server loads the model on one thread (a pool) and steps it on
    another (a second pool): on the 2-core VM a `tf_rms_norm` call took 125 µs instead of 7 and a
    16-sequence decode step 1.5x as long. The thread that loaded the model calls this before handing
    it over. Only acts on a libgomp the process has already loaded; returns whether it did."""
    try:
        gomp = ctypes.CDLL("libgomp.so.1", mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_LOCAL)
        pause = gomp.omp_pause_resource_all
    except (OSError, AttributeError):
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause(2) == 0                 # omp_pause_hard


def _wanted_isa() -> str:
    """set_isa's choice, else TOKENFAB_CPU_ISA, else the best variant the CPU has (a request the CPU
    can't run falls back to the best, with a warning: its instructions would crash the process)."""
    avail = available_isas()
    want = _forced_isa or os.environ.get("TOKENFAB_CPU_ISA", "auto")
    if want in ("", "auto"):
        return avail[-1]
    if want not in avail:
        log.warning("TOKENFAB_CPU_ISA=%s: this CPU runs %s; using %s", want, ", ".join(avail), avail[-1])
        return avail[-1]
    return want


def _build() -> ctypes.CDLL | None:
    global _isa
    isa = _wanted_isa()
    lib = build_library(isa)
    if lib is not None:
        _isa = isa
    return lib


def isa() -> str | None:
    """The ISA variant the loaded kernels were built for ("avx512_vnni", "avx2", ...), or None when off."""
    return _isa if enabled() else None


def compiled_features() -> list[str]:
    """What the loaded build's compiler actually enabled (tf_isa, csrc/qdot.c): avx2, avx512, avx512_vnni, avx_vnni."""
    if not enabled():
        return []
    mask = _lib.tf_isa()
    return [name for bit, name in ISA_BITS.items() if mask & bit]


def set_isa(name: str | None) -> None:
    """Load the `name` variant in this process (None: back to TOKENFAB_CPU_ISA / the best); ValueError
    when this CPU cannot run it. Kernel plans prepared before keep pointing at the old library's
    layouts, which stay valid (the layouts are the same for every variant)."""
    global _forced_isa
    if name is not None and name not in available_isas():
        raise ValueError(f"this CPU cannot run the {name!r} kernels; it runs {', '.join(available_isas())}")
    _forced_isa = name
    set_enabled(True)


def describe() -> str:
    """One line for `tokenfab info`: the variant loaded, what it compiled, and what the CPU offers."""
    if not enabled():
        return "off (the torch path runs)"
    return (f"{_isa} (compiled: {', '.join(compiled_features()) or 'scalar'}; "
            f"this CPU runs: {', '.join(available_isas())}; TOKENFAB_CPU_ISA forces a lower one)")


def enabled() -> bool:
    """True when the kernels are built and loaded (built on the first call)."""
    global _lib, _tried
    if not _tried:
        _tried = True
        if os.environ.get("TOKENFAB_CPU_KERNELS", "1") != "0":
            try:
                _lib = _build()
            except OSError as e:
                log.warning("loading tokenfab's CPU kernels failed (%s), the torch path runs instead", e)
                _lib = None
    return _lib is not None


def set_enabled(on: bool) -> None:
    """Force the kernels off (or back to the default) in this process, e.g. for an A/B comparison."""
    global _lib, _tried
    if on:
        _tried = False
        _lib = None
        enabled()
    else:
        _tried, _lib = True, None


def usable(*tensors: torch.Tensor) -> bool:
    """Kernels loaded, and every tensor float32 on the CPU. Runs several times per layer: kept cheap."""
    if _lib is None and (_tried or not enabled()):
        return False
    for t in tensors:
        if t.dtype is not torch.float32 or not t.is_cpu:
            return False
    return True


def f16_pools(head_dim: int) -> str | None:
    """None when the kernels take float16 KV pools (kv_cache_dtype="float16") for this head size, else why
    not: they need an AVX2 build (F16C conversions) and a head_dim that is a multiple of 64."""
    if not enabled():
        return "tokenfab's C kernels are not built"
    if "avx2" not in compiled_features():
        return "the float16 KV kernels need an AVX2 build of tokenfab's C kernels"
    if head_dim % 64:
        return f"the float16 KV kernels take head_dim multiples of 64, not {head_dim}"
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`out_dtype` torch.bfloat16: the float32 result rounded as `.to(torch.bfloat16)` would, in the same
    pass (for a linear whose kernel takes bf16 activations, KernelLinear.takes_bf16)."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=out_dtype)
    D = x.shape[-1]
    fn = _lib.tf_rms_norm_bf16 if out_dtype == torch.bfloat16 else _lib.tf_rms_norm
    fn(out.data_ptr(), x.data_ptr(), weight.data_ptr(), x.numel() // D, D, eps)
    return out


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm in one pass: (rms_norm(x + y), x + y). x float32; y float32 or
    bfloat16 (a bf16 GEMM's result); the norm float32 or bfloat16, rounded as in `rms_norm`."""
    x, y = x.contiguous(), y.contiguous()
    total = torch.empty_like(x)
    out = torch.empty(x.shape, dtype=out_dtype)
    D = x.shape[-1]
    _lib.tf_add_rms_norm(total.data_ptr(), out.data_ptr(), x.data_ptr(), y.data_ptr(), weight.data_ptr(),
                         x.numel() // D, D, eps, int(y.dtype == torch.bfloat16), int(out_dtype == torch.bfloat16))
    return out, total


def rope_write_kv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, positions: torch.Tensor,
                  cos: torch.Tensor, sin_signed: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slots: torch.Tensor) -> None:
    """qkv [T, (H + 2 KVH) D], contiguous: rotate its q and k in place, store k and v in the pools
    (float32, or float16: rounded to nearest, see f16_pools)."""
    fn = _lib.tf_rope_write_kv_f16 if k_cache.dtype == torch.float16 else _lib.tf_rope_write_kv
    fn(qkv.data_ptr(), qkv.shape[0], qkv.stride(0), num_heads, num_kv_heads, head_dim,
                          positions.data_ptr(), cos.data_ptr(), sin_signed.data_ptr(),
                          k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr())


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, num_heads: int, num_kv_heads: int, scale: float,
                     window: int | None = None, reference: bool = False) -> torch.Tensor:
    """q: [B, H * D] rows (any row stride, unit inner stride); pools [blocks, bs, KVH, D]. Returns [B, H, D].
    `window`: attend only to each sequence's last `window` tokens (a sliding-window layer).
    `reference`: the first kernel (tf_decode_attention_window) instead of tf_paged_decode_attention,
    for benchmarks/decode_attention.py's before/after."""
    B, D, bs = q.shape[0], k_cache.shape[-1], k_cache.shape[1]
    out = torch.empty(B, num_heads, D)
    if k_cache.dtype == torch.float16:
        fn = _lib.tf_paged_decode_attention_f16
    else:
        fn = _lib.tf_decode_attention_window if reference else _lib.tf_paged_decode_attention
    fn(out.data_ptr(), q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
       block_tables.stride(0), context_lens.data_ptr(), B, num_heads, num_kv_heads, D, bs, scale, window or 0)
    return out


def argmax_rows(x: torch.Tensor) -> list[int]:
    """Each row's argmax of a float32 [M, N] tensor (rows of any stride, unit inner stride): the first of
    tied maxima, the first NaN where a row has one, as torch's max(dim=-1).indices (tf_argmax_rows)."""
    M, N = x.shape
    out = torch.empty(M, dtype=torch.int64)
    _lib.tf_argmax_rows(out.data_ptr(), x.data_ptr(), M, N, x.stride(0))
    return out.tolist()


def _glu(fn, gate_up: torch.Tensor) -> torch.Tensor:
    gate_up = gate_up.contiguous()
    T, I2 = gate_up.shape
    out = torch.empty(T, I2 // 2, dtype=gate_up.dtype)
    fn(out.data_ptr(), gate_up.data_ptr(), T, I2 // 2)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> silu(first half) * second half, [T, I], float32 or bfloat16 (computed in float32 and
    rounded once: the bits of `.float()`, the float32 kernel, `.to(torch.bfloat16)`)."""
    return _glu(_lib.tf_silu_mul_bf16 if gate_up.dtype == torch.bfloat16 else _lib.tf_silu_mul, gate_up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> gelu_tanh(first half) * second half, [T, I] (GeGLU; a few ulp from torch's gelu)."""
    return _glu(_lib.tf_gelu_tanh_mul, gate_up)


def pool_stats() -> dict[str, int]:
    """The decode GEMMs' thread pool (tf_cols, csrc/pool.c): chunks its workers published, chunks the calling thread
    took over from a worker that had not finished (descheduled, as a rule), worker results thrown away because
    of that, and workers started. Zeros when the kernels are off."""
    out = (ctypes.c_int64 * 4)()
    if enabled():
        _lib.tf_pool_stats(out)
    return dict(zip(("worker_chunks", "taken_over", "discarded", "workers"), out))


def pool_config(enabled_: bool = True, delay_us: int = 0, spin_ns: int = -1) -> None:
    """Tests and benchmarks: turn the pool on (the default) or off (the GEMMs and decode attention then run in
    OpenMP's static schedule), make every worker chunk sleep `delay_us` (a descheduled worker, on demand),
    and set how long a worker spins after a job (`spin_ns`; negative: unchanged)."""
    if enabled():
        _lib.tf_pool_config(int(enabled_), int(delay_us), int(spin_ns))


def pool_threads(n: int) -> None:
    """The pool's team size when it should differ from torch's thread count (more threads than cores, for the
    thread controller under contention; its workers then sleep as soon as a job ends); 0 follows torch."""
    if enabled():
        _lib.tf_pool_threads(int(n))


def _layout_call(fn, x: torch.Tensor, q: torch.Tensor, d: torch.Tensor | None, m: torch.Tensor | None,
                 group_size: int, bits: int, out_features: int) -> torch.Tensor:
    """y [M, out] float32 = fn(x [M, K], a tf_qgemm-style layout): the C calls of qgemm, qmadd and qdot."""
    x = x.contiguous()
    M, K = x.shape
    y = torch.empty(M, out_features)
    fn(y.data_ptr(), x.data_ptr(), M, K, out_features, q.data_ptr(), None if d is None else d.data_ptr(),
       None if m is None else m.data_ptr(), group_size, bits)
    return y


def qgemm(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, group_size: int, bits: int,
          out_features: int) -> torch.Tensor:
    """x [M, K] float32 @ a quantized [out, K] weight (layouts in csrc/qgemm.c), float32 [M, out]; M up to
    QGEMM_MAX_ROWS in the engine (any M works: 8 rows per pass over the weight).
    Activations enter as int16 per block of 32 (relative error ~2^-16)."""
    return _layout_call(_lib.tf_qgemm, x, q, d, m, group_size, bits, out_features)


def qmadd(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, group_size: int, bits: int,
          out_features: int) -> torch.Tensor:
    """As `qgemm` (the same layout, the same int16 activation blocks and exact block dots), for big batches
    and prefill chunks: the weights expanded to int16 pairs once per call, outputs in the lanes, 16 MACs
    per vpmaddwd (tf_qmadd, csrc/qmadd.c; AVX2 builds, out_features a multiple of 16). A row's float sums
    differ from qgemm's in the last bits and never depend on the other rows."""
    return _layout_call(_lib.tf_qmadd, x, q, d, m, group_size, bits, out_features)


def qdot(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, group_size: int, bits: int,
         out_features: int) -> torch.Tensor:
    """As `qgemm`, with activations as int8 per block of 32 (llama.cpp's approach) and integer dot
    products: vpdpbusd where the build has VNNI, AVX2 maddubs otherwise (tf_qdot, csrc/qdot.c)."""
    return _layout_call(_lib.tf_qdot, x, q, d, m, group_size, bits, out_features)


def amx_available() -> bool:
    """True when the loaded kernels can run AMX int8 tiles here: a build with them, a CPU with them
    (amx_tile, amx_int8) and Linux's XTILEDATA permission, requested on the first call (tf_amx_available)."""
    return enabled() and bool(_lib.tf_amx_available())


def qtile_vnni_available() -> bool:
    """True when the loaded kernels run tf_qtile's AVX-512 VNNI path (a build for avx512_vnni): 1-row calls
    where AMX runs too (1.3x the tile unit's speed on int4), every row count where AMX is missing."""
    return enabled() and "avx512_vnni" in compiled_features()


def qtile(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, group_size: int, bits: int,
          out_features: int, path: str = "auto") -> torch.Tensor:
    """x [M, K] float32 @ a qtile layout (`qtile_pack`), float32 [M, out]. `path` "auto": AVX-512 VNNI for
    1 row where the build has it (`qtile_vnni_available`), AMX int8 tiles for more where
    `amx_available()`, VNNI again where AMX is missing, else the plain C loop; "reference": that loop;
    "vnni": the VNNI path at any row count (a no-op without it). All give the same bits, and a row's
    result is the same whatever M is."""
    x = x.contiguous()
    M, K = x.shape
    y = torch.empty(M, out_features)
    fn = {"auto": _lib.tf_qtile, "reference": _lib.tf_qtile_ref, "vnni": _lib.tf_qtile_vnni}[path]
    fn(y.data_ptr(), x.data_ptr(), M, K, out_features, q.data_ptr(), d.data_ptr(),
       None if m is None else m.data_ptr(), group_size, bits & ~QTILE_FLAG)
    return y


def amx_bf16_available() -> bool:
    """True when the loaded kernels can run AMX bf16 tiles here (amx_bf16 besides what `amx_available` needs)."""
    return enabled() and bool(_lib.tf_amx_bf16_available())


def qbf16(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, group_size: int, bits: int,
          out_features: int) -> torch.Tensor:
    """x [M, K] @ a qtile layout (`qtile_pack`) on AMX bf16 tiles (tf_qbf16), float32 [M, out]: the weights
    expanded to bf16 per tile of 16 outputs inside the kernel (as the bf16 float copy holds them), x
    rounded to bf16 (as the bf16 kernel rounds it), float32 sums. Needs `amx_bf16_available()`: the first
    call asks, which also has Linux grant the tile state (for the whole process) before any tile instruction."""
    global _qbf16_ready
    if not _qbf16_ready:
        if not _lib.tf_amx_bf16_available():
            raise RuntimeError("qbf16 needs AMX bf16 tiles, which this CPU or process does not have")
        _qbf16_ready = True
    x = x.float().contiguous()
    M, K = x.shape
    y = torch.empty(M, out_features)
    _lib.tf_qbf16(y.data_ptr(), x.data_ptr(), M, K, out_features, q.data_ptr(), d.data_ptr(),
                  None if m is None else m.data_ptr(), group_size, bits & ~QTILE_FLAG)
    return y


# GGUF K-quant types tf_qgemm reads as stored (its `bits` argument is then ggml's type id): super-blocks
# of 256 weights, bytes per super-block (csrc/kquant.c, tf_kquant_block_bytes).


def kdequant(raw: torch.Tensor, type_id: int, out_features: int, in_features: int,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A K-quant weight (uint8 [out, in / 256 * block bytes]) expanded to float32 [out, in], or to bfloat16
    (rounded as .to(torch.bfloat16) rounds, without the float32 tensor in between)."""
    out = torch.empty(out_features, in_features, dtype=torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    fn = _lib.tf_kdequant_bf16 if dtype == torch.bfloat16 else _lib.tf_kdequant
    fn(out.data_ptr(), raw.data_ptr(), out_features, in_features, type_id)
    return out


class QLinear(ctypes.Structure):
    """tf_qlin in csrc/decode_layers.c: one quantized linear's tf_qgemm layout; with `big_from` > 0, steps of at
    least that many rows run the big-batch kernel on it instead: tf_qbf16 on a qtile layout, tf_qmadd on a qgemm
    one."""
    _fields_ = [("q", _P), ("d", _P), ("m", _P), ("gs", _I), ("bits", _I), ("big_from", _I)]

    @classmethod
    def of(cls, layout: tuple, big_from: int = 0) -> "QLinear":
        q, d, m, gs, bits = layout
        return cls(q.data_ptr(), None if d is None else d.data_ptr(), None if m is None else m.data_ptr(), gs, bits,
                   big_from)


class Layer(ctypes.Structure):
    """tf_layer in csrc/decode_layers.c: a decoder layer's norm weights, linears and KV pools; the q/k and output
    norms are NULL where the layer has none, `window` 0 for a global layer, `kv_half` 1 for float16
    pools (see f16_pools); `qkv_split` > 0 where qkv is two layouts, its rows from there on in `qkv_rest`;
    `nope` 1 for a layer without RoPE (it reads the third StepView)."""
    _fields_ = [("ln1", _P), ("ln2", _P), ("qkv", QLinear), ("o", QLinear), ("gate_up", QLinear),
                ("down", QLinear), ("k_cache", _P), ("v_cache", _P), ("q_norm", _P), ("k_norm", _P),
                ("attn_out_norm", _P), ("mlp_out_norm", _P), ("window", _I), ("kv_half", _I),
                ("qkv_rest", QLinear), ("qkv_split", _I), ("nope", _I)]


class StepView(ctypes.Structure):
    """tf_step_view in csrc/decode_layers.c: what a step's layers read besides their weights (one view
    for the global layers, one for the sliding ones, one for the NoPE ones)."""
    _fields_ = [("positions", _P), ("slots", _P), ("block_tables", _P), ("ctx_lens", _P), ("bt_stride", _I),
                ("cos", _P), ("sin", _P)]

    @classmethod
    def of(cls, meta, rope) -> "StepView":
        bt = meta.decode_block_tables
        return cls(meta.positions.data_ptr(), meta.slot_mapping.data_ptr(), bt.data_ptr(),
                   meta.decode_context_lens.data_ptr(), bt.stride(0), rope.cos.data_ptr(), rope.sin_signed.data_ptr())


ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}     # tf_decode_layers' `act` (TF_ACT_* in csrc/decode_layers.c)


def decode_layers(x: torch.Tensor, layers, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                  intermediate: int, eps: float, act: str, views, block_size: int, scale: float) -> None:
    """The whole decoder stack for a decode step of at most QGEMM_MAX_ROWS tokens, x [M, hidden] updated
    in place (tf_decode_layers); `layers` is a ctypes array of Layer, `views` one of three StepViews
    (global layers, sliding layers, NoPE layers), whose tensors the caller keeps alive for the call."""
    _lib.tf_decode_layers(x.data_ptr(), x.shape[0], hidden, len(layers), layers, num_heads, num_kv_heads, head_dim,
                          intermediate, eps, ACTIVATIONS[act], views, block_size, scale)
