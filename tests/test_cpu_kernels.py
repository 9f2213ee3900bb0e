"""tokenfab's C kernels against their torch references, and the fallback when they cannot be built."""
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from tokenfab import kernels
from tokenfab.model.layers import RotaryEmbedding
from tokenfab.quant.linear import Int4Linear, Int8Linear, Q4_1Linear, Q8_0Linear

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="no C compiler: the torch path runs instead")
ALL_ISAS = list(kernels.ISA_VARIANTS)     # every build this CPU runs; the others skip, naming what it runs


def test_rms_norm_matches_torch():
    torch.manual_seed(0)
    x, w = torch.randn(2, 7, 576) * 3, torch.rand(576)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-5), F.rms_norm(x, (576,), w, 1e-5), rtol=1e-6, atol=1e-6)


def test_silu_mul_matches_torch():
    torch.manual_seed(1)
    g = torch.randn(9, 2 * 1536) * 4
    g[0, :6] = torch.tensor([-200.0, -90.0, -30.0, 30.0, 90.0, 200.0])      # exp's clamps
    torch.testing.assert_close(kernels.silu_mul(g), F.silu(g[:, :1536]) * g[:, 1536:], rtol=1e-6, atol=1e-6)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """bfloat16 bit patterns, every NaN as one (torch's vector and scalar conversions differ in NaN payload)."""
    return torch.where(t.isnan(), torch.tensor(0x7fc0, dtype=torch.int16), t.view(torch.int16))


@pytest.mark.parametrize("isa", ["avx2", "avx512"], indirect=True)
def test_argmax_rows_gives_torchs_indices_ties_nans_infinities_and_strided_rows(isa):
    from tokenfab.engine.sampler import greedy_ids
    g = torch.Generator().manual_seed(3)
    for rows, n in ((1, 49152), (64, 49152), (7, 13), (3, 8), (5, 1), (2, 100003)):
        x = torch.randn(rows, n, generator=g)
        assert kernels.argmax_rows(x) == x.max(dim=-1).indices.tolist(), (rows, n)
    x = torch.randn(7, 1000, generator=g)
    x[0, 5] = x[0, 900] = 50.0                          # tied maxima: the first
    x[1] = float("-inf")                                # nothing above -inf: index 0
    x[2, 17] = x[2, 600] = float("nan")                 # NaN counts as the maximum: the first NaN
    x[3, 999] = 100.0                                   # in the scalar tail
    x[4] = 3.0                                          # all equal
    x[5, 2] = x[5, 800] = float("inf")
    x[6, 996] = float("nan")                            # a NaN in the tail only
    assert kernels.argmax_rows(x) == x.max(dim=-1).indices.tolist() == torch.argmax(x, dim=-1).tolist()
    wide = torch.randn(4, 49200, generator=g)
    sliced = wide[:, :49152]                             # the sampler's logits[:, :vocab_size]: strided rows
    assert greedy_ids(sliced) == kernels.argmax_rows(sliced) == sliced.max(dim=-1).indices.tolist()


@pytest.mark.parametrize("rows, dim", [(512, 576), (3, 577), (1, 64)])
def test_rms_norm_bf16_out_is_the_float32_result_rounded_as_torch_rounds(rows, dim):
    torch.manual_seed(rows)
    x, w = torch.randn(rows, dim) * 3, torch.randn(dim)
    x[0, :3] = torch.tensor([3e38, -1e-30, 0.0])          # near overflow, a denormal-sized product, zero
    out = kernels.rms_norm(x, w, 1e-5, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert torch.equal(_bits(out), _bits(kernels.rms_norm(x, w, 1e-5).to(torch.bfloat16)))


@pytest.mark.parametrize("y_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, dim", [(512, 576), (3, 577)])
def test_add_rms_norm_gives_the_bits_of_the_residual_add_then_the_norm(rows, dim, y_dtype, out_dtype):
    torch.manual_seed(dim)
    x, y, w = torch.randn(rows, dim) * 3, (torch.randn(rows, dim) * 2).to(y_dtype), torch.randn(dim)
    out, total = kernels.add_rms_norm(x, y, w, 1e-5, out_dtype)
    assert total.dtype == torch.float32 and out.dtype == out_dtype
    assert torch.equal(total, x + y)                       # torch promotes a bf16 y to float32 exactly
    ref = kernels.rms_norm(x + y, w, 1e-5).to(out_dtype)
    assert torch.equal(_bits(out) if out_dtype == torch.bfloat16 else out,
                       _bits(ref) if out_dtype == torch.bfloat16 else ref)


@pytest.mark.parametrize("rows, inter", [(512, 1536), (3, 13), (9, 1536)])
def test_silu_mul_bf16_gives_the_bits_of_widen_float32_kernel_round(rows, inter):
    torch.manual_seed(inter)
    g = torch.randn(rows, 2 * inter) * 4
    g[0, :8] = torch.tensor([-200.0, -90.0, -30.0, 30.0, 90.0, 200.0, float("inf"), float("nan")])
    g = g.to(torch.bfloat16)
    out = kernels.silu_mul(g)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, inter)
    assert torch.equal(_bits(out), _bits(kernels.silu_mul(g.float()).to(torch.bfloat16)))
    torch.testing.assert_close(out[1:].float(), (F.silu(g[1:, :inter].float()) * g[1:, inter:].float()),
                               rtol=1e-2, atol=1e-2)    # and it is SwiGLU, to bf16 precision


