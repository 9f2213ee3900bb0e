"""Quantized linears: packed and reference paths agree, and native GGUF layers equal gguf's own dequantize."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tokenfab.quant.schemes import dequantize_int4
from tokenfab.quant.linear import (Int4Linear, Int8Linear, Q4_0Linear, Q4_1Linear, Q8_0Linear, QuantLinear,
                                   empty_from_config, gguf_linear, set_kernel)

gguf = pytest.importorskip("gguf")


def _bf16_exact(t):
    # packed kernels round activations to bf16; feeding bf16-exact inputs isolates the weight math
    return t.bfloat16().float()


def _assert_matches_bf16_output(y, ref):
    # the packed kernels accumulate in float32 and return bf16: relative 2^-8 per output, plus slack
    torch.testing.assert_close(y, ref, rtol=2 ** -7, atol=2e-3 * float(ref.abs().max()))


def _run(mod: QuantLinear, x, kernel):
    mod.kernel = kernel
    return mod(x)


@pytest.fixture(scope="module")
def gguf_tensors(bundled_path):
    reader = gguf.GGUFReader(bundled_path)
    return {t.name: t for t in reader.tensors}


def _gguf_layer(t, cls):
    out_features, in_features = int(t.shape[1]), int(t.shape[0])      # GGUF lists ne0 (in) first
    ref = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)).reshape(out_features, in_features)
    return cls.from_gguf(t.data, out_features, in_features), ref


# ------------------------------------------------------------------------ own schemes: packed == reference

@pytest.mark.parametrize("make", [
    lambda w, b: Int8Linear.from_float(w, b),
    lambda w, b: Int4Linear.from_float(w, b, 32),
    lambda w, b: Int4Linear.from_float(w, b, 64),
    lambda w, b: Int4Linear.from_float(w, b, 128),                       # 576 inputs: padded to 640
    lambda w, b: Int4Linear.from_float(w, b, 128, input_scale=torch.rand(576) + 0.5),
], ids=["int8", "int4-g32", "int4-g64", "int4-g128-padded", "int4-awq"])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_packed_kernel_agrees_with_dequantize_then_linear(make, tokens):
    g = torch.Generator().manual_seed(tokens)
    w, b = torch.randn(192, 576, generator=g) * 0.05, torch.randn(192, generator=g)
    mod = make(w, b)
    x = _bf16_exact(torch.randn(tokens, 576, generator=g))
    if mod.input_scale is not None if isinstance(mod, Int4Linear) else False:
        x = _bf16_exact(x * mod.input_scale) / mod.input_scale      # so x * input_scale is bf16-exact too
    ref = _run(mod, x, "dequant")
    _assert_matches_bf16_output(_run(mod, x, "packed"), ref)
    # and the reference itself is F.linear with the dequantized weight
    xs = x if not (isinstance(mod, Int4Linear) and mod.input_scale is not None) else x * mod.input_scale
    torch.testing.assert_close(ref, F.linear(xs, mod.dequantize(), b))


def test_quantized_linear_stays_close_to_float_linear():
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(256, 576, generator=g) * 0.05, torch.randn(8, 576, generator=g)
    ref = F.linear(x, w)
    rel = {}
    for name, mod in [("int8", Int8Linear.from_float(w)), ("int4-g32", Int4Linear.from_float(w, group_size=32)),
                      ("int4-g128", Int4Linear.from_float(w, group_size=128))]:
        rel[name] = float((mod(x) - ref).norm() / ref.norm())
    assert rel["int8"] < 0.01 < rel["int4-g32"] < rel["int4-g128"] < 0.15


def test_forward_keeps_leading_dims_and_dtype():
    mod = Int4Linear.from_float(torch.randn(64, 96), torch.randn(64), group_size=32)
    x = torch.randn(2, 3, 96)
    assert mod(x).shape == (2, 3, 64)
    assert mod(x.bfloat16()).dtype == torch.bfloat16


def test_default_rules_pick_packed_for_few_tokens_and_dequant_for_many(monkeypatch):
    from tokenfab import kernels as c
    from tokenfab.kernels.tuning import default_rules
    monkeypatch.setattr(c, "enabled", lambda: False)                 # rules without tf_qgemm
    mod = Int4Linear.from_float(torch.randn(64, 96), group_size=32)
    assert default_rules(mod) == [(32, "packed"), (None, "dequant")]
    assert default_rules(mod, allow_float_copy=True) == [(4, "packed"), (None, "float")]
    # a large matrix (the LM head) stays packed further: expanding it costs more than the GEMM
    head = Q8_0Linear(torch.zeros(49152, 576, dtype=torch.int8), torch.ones(49152, 18))
    assert default_rules(head)[0] == (32, "packed")


def test_packed_kernel_refused_for_unsupported_shape():
    mod = Int4Linear.from_float(torch.randn(24, 96), group_size=32)   # 24 rows: not a multiple of 16
    assert not mod.packed_supported()
    with pytest.raises(ValueError, match="packed"):
        mod.kernel = "packed"
    mod.kernel = "auto"
    assert mod(torch.randn(1, 96)).shape == (1, 24)                   # auto falls back to dequant


def test_int8_packed_refused_for_input_dim_the_kernel_crashes_on():
    assert not Int8Linear.from_float(torch.randn(16, 33)).packed_supported()


def test_state_dict_holds_portable_buffers_not_the_packed_layout():
    mod = Int4Linear.from_float(torch.randn(32, 64), torch.randn(32), group_size=32)
    mod(torch.randn(1, 64))                                           # builds the packed cache
    assert set(mod.state_dict()) == {"bias", "qweight", "scales", "zeros"}
    twin = empty_from_config(mod.config())
    twin.load_state_dict(mod.state_dict())
    x = torch.randn(3, 64)
    assert torch.equal(twin(x), mod(x))


def test_set_kernel_reaches_every_quantized_linear():
    model = torch.nn.Sequential(Int8Linear.from_float(torch.randn(8, 32)), torch.nn.ReLU(),
                                Int4Linear.from_float(torch.randn(16, 8), group_size=32))
    assert set_kernel(model, "dequant") == 2
    assert all(m.kernel == "dequant" for m in model if isinstance(m, QuantLinear))
    with pytest.raises(ValueError, match="registered"):
        set_kernel(model, "fast")


# -------------------------------------------------------------------- native GGUF blocks, from the real file

def _bf16_effective_weight(mod: Int4Linear) -> torch.Tensor:
    """The weight the packed int4 kernel computes with: scale and zero as it reads them, in bf16."""
    return dequantize_int4(mod.unpacked_q(), mod.scales.bfloat16().float(), mod.zeros.bfloat16().float(),
                           mod.group_size, mod.in_features)


def _check_native_int4(mod: Int4Linear, ref_w: torch.Tensor):
    assert torch.equal(mod.dequantize(), ref_w)                       # exact: no requantization
    x = torch.randn(4, mod.in_features, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_run(mod, x, "dequant"), F.linear(x, ref_w))
    # packed: the kernel computes with (q - 8) * scale + zero, where for Q4_1 scale = d and zero = m + 8 d;
    # it reads both in bf16 (the file has fp16), which moves a weight by at most ~2^-8 of its group range
    # (Q4_0 scales are negative: ggml divides by -8)
    xb = _bf16_exact(x)
    eff = _bf16_effective_weight(mod)
    _assert_matches_bf16_output(_run(mod, xb, "packed"), F.linear(xb, eff))
    group_range = (15 * mod.scales.abs()).repeat_interleave(mod.group_size, dim=1)[:, : mod.in_features]
    assert bool(((eff - ref_w).abs() <= group_range * 2 ** -8 + ref_w.abs() * 2 ** -8).all())


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.ffn_down.weight"])
def test_native_q4_1_layer_equals_gguf_dequantize_then_linear(gguf_tensors, name):
    t = gguf_tensors[name]
    assert t.tensor_type == gguf.GGMLQuantizationType.Q4_1
    mod, ref_w = _gguf_layer(t, Q4_1Linear)
    _check_native_int4(mod, ref_w)


def test_native_q4_0_layer_equals_gguf_dequantize_then_linear():
    g = np.random.default_rng(0)
    w = (g.standard_normal((64, 128)) * 0.05).astype(np.float32)
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0)
    ref_w = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_0))
    _check_native_int4(Q4_0Linear.from_gguf(blocks, 64, 128), ref_w)


@pytest.mark.parametrize("rows,cols", [(64, 128), (48, 96), (16, 2048)])     # 96: an odd number of blocks
def test_q4_0_blocks_as_stored_decode_and_multiply_as_the_file_says(rows, cols):
    """Q4_0BlocksLinear keeps the file's 18-byte blocks (4.5 bits per weight): it decodes to gguf's floats,
    qgemm (tf_kint) matches them at 1-20 rows, and qmadd gives the same bits as on Q4_0Linear's int4 blocks."""
    from tokenfab.quant.kquants import Q4_0BlocksLinear
    from tokenfab.quant.linear import gguf_linear
    g = np.random.default_rng(cols)
    w = (g.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0)
    ref_w = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_0))
    mod = gguf_linear(blocks, "Q4_0", rows, cols, as_stored=True)
    assert isinstance(mod, Q4_0BlocksLinear) and mod.weight_bytes() == rows * cols * 18 // 32
    assert torch.equal(mod.dequantize(), ref_w)
    ids = torch.tensor([[rows - 1, 0], [2, 2]])
    assert torch.equal(mod.embedding(ids), ref_w[ids])
    from tokenfab import kernels
    if not kernels.enabled():
        pytest.skip("tokenfab's C kernels are not built here")
    for m in (1, 3, 8, 11, 20):
        x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
        ref = (x.double() @ ref_w.double().T).float()
        torch.testing.assert_close(kernels.qgemm(x, *mod.cpu_layout(), rows), ref, rtol=1e-4,
                                   atol=1e-4 * float(ref.abs().max()))
        if "avx2" in kernels.compiled_features():
            as_int4 = Q4_0Linear.from_gguf(blocks, rows, cols)
            assert torch.equal(kernels.qmadd(x, *mod.cpu_layout(), rows), kernels.qmadd(x, *as_int4.cpu_layout(), rows))


