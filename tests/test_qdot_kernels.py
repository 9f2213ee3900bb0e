"""The integer-dot kernel (tf_qdot, "qdot"): int8 activation blocks of 32 times the stored int4 / int8 /
Q8_0 blocks, and of 256 (llama.cpp's Q8_K) times the stored Q4_K / Q6_K super-blocks, on every instruction-set variant of the C library this CPU runs (the others
are skipped, with the reason printed), against the float reference and against the exact product of
the rounded activations; the registry's choice and fallback; greedy decoding with it forced."""
import os
import subprocess

import pytest
import torch
import torch.nn.functional as F

from tokenfab import kernels
from tokenfab.kernels import linear as seam
from tokenfab.kernels.select import select_kernels
from tokenfab.kernels.tuning import KernelTable
from tokenfab.quant.kquants import KQUANT_LINEAR_TYPES
from tokenfab.quant.linear import Int4Linear, Int8Linear, Q8_0Linear

ROWS = (1, 7, 16, 17, 64, 512)
ISAS = list(kernels.ISA_VARIANTS)
# what each variant's compiler must have enabled (tf_isa): the instruction set the dot products use
EXPECTED_FEATURE = {"avx2": "avx2", "avx_vnni": "avx_vnni", "avx512": "avx512", "avx512_vnni": "avx512_vnni"}

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="tokenfab's C kernels are not built here")


def _layers():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 512, generator=g) * 0.05
    return {
        "int4-g32": Int4Linear.from_float(w, group_size=32),
        "int4-g128": Int4Linear.from_float(w, group_size=128),
        "int8": Int8Linear.from_float(w),
        "q8_0": Q8_0Linear(torch.randint(-128, 128, (96, 512), generator=g, dtype=torch.int8),
                           torch.rand(96, 16, generator=g) * 1e-3),
        "q4_k": KQUANT_LINEAR_TYPES["Q4_K"].from_float(w),
        "q6_k": KQUANT_LINEAR_TYPES["Q6_K"].from_float(w),
    }