def test_gelu_tanh_mul_matches_torch_geglu():
    torch.manual_seed(1)
    g = torch.randn(9, 2 * 1027) * 4                 # 1027: the vector loop and its scalar tail
    g[0, :8] = torch.tensor([-200.0, -30.0, -6.0, -1e-3, 1e-3, 6.0, 30.0, 200.0])   # exp's clamps, near 0
    ref = F.gelu(g[:, :1027], approximate="tanh") * g[:, 1027:]
    # atol: below g ~ -5 torch's 1 + tanh(u) is a few float32 steps of 6e-8 (or 0), where g / (1 + e^-2u)
    # keeps its ~1e-7; times |up| (up to ~16) that is a few 1e-6 on outputs of magnitude ~10
    torch.testing.assert_close(kernels.gelu_tanh_mul(g), ref, rtol=2e-6, atol=1e-5)


def test_rope_write_kv_rotates_in_place_and_stores_k_and_v_at_their_slots():
    torch.manual_seed(2)
    H, KVH, D, T = 9, 3, 64, 5
    rope = RotaryEmbedding(D, 10000.0, 256)
    qkv = torch.randn(T, (H + 2 * KVH) * D)
    pos = torch.tensor([0, 1, 7, 100, 255])
    slots = torch.tensor([3, 0, 9, 4, 15])
    kc, vc = torch.zeros(16, KVH, D), torch.zeros(16, KVH, D)
    ref = qkv.clone()
    kernels.rope_write_kv(qkv, H, KVH, D, pos, rope.cos, rope.sin_signed, kc, vc, slots)
    tables = rope.tables(pos, torch.float32)
    want_qk = rope.apply(ref[:, :(H + KVH) * D].view(T, H + KVH, D), tables).reshape(T, -1)
    torch.testing.assert_close(qkv[:, :(H + KVH) * D], want_qk, rtol=0, atol=1e-6)
    assert torch.equal(qkv[:, (H + KVH) * D:], ref[:, (H + KVH) * D:])                   # v untouched
    assert torch.equal(kc[slots], qkv[:, H * D:(H + KVH) * D].view(T, KVH, D))
    assert torch.equal(vc[slots], ref[:, (H + KVH) * D:].view(T, KVH, D))
    untouched = [i for i in range(16) if i not in slots.tolist()]
    assert not kc[untouched].any() and not vc[untouched].any()