def test_native_q8_0_layer_equals_gguf_dequantize_then_linear(gguf_tensors):
    t = gguf_tensors["token_embd.weight"]
    assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0 and int(t.shape[1]) == 49152
    rows = np.concatenate([t.data[:1024], t.data[-1024:]])           # 2048 of the 49152 rows: enough, and fast
    ref_w = torch.from_numpy(gguf.quants.dequantize(rows, t.tensor_type))
    mod = Q8_0Linear.from_gguf(rows, 2048, int(t.shape[0]))
    assert torch.equal(mod.dequantize(), ref_w)
    x = torch.randn(2, mod.in_features, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_run(mod, x, "dequant"), F.linear(x, ref_w))
    # packed: q = 16 * hi + lo through the int4 kernel; exact up to d read in bf16
    xb = _bf16_exact(x)
    eff = (mod.qweight.float().view(2048, -1, 32) * mod.scales.bfloat16().float()[..., None]).view(2048, -1)
    _assert_matches_bf16_output(_run(mod, xb, "packed"), F.linear(xb, eff))
    ids = torch.tensor([[0, 17], [2047, 1000]])
    assert torch.equal(mod.embedding(ids), ref_w[ids])


def test_gguf_layer_rejects_data_of_the_wrong_size(gguf_tensors):
    t = gguf_tensors["blk.0.attn_q.weight"]
    with pytest.raises(ValueError, match="bytes"):
        Q4_1Linear.from_gguf(t.data, 576, 1536)


def test_gguf_linear_builds_native_layers_and_fuses_concatenated_rows(gguf_tensors):
    q, k, v = (gguf_tensors[f"blk.0.attn_{n}.weight"] for n in "qkv")
    fused = gguf_linear(np.concatenate([q.data, k.data, v.data]), q.tensor_type.name, 576 + 192 + 192, 576)
    assert isinstance(fused, Q4_1Linear)
    parts = [torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)) for t in (q, k, v)]
    assert torch.equal(fused.dequantize(), torch.cat(parts))
    assert gguf_linear(np.zeros((2, 32), np.float32), "F32", 2, 32) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_layers_run_on_cuda_through_the_dequant_path_and_match_cpu():
    w, b = torch.randn(64, 128) * 0.05, torch.randn(64)
    x = torch.randn(3, 128)
    for mod in (Int8Linear.from_float(w, b), Int4Linear.from_float(w, b, 32, input_scale=torch.rand(128) + 0.5)):
        mod.kernel = "dequant"
        ref = mod(x)
        mod = mod.cuda()
        mod.kernel = "auto"                                           # auto must not pick the CPU-only kernels
        torch.testing.assert_close(mod(x.cuda()).cpu(), ref, rtol=1e-4, atol=1e-4)