def _rounded(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x as tf_qdot sees it: int8 per block (32; 256 against K-quants), scale max|x| / 127, back to float."""
    xb = x.reshape(x.shape[0], -1, block)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    # 127 / amax correctly rounded, as C's division is (torch's scalar / tensor is a reciprocal-multiply
    # that can be an ulp off, which moved one x * inv from -51.5 to -51.499996 and flipped its rounding)
    inv = torch.where(amax > 0, (127.0 / amax.double()).float(), torch.zeros_like(amax))
    return (torch.round(xb * inv) * (amax / 127.0)).reshape(x.shape)


@pytest.mark.parametrize("isa", ISAS, indirect=True)   # each build this CPU runs; the rest skip
def test_each_isa_variant_is_built_for_the_instruction_set_it_names(isa):
    assert kernels.isa() == isa
    assert EXPECTED_FEATURE[isa] in kernels.compiled_features()
    if isa == "avx2":
        assert not {"avx512", "avx512_vnni", "avx_vnni"} & set(kernels.compiled_features())


@pytest.mark.parametrize("isa", ISAS, indirect=True)   # each build this CPU runs; the rest skip
@pytest.mark.parametrize("name", list(_layers()))
def test_qdot_equals_the_weights_times_the_rounded_activations_at_every_row_count(isa, name):
    layer = _layers()[name]
    layer.plan = seam.forced_plan(layer, "qdot")
    w = layer.dequantize(torch.float32)
    g = torch.Generator().manual_seed(1)
    for rows in ROWS:
        x = torch.randn(rows, 512, generator=g)
        y = layer(x)
        exact = F.linear(_rounded(x, 256 if name in ("q4_k", "q6_k") else 32).double(), w.double()).float()
        ref = F.linear(x, w)
        # the integer arithmetic is exact: only float32 summation order separates it from W . x~
        assert float((y - exact).abs().max() / exact.abs().max()) < 2e-5, (isa, name, rows)
        # and x~ is within int8 rounding of x: ~0.5 % (blocks of 32) to ~1 % (256) relative (Frobenius)
        assert float((y - ref).norm() / ref.norm()) < 2e-2, (isa, name, rows)


@pytest.mark.parametrize("isa", ISAS, indirect=True)   # each build this CPU runs; the rest skip
@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("width", [2048, 8192])         # Llama-3.2-1B's hidden and FFN widths
def test_kquant_qdot_is_exact_on_the_rounded_activations_at_the_1b_widths(isa, kind, width):
    """tf_kint8 on a GGUF file's blocks as llama-quantize writes them (random bytes, sane scales), 64
    outputs of a 1B-shaped layer, against gguf's own dequantizer times the activations rounded per 256."""
    import numpy as np
    from tokenfab.quant.kquants import reference_dequantize
    from tokenfab.quant.linear import gguf_linear
    bb, scales = {"Q4_K": (144, (0, 2)), "Q6_K": (210, (208,))}[kind]
    rng = np.random.default_rng(3)
    blocks = rng.integers(0, 256, size=(64, width // 256, bb), dtype=np.uint8)
    for off in scales:
        blocks[..., off:off + 2] = (rng.random((64, width // 256)) * 0.01 + 1e-3).astype(np.float16)[..., None].view(np.uint8)
    blocks = blocks.reshape(64, -1)
    layer = gguf_linear(blocks, kind, 64, width, as_stored=True)
    layer.plan = seam.forced_plan(layer, "qdot")
    w = torch.from_numpy(reference_dequantize(blocks, kind, 64, width)).double()
    g = torch.Generator().manual_seed(4)
    for rows in ROWS:
        x = torch.randn(rows, width, generator=g)
        exact = F.linear(_rounded(x, 256).double(), w)
        assert float((layer(x).double() - exact).abs().max() / exact.abs().max()) < 2e-5, (isa, kind, width, rows)


@pytest.mark.parametrize("isa", ISAS, indirect=True)   # each build this CPU runs; the rest skip
def test_a_row_gives_the_same_result_alone_and_in_any_batch(isa):
    layer = _layers()["int4-g32"]
    layer.plan = seam.forced_plan(layer, "qdot")
    x = torch.randn(17, 512, generator=torch.Generator().manual_seed(2))
    together = layer(x)
    for r in (0, 8, 16):
        assert torch.equal(layer(x[r:r + 1]), together[r:r + 1])


@pytest.mark.parametrize("isa", ISAS, indirect=True)   # each build this CPU runs; the rest skip
def test_vnni_builds_emit_vpdpbusd_and_the_avx2_build_does_not(isa):
    lib = _loaded_library_path()
    if lib is None or not _objdump():
        pytest.skip("objdump or the library's path is not available")
    dis = subprocess.run(["objdump", "-d", lib], capture_output=True, text=True).stdout
    assert ("vpdpbusd" in dis) == (isa in ("avx_vnni", "avx512_vnni")), isa


def _objdump() -> bool:
    from shutil import which
    return which("objdump") is not None


def _loaded_library_path() -> str | None:
    with open(f"/proc/{os.getpid()}/maps") as f:
        paths = {line.split()[-1] for line in f if f"cpu-{kernels.isa()}-" in line}
    return next(iter(paths), None)


def test_an_isa_the_cpu_lacks_is_refused_with_what_it_runs(monkeypatch):
    monkeypatch.setattr(kernels, "available_isas", lambda: ["avx2"])
    with pytest.raises(ValueError, match="runs avx2"):
        kernels.set_isa("avx512_vnni")


def test_unsupported_kquant_types_and_missing_c_kernels_are_refused_with_a_reason():
    q2 = KQUANT_LINEAR_TYPES["Q2_K"](torch.zeros(32, 84, dtype=torch.uint8), 256)     # Q2_K bytes as a file holds them
    assert "Q4_K and Q6_K" in seam.get("qdot").supports(q2)
    layer = _layers()["int8"]
    kernels.set_enabled(False)
    try:
        assert "not built" in seam.get("qdot").supports(layer)
        assert "qdot" not in [k.name for k in seam.candidates(layer)]
        with pytest.raises(ValueError, match="cannot run"):
            seam.forced_plan(layer, "qdot")
    finally:
        kernels.set_enabled(True)


def _table(key, times, rows=(1, 4, 16, 64)):
    return KernelTable({key: {"rows": list(rows), "times": times}}, path=None)


def test_the_table_picks_qdot_only_when_opted_in_and_faster_and_falls_back_without_it(monkeypatch):
    layer = _layers()["q4_k"]
    key = layer.shape_key()
    # qdot 3x faster than qgemm at 1-4 rows, 17 % faster at 16; float fastest at 64
    tbl = _table(key, {"qgemm": [3.0, 3.0, 6.0, 20.0], "qdot": [1.0, 1.0, 5.0, 30.0], "float": [9.0, 9.0, 9.0, 9.0]})
    select_kernels(torch.nn.ModuleList([layer]), max_rows=512, head_max_rows=8, table=tbl, autotune=False,
                   float_copy_budget=1 << 30, int8_activations=True)
    # opted in, its precision was asked for: it wins on time (TIE_MARGIN), not only when 2x faster
    assert layer.plan.names() == [(16, "qdot"), (None, "float")]
    tbl = _table(key, {"qgemm": [3.0, 3.0, 6.0, 20.0], "qdot": [1.0, 1.0, 5.7, 30.0], "float": [9.0, 9.0, 9.0, 9.0]})
    select_kernels(torch.nn.ModuleList([layer]), max_rows=512, head_max_rows=8, table=tbl, autotune=False,
                   float_copy_budget=1 << 30, int8_activations=True)
    assert layer.plan.names() == [(4, "qdot"), (16, "qgemm"), (None, "float")]     # 5 % faster at 16: a tie
    # opt-in: without int8_activations the same table never chooses it
    select_kernels(torch.nn.ModuleList([layer]), max_rows=512, head_max_rows=8, table=tbl, autotune=False,
                   float_copy_budget=1 << 30)
    assert layer.plan.names() == [(16, "qgemm"), (None, "float")]
    # without the C kernels neither runs: the float copy takes every row count
    monkeypatch.setattr(seam.get("qdot"), "supports", lambda layer: "not built (test)")
    monkeypatch.setattr(seam.get("qgemm"), "supports", lambda layer: "not built (test)")
    select_kernels(torch.nn.ModuleList([layer]), max_rows=512, head_max_rows=8, table=tbl, autotune=False,
                   float_copy_budget=1 << 30, int8_activations=True)
    assert layer.plan.names() == [(None, "float")]


def test_the_one_call_decode_stack_runs_qdot_layouts_as_the_layer_path_does(bundled_files):
    """Greedy tokens with qdot forced: the same alone and batched, and the same with the one-call decode
    stack (tf_qgemm's qdot flag) as without it."""
    from tokenfab import LLM, SamplingParams
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = {}
    threads = torch.get_num_threads()   # the engine's adaptive threads may lower it on a busy machine and
    try:                                # leave it lowered when the engine goes: later tests expect the default
        _stack_vs_layers(bundled_files, prompts, params, outs)
    finally:
        torch.set_num_threads(threads)
    assert outs[True] == outs[False]


def _stack_vs_layers(bundled_files, prompts, params, outs):
    from tokenfab import LLM
    for fused in (True, False):
        llm = LLM(loaded=bundled_files, quantization="gguf", max_model_len=256, num_kv_blocks=128,
                  attention_backend="cpu", linear_kernel="qdot", enable_fused_decode=fused,
                  kernel_autotune=False)
        alone = [llm.generate(p, params)[0].outputs[0].token_ids for p in prompts]
        batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert batched == alone
        assert llm.engine.block_manager.num_used_blocks() == 0
        assert bool(llm.engine.model.attention_backend.stack_rows) == fused    # the stack took the qdot layouts
        outs[fused] = alone