@pytest.mark.parametrize("H,KVH", [(9, 3), (4, 4), (8, 1)])
def test_decode_attention_reads_the_paged_pools_like_gather_then_sdpa(H, KVH):
    torch.manual_seed(3)
    D, bs, nblocks = 64, 16, 40
    kc, vc = torch.randn(nblocks, bs, KVH, D), torch.randn(nblocks, bs, KVH, D)
    lens = torch.tensor([1, 16, 17, 50, 64])
    tables = torch.stack([torch.randperm(nblocks)[:4] for _ in lens])
    rows = torch.randn(len(lens), (H + 2 * KVH) * D)          # q inside fused qkv rows: strided
    q = rows[:, :H * D]
    out = kernels.decode_attention(q, kc, vc, tables, lens, H, KVH, D ** -0.5)
    for b, L in enumerate(lens.tolist()):
        keys = kc[tables[b]].reshape(-1, KVH, D)[:L].transpose(0, 1)
        vals = vc[tables[b]].reshape(-1, KVH, D)[:L].transpose(0, 1)
        ref = F.scaled_dot_product_attention(q[b].view(H, 1, D), keys, vals, enable_gqa=H != KVH).squeeze(1)
        torch.testing.assert_close(out[b], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("B,H,KVH,D,window", [(16, 9, 3, 64, 0), (24, 8, 1, 128, 0), (16, 9, 3, 64, 20),
                                               (3, 12, 2, 64, 33), (5, 4, 4, 32, 0)])
@pytest.mark.parametrize("isa", ["avx2", "avx512"], indirect=True)   # P V per head, or 4 heads at once
def test_paged_decode_attention_equals_the_first_kernel_for_many_sequences_windows_and_head_groups(
        B, H, KVH, D, window, isa):
    _check_paged_decode_attention(B, H, KVH, D, window)


def _check_paged_decode_attention(B, H, KVH, D, window):
    # B >= 4 x threads runs whole sequences per task; G = H / KVH up to 8 (two passes of 4 heads in P V);
    # D 32 is not a multiple of 64 (the first kernel's scalar loops); windows cut inside a block
    torch.manual_seed(4)
    bs, per_seq = 16, 6
    nblocks = B * per_seq + 3
    kc, vc = torch.randn(nblocks, bs, KVH, D), torch.randn(nblocks, bs, KVH, D)
    lens = torch.randint(1, per_seq * bs + 1, (B,))
    lens[0] = per_seq * bs
    tables = torch.randperm(nblocks)[:B * per_seq].view(B, per_seq)
    q = torch.randn(B, (H + 2 * KVH) * D)[:, :H * D]
    args = (q, kc, vc, tables, lens, H, KVH, D ** -0.5, window or None)
    torch.testing.assert_close(kernels.decode_attention(*args), kernels.decode_attention(*args, reference=True),
                               rtol=1e-5, atol=1e-5)


def test_a_failed_build_turns_the_kernels_off_and_the_model_still_runs(monkeypatch, tmp_path):
    from tokenfab.model.layers import RMSNorm
    monkeypatch.setenv("TOKENFAB_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")                         # a "compiler" that always fails
    try:
        kernels.set_enabled(True)
        assert not kernels.enabled()
        norm = RMSNorm(8, 1e-5)
        x = torch.randn(3, 8)
        torch.testing.assert_close(norm(x), F.rms_norm(x, (8,), norm.weight, 1e-5))
    finally:
        monkeypatch.undo()
        kernels.set_enabled(True)
    assert kernels.enabled()


def test_env_switch_turns_the_kernels_off(monkeypatch):
    monkeypatch.setenv("TOKENFAB_CPU_KERNELS", "0")
    try:
        kernels.set_enabled(True)
        assert not kernels.enabled() and not kernels.usable(torch.zeros(1))
    finally:
        monkeypatch.undo()
        kernels.set_enabled(True)


_LATE_WORKER = """
import gc, sys, time, torch
from tokenfab import kernels
from tokenfab.quant.linear import Int4Linear
torch.set_num_threads(2)
x, took = torch.randn(1, 2048), 0
for attempt in range(6):
    layer = Int4Linear.from_float(torch.randn(8192, 2048) * 0.05, None, 32)   # 8 MB of codes: mapped
    layer.kernel = "qgemm"
    for _ in range(50):
        layer(x)                                  # the workers are up and spinning
    kernels.pool_config(True, 100000)             # a worker sleeps 0.1 s after its claim, before its inputs
    before = kernels.pool_stats()["taken_over"]
    layer(x)
    took += kernels.pool_stats()["taken_over"] - before
    kernels.pool_config(True, 0)
    del layer
    gc.collect()                                  # the weights are unmapped now
    time.sleep(0.2)                               # a late worker would read them here
print("taken over", took)
"""


def test_a_call_whose_chunk_was_taken_over_returns_only_after_the_late_worker_left_its_inputs():
    """A worker descheduled between claiming a chunk and reading the call's inputs: the caller takes the
    chunk over, and must not return (letting its caller free the weights) until the worker has left it.
    Returning at once was a segmentation fault when the freed weights were unmapped (glibc unmaps blocks
    above its mmap threshold, fixed low here so that it always does)."""
    if "avx2" not in kernels.compiled_features() or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("the pool's workers need an AVX2 build and two cores to claim chunks beside the caller")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    r = subprocess.run([sys.executable, "-c", _LATE_WORKER], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-2000:]}"
    assert int(r.stdout.split()[-1]) >= 1, "no chunk was taken over, so nothing was tested"


@pytest.mark.parametrize("make", [
    lambda w: Int4Linear.from_float(w, None, 32),
    lambda w: Int4Linear.from_float(w, None, 64),
    lambda w: Int4Linear.from_float(w, None, 128),                          # 576 inputs: padded to 640
    lambda w: Int4Linear.from_float(w, None, 128, input_scale=torch.rand(576) + 0.5),
    lambda w: Int8Linear.from_float(w),
    lambda w: Q8_0Linear(torch.randint(-127, 128, w.shape, dtype=torch.int8), torch.rand(w.shape[0], w.shape[1] // 32)),
], ids=["int4-g32", "int4-g64", "int4-g128-padded", "int4-awq", "int8", "q8_0"])
@pytest.mark.parametrize("rows", [1, 3, kernels.QGEMM_MAX_ROWS])
@pytest.mark.parametrize("isa", ALL_ISAS, indirect=True)
def test_quantized_gemm_equals_dequantize_then_linear_to_int16_activation_rounding(make, rows, isa):
    torch.manual_seed(4)
    layer = make(torch.randn(96, 576) * 0.05)
    layer.kernel = "cpu"                                                       # tf_qgemm, alias kept
    assert layer.plan.names() == [(None, "qgemm")]
    x = torch.randn(rows, 576)
    scale = layer.input_scale_tensor
    ref = F.linear(x if scale is None else x * scale, layer.dequantize())
    # activations go in as int16 per block of 32: relative error ~2^-16 per element, which asymmetric
    # int4 (w = q d + m: two large terms that cancel) can amplify a few times in the output
    torch.testing.assert_close(layer(x), ref, rtol=1e-4, atol=5e-4 * float(ref.abs().max()))


@pytest.mark.parametrize("make", [
    lambda w: Int4Linear.from_float(w, None, 32),
    lambda w: Int8Linear.from_float(w),                                     # one group per row: block scales repeated
    lambda w: Q8_0Linear(torch.randint(-127, 128, w.shape, dtype=torch.int8), torch.rand(w.shape[0], w.shape[1] // 32)),
], ids=["int4-g32", "int8", "q8_0"])
@pytest.mark.parametrize("isa", ALL_ISAS, indirect=True)
def test_quantized_gemm_rows_are_independent_of_how_many_run_together(make, isa):
    """Speculative verification runs k + 1 rows of one sequence in one call, plain decoding one: each
    row must come out bit for bit the same either way (greedy equality), for every row count the
    kernel specializes (1-8, and 9+ in passes of 8). 608 inputs = 19 blocks of 32: a partial chunk of
    16 blocks and an odd last block in the AVX-512 row kernel. 83 outputs: the AVX2 int4 loop takes one
    row's outputs four at a time, so some are left over."""
    torch.manual_seed(5)
    layer = make(torch.randn(83, 608) * 0.05)
    layer.kernel = "qgemm"
    x = torch.randn(11, 608)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(11)])
    ref = F.linear(x, layer.dequantize())
    torch.testing.assert_close(alone, ref, rtol=1e-4, atol=5e-4 * float(ref.abs().max()))
    for rows in range(2, 12):
        assert torch.equal(layer(x[:rows]), alone[:rows]), f"{rows} rows together differ from one at a time"


@pytest.mark.parametrize("delay_us", [0, 300])
def test_the_gemm_pool_gives_the_same_bits_when_its_workers_are_descheduled(delay_us):
    """tf_qgemm's threads (tf_cols, csrc/pool.c): each thread claims chunks, its own run first, then what the
    others have not claimed; the calling thread takes over any chunk a worker has not finished in twice its
    own chunk time. With every worker chunk made to sleep 300 us (a worker the OS
    descheduled), the caller takes chunks over and the late workers' results must be thrown away, also
    once later calls (another layer, other buffers) are running: every output equals the OpenMP path's
    bit for bit."""
    torch.manual_seed(6)
    layers = [Int4Linear.from_float(torch.randn(n, 576) * 0.05, None, 32) for n in (2048, 1152)]
    layers.append(Q8_0Linear(torch.randint(-127, 128, (1536, 576), dtype=torch.int8), torch.rand(1536, 18)))
    for layer in layers:
        layer.kernel = "qgemm"
    xs = [torch.randn(rows, 576) for rows in (1, 4, 1, 8)]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)                     # the pool runs with 2+ threads, whatever the cores
    try:
        kernels.pool_config(False)
        want = [[layer(x) for x in xs] for layer in layers]
        kernels.pool_config(True, delay_us)
        before = kernels.pool_stats()
        for _ in range(20):
            for layer, w in zip(layers, want):
                for x, ref in zip(xs, w):
                    assert torch.equal(layer(x), ref)
        after = kernels.pool_stats()
    finally:
        kernels.pool_config(True, 0)             # the default (on)
        torch.set_num_threads(threads)
    assert after["workers"] >= 1
    if delay_us:
        time.sleep(0.01)                         # the last late workers wake, and must not write anywhere
        assert all(torch.equal(layer(x), ref) for layer, w in zip(layers, want) for x, ref in zip(xs, w))
        assert after["taken_over"] > before["taken_over"] and kernels.pool_stats()["discarded"] > before["discarded"]
    elif len(os.sched_getaffinity(0)) >= 2:      # on one core the caller may well take every chunk itself
        assert after["worker_chunks"] > before["worker_chunks"]


@pytest.mark.parametrize("make", [
    lambda w: Int4Linear.from_float(w, None, 32),
    lambda w: Int4Linear.from_float(w, None, 64),
    lambda w: Int4Linear.from_float(w, None, 128),                          # 608 inputs: padded to 640
    lambda w: Int8Linear.from_float(w),
    lambda w: Q8_0Linear(torch.randint(-127, 128, w.shape, dtype=torch.int8), torch.rand(w.shape[0], w.shape[1] // 32)),
], ids=["int4-g32", "int4-g64", "int4-g128-padded", "int8", "q8_0"])
@pytest.mark.parametrize("isa", ALL_ISAS, indirect=True)
def test_qmadd_computes_qgemms_block_dots_with_rows_independent_of_each_other(make, isa):
    """tf_qmadd reads qgemm's layout with qgemm's int16 activation blocks, outputs in the lanes: the same
    exact integer dots, float sums in another order (last bits). 400 outputs = 25 units of 16: the two
    threads' runs are uneven and each expands its weights in more than one L2-sized chunk; 4-row register
    tiles with a 1-3-row tail; every row the same bits alone and with any others."""
    if "avx2" not in kernels.compiled_features():
        pytest.skip("tf_qmadd needs an AVX2 build of the C kernels")
    torch.manual_seed(6)
    layer = make(torch.randn(400, 608) * 0.05)
    layout = layer.cpu_layout()
    x = torch.randn(67, 608)
    x = F.pad(x, (0, kernels.layout_in_features(layout) - 608))
    y = kernels.qmadd(x, *layout, 400)
    torch.testing.assert_close(y, kernels.qgemm(x, *layout, 400), rtol=1e-5, atol=1e-6 * float(y.abs().max()))
    for rows in (1, 2, 3, 5, 17, 66):
        assert torch.equal(kernels.qmadd(x[:rows], *layout, 400), y[:rows]), rows
    assert torch.equal(kernels.qmadd(x[40:41], *layout, 400), y[40:41])


def test_qmadd_is_not_offered_where_amx_bf16_runs_big_batches(monkeypatch):
    """On AMX bf16 CPUs qbf16 runs the big batches on the qtile layout the decode rows read (one layout, the
    stack up to 64 rows); qmadd would add qgemm's layout beside it, so it is not a candidate there."""
    from tokenfab.kernels import linear as seam
    if "avx2" not in kernels.compiled_features():
        pytest.skip("qmadd needs an AVX2 build of the C kernels")
    layer = Int4Linear.from_float(torch.randn(32, 64) * 0.05, None, 32)
    monkeypatch.setattr(kernels, "amx_bf16_available", lambda: True)
    assert "qbf16" in seam.get("qmadd").supports(layer)


def test_quantized_gemm_runs_gguf_q4_1_blocks_as_shipped(bundled_path):
    gguf = pytest.importorskip("gguf")
    t = next(t for t in gguf.GGUFReader(bundled_path).tensors if t.tensor_type.name == "Q4_1")
    out_features, in_features = int(t.shape[1]), int(t.shape[0])
    layer = Q4_1Linear.from_gguf(t.data, out_features, in_features)
    ref_w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)).reshape(out_features, in_features)
    x = torch.randn(2, in_features)
    ref = F.linear(x, ref_w)
    layer.kernel = "qgemm"
    torch.testing.assert_close(layer(x), ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


def test_decode_kernel_keeps_the_bundled_model_at_float_precision(bundled_files, monkeypatch):
    """The whole bundled model (native Q4_1 layers, Q8_0 LM head) fed 8 rows at a time, as decode
    steps are, through tf_qgemm: KL against the float model stays at rounding level (torch's packed
    kernels with bf16 activations give ~1e-3)."""
    from tokenfab.model.llama import full_logits
    from tokenfab.quant.eval import compare_logits, next_token_targets
    from tokenfab.quant.export import build_float_model
    from tokenfab.quant.linear import QuantLinear, set_kernel
    from tokenfab.quant.text import split_eval_calib, text_token_ids, token_windows

    window = token_windows(split_eval_calib(text_token_ids(bundled_files.tokenizer))[0], 128, 1)[0]
    rows, targets = next_token_targets(torch.tensor(window))
    base = full_logits(build_float_model(bundled_files, 129, "none"), window)[rows]
    native = build_float_model(bundled_files, 129, "gguf")
    assert set_kernel(native, "cpu") >= 120          # 30 blocks x 4 linears, and the LM head
    forward = QuantLinear.forward

    def in_decode_sized_pieces(self, x):
        x2 = x.reshape(-1, x.shape[-1])
        step = kernels.QGEMM_MAX_ROWS
        return torch.cat([forward(self, x2[i:i + step]) for i in range(0, x2.shape[0], step)])

    monkeypatch.setattr(QuantLinear, "forward", in_decode_sized_pieces)
    r = compare_logits(base, full_logits(native, window)[rows], targets)
    assert r.kl_mean < 1e-5 and r.same_top1_pct == 100.0, r


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "float16"])
@pytest.mark.parametrize("isa", ALL_ISAS, indirect=True)
def test_fused_decode_stack_gives_the_per_layer_path_logits_exactly(bundled_files, kv_cache_dtype, isa):
    # The default (quantized) bundled model: small decode steps go through one tf_decode_layers call,
    # over float32 pools or float16 ones (the stack's kv_half layers)
    from tokenfab import LLM, SamplingParams
    if kv_cache_dtype == "float16" and kernels.f16_pools(64) is not None:
        pytest.skip(f"float16 pools: {kernels.f16_pools(64)}")
    # the built-in rules (qgemm up to 16 rows), so the stack's conditions don't hang on a measurement
    llm = LLM(loaded=bundled_files, max_model_len=512, num_kv_blocks=256, kernel_autotune=False,
              kv_cache_dtype=kv_cache_dtype)
    model = llm.engine.model
    assert llm.engine.runner.kv.dtype == getattr(torch, kv_cache_dtype)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    prompts = ["Tell me a story about a dragon.", "What is 2+2?", [5, 6, 7]]
    runs = {}
    backend = model.attention_backend
    assert backend.name == "cpu"
    for fused in (True, False):
        backend.fused_decode = fused
        runs[fused] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]
        if fused:
            assert backend.stack_rows >= 1, "the fused path was not taken"
    assert runs[True] == runs[False]
    assert llm.engine.block_manager.num_used_blocks() == 0


def test_fused_decode_stack_takes_qwen3_qk_norms_with_the_per_layer_path_logits(tmp_path, bundled_tokenizer):
    # q/k norms are a per-layer field of the stack's table (shared with Gemma 3, tests/test_gemma3.py)
    from tests.oracle import make_tiny_model
    from tokenfab import LLM, SamplingParams
    make_tiny_model("qwen3", str(tmp_path), bundled_tokenizer)
    llm = LLM(model=str(tmp_path), quantization="int8", attention_backend="cpu", kernel_autotune=False,
              max_model_len=256, num_kv_blocks=64)
    backend = llm.engine.model.attention_backend
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2)
    runs = {}
    for fused in (True, False):
        backend.fused_decode = fused
        runs[fused] = [(o.outputs[0].token_ids, o.outputs[0].logprobs)
                       for o in llm.generate([list(range(100, 130)), [5, 6, 7]], params)]
        if fused:
            assert backend.stack_rows >= 2, "the fused path was not taken"
    assert runs[True] == runs[False]
    assert llm.engine.block_manager.num_used_blocks() == 0


def test_stack_reach_follows_a_layout_into_its_big_batch_kernel_and_stops_at_other_layouts():
    from tokenfab.kernels.linear import Choice, LinearPlan, get
    from tokenfab.model.backends import _stack_reach
    from tokenfab.quant import kernels as _quant_kernels  # noqa: F401  (registers qtile, qbf16, qgemm)
    S, T = object(), object()           # two prepared layouts

    def plan(*cs):
        return LinearPlan([Choice(rows, get(name), state) for rows, name, state in cs])
    assert _stack_reach(plan((16, "qtile", S), (None, "qbf16", S)), 64) == (((1, 64),), 17)
    assert _stack_reach(plan((16, "qtile", S), (32, "qbf16", S), (None, "qtile", S)), 64) == (((1, 32),), 17)
    assert _stack_reach(plan((16, "qtile", S), (None, "qbf16", T)), 64) == (((1, 16),), 0)     # another layout
    assert _stack_reach(plan((8, "qgemm", S), (None, "bf16", T)), 64) == (((1, 8),), 0)
    assert _stack_reach(plan((None, "qgemm", S)), 16) == (((1, 16),), 0)
    assert _stack_reach(plan((4, "qtile", S), (None, "qbf16", S)), 4) == (((1, 4),), 0)        # capped before qbf16
    assert _stack_reach(plan((16, "qgemm", S), (None, "qmadd", S)), 64) == (((1, 64),), 17)    # qgemm's layout: qmadd
    assert _stack_reach(plan((16, "qgemm", S), (32, "qmadd", S), (None, "float", T)), 64) == (((1, 32),), 17)
    assert _stack_reach(plan((16, "qgemm", S), (None, "qmadd", T)), 64) == (((1, 16),), 0)     # another layout
    # a float copy the table picked in between: the stack runs the rows on either side of it
    assert _stack_reach(plan((16, "qtile", S), (32, "bf16", T), (None, "qbf16", S)), 64) == (((1, 16), (33, 64)), 33)
    assert _stack_reach(plan((8, "qtile", S), (16, "qbf16", S), (32, "bf16", T), (None, "qbf16", S)), 64) \
        == (((1, 16), (33, 64)), 9)


def test_the_stack_runs_the_row_counts_every_linear_allows(bundled_files, monkeypatch):
    """The plans take a float copy at 17-32 rows: the stack's rows leave those out (1-16 and 33-64, as
    describe() says), 20-row steps take the layer path, 36-row steps the stack, with its logits."""
    from tokenfab import LLM, SamplingParams
    from tokenfab.kernels import linear as seam
    llm = LLM(loaded=bundled_files, max_model_len=256, num_kv_blocks=512, kernel_autotune=False, max_num_seqs=40)
    model = llm.engine.model
    first, big = ("qtile", "qbf16") if kernels.amx_bf16_available() else ("qgemm", "qmadd")
    for layer in model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            for name in (first, big):
                if seam.get(name).supports(lin) is not None:
                    pytest.skip(f"{name}: {seam.get(name).supports(lin)}")
            lin.plan = seam.build_plan(lin, [(16, first), (32, "dequant"), (None, big)])
    backend = model.attention_backend
    backend._stack = None
    stacked = []
    real = kernels.decode_layers
    monkeypatch.setattr(kernels, "decode_layers", lambda x, *a: (stacked.append(x.shape[0]), real(x, *a))[1])
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2)
    for n in (20, 36):
        prompts = [[100 + i, 200 + i, 300 + i] for i in range(n)]
        runs = {}
        for fused in (True, False):
            backend.fused_decode = fused
            stacked.clear()
            runs[fused] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]
            if fused:
                assert (n in stacked) == (n == 36), stacked
        assert runs[True] == runs[False]
    assert backend._stack[1] == frozenset(range(1, 17)) | frozenset(range(33, 65))
    backend.fused_decode = True
    assert "one-call decode stack at 1-16, 33-64 rows" in backend.describe()
    assert llm.engine.block_manager.num_used_blocks() == 0


@pytest.mark.parametrize("ranges", [[(None, "qtile")], [(16, "qtile"), (None, "qbf16")],
                                    [(16, "qgemm"), (None, "qmadd")]],
                         ids=["qtile", "qtile-then-qbf16", "qgemm-then-qmadd"])
def test_fused_decode_stack_runs_bigger_steps_as_the_layer_path_does(bundled_files, ranges):
    """Decode steps above fused_decode_max_tokens take the one-call stack where every linear's plan keeps
    reading the layout it starts with (up to fused_decode_big_max_tokens): qtile at every row count, qtile
    up to 16 rows and qbf16 above, or qgemm and then qmadd (tf_stack_linear), with the per-layer path's
    logits."""
    from tokenfab import LLM, SamplingParams
    from tokenfab.kernels import linear as seam
    llm = LLM(loaded=bundled_files, max_model_len=256, num_kv_blocks=256, kernel_autotune=False, max_num_seqs=24)
    model = llm.engine.model
    for layer in model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            for _, name in ranges:
                why = seam.get(name).supports(lin)
                if why is not None:
                    pytest.skip(f"{name}: {why}")
            lin.plan = seam.build_plan(lin, ranges)
    backend = model.attention_backend
    backend._stack = None
    prompts = [[100 + i, 200 + i, 300 + i] for i in range(20)]       # decode steps of 20 rows
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    runs = {}
    for fused in (True, False):
        backend.fused_decode = fused
        runs[fused] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]
        if fused:
            assert backend.stack_rows == 64, backend.stack_rows   # EngineConfig.fused_decode_big_max_tokens
    assert runs[True] == runs[False]
    assert llm.engine.block_manager.num_used_blocks() == 0


def test_fused_decode_stack_declines_layers_without_a_qgemm_layout(bundled_llm):
    from tokenfab import SamplingParams
    bundled_llm.generate(["Hi"], SamplingParams(max_tokens=2, temperature=0))      # float32 linears
    assert bundled_llm.engine.model.attention_backend._stack == ()


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one thread runs no OpenMP pool")
def test_release_thread_pool_frees_the_calling_threads_openmp_workers():
    import os

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: OpenMP starts no worker threads to release")
    # Earlier tests may leave fewer torch threads (the adaptive controller); this test needs a pool of 2+.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x, w = torch.randn(16, 64), torch.ones(64)
        kernels.rms_norm(x, w, 1e-5)             # 16 rows: a parallel region, so this thread has a pool
        before = len(os.listdir("/proc/self/task"))
        assert kernels.release_thread_pool()
        # At least the one worker of this 2-thread region goes (an earlier, larger pool frees more).
        assert len(os.listdir("/proc/self/task")) <= before - 1
        torch.testing.assert_close(kernels.rms_norm(x, w, 1e-5), F.rms_norm(x, (64,), w, 1e-5))   # a new pool
    finally:
        torch.set_num_threads(threads)


def test_async_engine_releases_the_loader_threads_pool_before_stepping(monkeypatch, bundled_llm):
    import asyncio

    from tokenfab.engine.async_engine import AsyncEngine
    calls = []
    monkeypatch.setattr(kernels, "release_thread_pool", lambda: calls.append(1) or True)
    eng = AsyncEngine(bundled_llm.engine)

    async def main():
        eng.start()
        await eng.stop()

    asyncio.run(main())
    assert calls == [1]


@pytest.mark.parametrize("isa", ["avx2", "avx512"], indirect=True)
def test_float16_pools_store_rounded_kv_and_attend_like_float32_pools_holding_the_same_values(isa):
    _check_float16_pools()


def _check_float16_pools():
    torch.manual_seed(6)
    H, KVH, D, bs, nblocks, T = 9, 3, 64, 16, 40, 20
    rope = RotaryEmbedding(D, 10000.0, 512)
    qkv = torch.randn(T, (H + 2 * KVH) * D) * 3
    pos, slots = torch.arange(100, 100 + T), torch.randperm(nblocks * bs)[:T]
    k32, v32 = torch.zeros(nblocks, bs, KVH, D), torch.zeros(nblocks, bs, KVH, D)
    k16, v16 = k32.half(), v32.half()
    a, b = qkv.clone(), qkv.clone()
    kernels.rope_write_kv(a, H, KVH, D, pos, rope.cos, rope.sin_signed, k32, v32, slots)
    kernels.rope_write_kv(b, H, KVH, D, pos, rope.cos, rope.sin_signed, k16, v16, slots)
    assert torch.equal(a, b)                                            # q and k rotated alike, in float32
    assert torch.equal(k16, k32.half()) and torch.equal(v16, v32.half())  # stored rounded to nearest
    kc, vc = torch.randn(nblocks, bs, KVH, D).half(), torch.randn(nblocks, bs, KVH, D).half()
    lens = torch.tensor([1, 17, 64, 200, 33, 90, 120, 5, 16, 160])      # 10 sequences: whole-sequence tasks too
    tables = torch.stack([torch.randperm(nblocks)[:13] for _ in lens])
    q = torch.randn(len(lens), (H + 2 * KVH) * D)[:, :H * D]
    for window in (None, 50):
        out = kernels.decode_attention(q, kc, vc, tables, lens, H, KVH, D ** -0.5, window)
        ref = kernels.decode_attention(q, kc.float(), vc.float(), tables, lens, H, KVH, D ** -0.5, window)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_fused_decode_big_max_tokens_must_be_a_non_negative_integer():
    from tokenfab.config import EngineConfig
    EngineConfig(fused_decode_big_max_tokens=0).validate()          # 0: the stack stops at fused_decode_max_tokens
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="fused_decode_big_max_tokens must be a non-negative integer"):
            EngineConfig(fused_decode_big_max_tokens=bad).validate()
