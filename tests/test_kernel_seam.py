"""The kernel seam: every registered linear kernel against the float reference, the measured table's
choices, and greedy output with each attention backend and linear kernel forced."""
import os

import gguf
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tokenfab import kernels
from tokenfab.kernels import linear as seam
from tokenfab.kernels.select import select_kernels
from tokenfab.kernels.tuning import KernelTable
from tokenfab.model.layers import FloatLinear
from tokenfab.quant.kquants import KQUANT_LINEAR_TYPES, quantize_q4_k
from tokenfab.quant.kquants import Q4_0BlocksLinear
from tokenfab.quant.linear import Int4BlockLinear, Int4Linear, Int8Linear, Q8_0Linear, W8A8Linear

ROWS = (1, 7, 16, 17, 64, 512)


def _layers():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 576, generator=g) * 0.05
    q8 = torch.randint(-127, 128, (96, 576), generator=g, dtype=torch.int8)
    return {
        "float": FloatLinear(nn.Linear(576, 96)),
        "int8": Int8Linear.from_float(w),
        "int4": Int4Linear.from_float(w, group_size=32),
        "int4-awq-g128": Int4Linear.from_float(w, group_size=128, input_scale=torch.rand(576, generator=g) + 0.5),
        "q8_0": Q8_0Linear(q8, torch.rand(96, 18, generator=g) * 0.01),
        "w8a8": W8A8Linear.from_float(w),
        # K-quant super-blocks are 256 wide (the other K-quant types: tests/test_kquant.py, from random blocks)
        "q4_k": KQUANT_LINEAR_TYPES["Q4_K"].from_float(w[:, :512]),
        "q6_k": KQUANT_LINEAR_TYPES["Q6_K"].from_float(w[:, :512]),
        # a GGUF Q4_K tensor as the loader builds it where AMX runs: int4 blocks in the C kernels' layout
        "q4_k-int4": Int4BlockLinear.from_q4_k(quantize_q4_k(w[:, :512].numpy()), 96, 512),
        # GGUF Q4_0 blocks as stored
        "q4_0": Q4_0BlocksLinear.from_gguf(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_0), 96, 576),
    }


# relative tolerance of each kernel's arithmetic against float32 F.linear on the dequantized weight
TOLERANCE = {"onednn": 1e-5, "torch": 1e-6, "float": 1e-5, "dequant": 1e-6,
             "qgemm": 1e-4,       # activations as int16 per block of 32
             "qtile": 1e-4,       # the same, on AMX tiles (tests/test_qtile_kernel.py)
             "qmadd": 1e-4,       # the same activations, outputs in the lanes (tests/test_cpu_kernels.py)
             "qdot": 1e-2,        # activations as int8 per block of 32 (tests/test_qdot_kernels.py checks it exactly)
             "packed": 2 ** -7,   # activations and scales rounded to bfloat16
             "bf16": 2 ** -7,     # activations and the weight copy rounded to bfloat16
             "qbf16": 2 ** -7,    # the same, the weights rounded to bfloat16 inside the kernel
             "w8a8": 0.05}        # activations as int8 per row


C_KERNELS = ("qgemm", "qmadd", "qdot", "qtile", "qbf16")     # tokenfab's C library: each build the CPU runs


def _cases():
    names = {k.name: k.formats for k in seam.registered()}
    layers = _layers()
    return [(layer, kernel, isa) for layer in layers for kernel, fmts in names.items()
            if layers[layer].weight_format in fmts
            for isa in (kernels.ISA_VARIANTS if kernel in C_KERNELS else [None])]


@pytest.mark.parametrize("layer_name,kernel,isa", _cases(), indirect=["isa"])
def test_every_registered_kernel_matches_the_float_reference_at_every_row_count(layer_name, kernel, isa):
    layer = _layers()[layer_name]
    why = seam.get(kernel).supports(layer)
    if why is not None:
        pytest.skip(f"{kernel} cannot run {layer_name} on this machine: {why}")
    layer.plan = seam.forced_plan(layer, kernel)
    w = layer.dequantize(torch.float32)
    scale = layer.input_scale_tensor
    g = torch.Generator().manual_seed(1)
    for rows in ROWS:
        x = torch.randn(rows, layer.in_features, generator=g)
        ref = F.linear(x if scale is None else x * scale, w, layer.bias).detach()
        y = layer(x).detach()
        assert y.shape == (rows, layer.out_features) and y.dtype == torch.float32
        err = float((y - ref).abs().max() / ref.abs().max())
        assert err < 4 * TOLERANCE[kernel], (kernel, layer_name, rows, err)


def _table(key: str, times: dict[str, list[float]], rows=(1, 4, 16, 64)) -> KernelTable:
    """A table of `times` in units of 10 us, the scale of these small shapes' calls (the stack's absolute
    gap, STACK_GAP_S, is in seconds)."""
    return KernelTable({key: {"rows": list(rows), "times": {k: [None if t is None else t * 1e-5 for t in v]
                                                             for k, v in times.items()}}}, path=None)


def _int4_model(n: int = 2) -> nn.Module:
    g = torch.Generator().manual_seed(0)
    return nn.ModuleList(Int4Linear.from_float(torch.randn(64, 128, generator=g), group_size=32) for _ in range(n))


def test_registry_picks_the_measured_best_per_row_count(monkeypatch):
    monkeypatch.setattr(seam.get("qgemm"), "supports", lambda layer: None)
    model = _int4_model()
    key = model[0].shape_key()
    tbl = _table(key, {"qgemm": [1.0, 2.0, 8.0, 40.0], "packed": [3.0, 3.0, 6.0, 20.0],
                       "float": [5.0, 5.0, 5.0, 10.0]})
    select_kernels(model, max_rows=64, head_max_rows=8, table=tbl, autotune=False, float_copy_budget=1 << 30)
    assert model[0].plan.names() == [(4, "qgemm"), (None, "float")]
    assert model[1].plan.names() == model[0].plan.names()           # one measurement per shape
    # within the one-call decode stack's rows, qgemm keeps its place unless another is 2x faster
    select_kernels(model, max_rows=64, head_max_rows=8, table=tbl, autotune=False, float_copy_budget=1 << 30, stack_rows=16)
    assert model[0].plan.names() == [(16, "qgemm"), (None, "float")]


def test_above_the_small_stack_rows_a_float_copy_must_beat_the_stacks_own_kernels_by_the_stack_margin(monkeypatch):
    # qtile (precise) then qbf16 (lossy, bf16 activations) on one layout; the bf16 float copy (lossy) is
    # 15 % faster than qbf16 at 32-64 rows and 4x at 512: within the big stack rows (17-64) qbf16 keeps
    # them (a float copy would stop the one-call stack there), above them the copy wins
    for name in ("qtile", "qbf16", "bf16", "float"):
        monkeypatch.setattr(seam.get(name), "supports", lambda layer: None)
    # only the plan is checked, nothing runs: CPUs without bf16 units (oneDNN's bf16 reorder needs AVX-512
    # or AVX-NE-CONVERT) or AMX cannot build these kernels' real states
    for name in ("qtile", "qbf16", "bf16"):
        monkeypatch.setattr(seam.get(name), "prepare", lambda layer: object())
    model = _int4_model(1)
    key = model[0].shape_key()
    rows = (1, 16, 32, 64, 512)
    tbl = _table(key, {"qtile": [1.0, 1.0, 10.0, 20.0, 80.0], "qbf16": [4.0, 4.0, 4.0, 4.2, 8.0],
                       "bf16": [4.0, 4.0, 3.4, 3.6, 2.0]}, rows)
    kw = dict(max_rows=512, head_max_rows=8, table=tbl, autotune=False, float_copy_budget=1 << 30, stack_rows=16)
    select_kernels(model, **kw)
    assert model[0].plan.names() == [(16, "qtile"), (None, "bf16")]
    select_kernels(model, **kw, big_stack_rows=64)
    assert model[0].plan.names() == [(16, "qtile"), (64, "qbf16"), (None, "bf16")]
    # a precise pick (the float32 copy) is never displaced by the stack's lossy kernel
    kw["table"] = _table(key, {"qtile": [1.0, 1.0, 10.0, 20.0, 80.0], "qbf16": [4.0, 4.0, 3.0, 3.0, 8.0],
                               "float": [4.0, 4.0, 4.0, 6.0, 6.0]}, rows)
    select_kernels(model, **kw, big_stack_rows=64)
    assert model[0].plan.names() == [(16, "qtile"), (None, "float")]


def test_a_kernel_a_millisecond_a_call_faster_leaves_the_stack_even_when_less_than_2x_faster(monkeypatch):
    # a 1B model's FFN (16384x2048) as a Zen 5 EPYC measured it, in seconds: at 32 rows the float copy is
    # 1.97x faster than qmadd, short of STACK_MARGIN, but 12.4 ms a call faster; at 4 rows qgemm's 2.9 ms
    # against the copy's 4.7 keeps the stack
    for name in ("qgemm", "qmadd", "float"):
        monkeypatch.setattr(seam.get(name), "supports", lambda layer: None)
    monkeypatch.setattr(seam.get("float"), "prepare", lambda layer: object())
    model = _int4_model(1)
    key = model[0].shape_key()
    ms = {"qgemm": [1.02, 2.89, 13.81, 25.34], "qmadd": [4.55, 5.82, 13.93, 25.21], "float": [4.28, 4.70, 8.67, 12.79]}
    tbl = KernelTable({key: {"rows": [1, 4, 16, 32], "times": {k: [t * 1e-3 for t in v] for k, v in ms.items()}}},
                      path=None)
    select_kernels(model, max_rows=32, head_max_rows=8, table=tbl, autotune=False, float_copy_budget=1 << 30,
                   stack_rows=4, big_stack_rows=32)
    assert model[0].plan.names() == [(4, "qgemm"), (None, "float")]
    # the same gaps at a hundredth of the time (a small model's shape): the stack keeps its kernels
    tbl = KernelTable({key: {"rows": [1, 4, 16, 32], "times": {k: [t * 1e-5 for t in v] for k, v in ms.items()}}},
                      path=None)
    select_kernels(model, max_rows=32, head_max_rows=8, table=tbl, autotune=False, float_copy_budget=1 << 30,
                   stack_rows=4, big_stack_rows=32)
    assert model[0].plan.names() == [(16, "qgemm"), (None, "qmadd")]


def test_a_shape_that_holds_a_bf16_copy_runs_its_float_ranges_on_it_where_bf16_is_no_slower(monkeypatch):
    # bf16 (lossy) 3x faster than the float32 copy at 16-64 rows, 1.8x at 512 (short of LOSSY_MARGIN): the
    # table's picks alone would keep both copies, 6 bytes a weight; bf16 takes the 512-row range too
    for name in ("qgemm", "bf16", "float"):
        monkeypatch.setattr(seam.get(name), "supports", lambda layer: None)
    for name in ("bf16", "float"):
        monkeypatch.setattr(seam.get(name), "prepare", lambda layer: object())
    model = _int4_model(1)
    key = model[0].shape_key()
    rows = (1, 16, 64, 512)
    kw = dict(max_rows=512, head_max_rows=8, autotune=False, float_copy_budget=1 << 30)
    tbl = _table(key, {"qgemm": [1.0, 9.0, 30.0, None], "bf16": [3.0, 3.0, 6.0, 50.0],
                       "float": [9.0, 9.0, 18.0, 90.0]}, rows)
    select_kernels(model, table=tbl, **kw)
    assert model[0].plan.names() == [(1, "qgemm"), (None, "bf16")]
    # where the float32 copy is the faster of the two over its ranges, both stay
    tbl = _table(key, {"qgemm": [1.0, 9.0, 30.0, None], "bf16": [3.0, 3.0, 6.0, 100.0],
                       "float": [9.0, 9.0, 18.0, 90.0]}, rows)
    select_kernels(model, table=tbl, **kw)
    assert model[0].plan.names() == [(1, "qgemm"), (64, "bf16"), (None, "float")]


def test_a_kernel_must_beat_the_preferred_one_by_a_margin_and_a_lossy_one_by_more(monkeypatch):
    monkeypatch.setattr(seam.get("qgemm"), "supports", lambda layer: None)
    model = _int4_model(1)
    key = model[0].shape_key()
    # float 5 % faster than qgemm: noise, qgemm stays; packed (bf16 activations) 30 % faster: not enough
    tbl = _table(key, {"qgemm": [1.0, 1.0, 1.0, 1.0], "float": [0.95] * 4, "packed": [0.7] * 4})
    select_kernels(model, max_rows=512, head_max_rows=8, table=tbl, autotune=False, float_copy_budget=1 << 30)
    assert model[0].plan.names() == [(64, "qgemm"), (None, "float")]    # past its measured rows: the float copy
    select_kernels(model, max_rows=64, head_max_rows=8, table=tbl, autotune=False, float_copy_budget=1 << 30)
    assert model[0].plan.names() == [(None, "qgemm")]           # it never sees more rows: no float copy


def test_above_the_uniform_rows_kernels_sharing_a_layout_compete_on_time_alone(monkeypatch):
    # qgemm and qmadd share one prepared layout: above UNIFORM_ROWS (16) the faster one runs even when it
    # wins by less than TIE_MARGIN (a build that kept qgemm's four passes at 32 rows ran 32 streams ~10 %
    # slower); up to 16 rows the margin still holds (one kernel for the uniform rows), and a kernel with a
    # layout of its own (the float copy) still needs the margin everywhere
    for name in ("qgemm", "qmadd"):
        monkeypatch.setattr(seam.get(name), "supports", lambda layer: None)
    model = _int4_model(1)
    key = model[0].shape_key()
    rows = (1, 16, 32, 64)
    kw = dict(max_rows=64, head_max_rows=8, autotune=False, float_copy_budget=1 << 30)
    tbl = _table(key, {"qgemm": [1.0, 4.0, 10.0, 20.0], "qmadd": [3.0, 3.8, 9.4, 12.0]}, rows)
    select_kernels(model, table=tbl, **kw)
    assert model[0].plan.names() == [(16, "qgemm"), (None, "qmadd")]
    tbl = _table(key, {"qgemm": [1.0, 4.0, 10.0, 20.0], "qmadd": [3.0, 3.8, 10.4, 12.0]}, rows)
    select_kernels(model, table=tbl, **kw)
    assert model[0].plan.names() == [(32, "qgemm"), (None, "qmadd")]      # slower at 32: qgemm keeps it
    tbl = _table(key, {"qgemm": [1.0, 4.0, 10.0, 20.0], "float": [3.0, 3.8, 9.4, 19.0]}, rows)
    select_kernels(model, table=tbl, **kw)
    assert model[0].plan.names() == [(None, "qgemm")]                      # 6 % faster, its own copy: not enough


def test_registry_falls_back_when_the_measured_best_is_unavailable(monkeypatch):
    model = _int4_model(1)
    key = model[0].shape_key()
    tbl = _table(key, {"qgemm": [1.0, 1.0, 1.0, 1.0], "packed": [9.0] * 4, "float": [5.0] * 4})
    monkeypatch.setattr(seam.get("qgemm"), "supports", lambda layer: "no C compiler (test)")
    select_kernels(model, max_rows=64, head_max_rows=8, table=tbl, autotune=False, float_copy_budget=1 << 30)
    assert model[0].plan.names() == [(None, "float")]
    # and with no room for float copies either: the next measured kernel, then dequant past its rows
    select_kernels(model, max_rows=512, head_max_rows=8, table=tbl, autotune=False, float_copy_budget=0)
    assert [n for _, n in model[0].plan.names()] == ["packed", "dequant"]


def test_float_copies_are_kept_where_they_save_most_per_byte_within_the_budget(monkeypatch):
    monkeypatch.setattr(seam.get("qgemm"), "supports", lambda layer: None)
    g = torch.Generator().manual_seed(0)
    small, big = Int4Linear.from_float(torch.randn(64, 128, generator=g)), Int4Linear.from_float(torch.randn(256, 128, generator=g))
    model = nn.ModuleList([small, big])
    tbl = KernelTable({m.shape_key(): {"rows": [1, 64], "times": {"qgemm": [1.0, 10.0], "float": [2.0, 5.0]}}
                       for m in model}, path=None)
    report = select_kernels(model, max_rows=64, head_max_rows=8, table=tbl, autotune=False, float_copy_budget=4 * 64 * 128)
    assert small.plan.names() == [(1, "qgemm"), (None, "float")]
    assert "float" not in [n for _, n in big.plan.names()]
    assert report.float_copy_bytes == 4 * 64 * 128


def test_forcing_a_kernel_applies_where_it_runs_and_unknown_names_fail():
    model = nn.ModuleList([_int4_model(1)[0], FloatLinear(nn.Linear(128, 64))])
    select_kernels(model, max_rows=64, head_max_rows=8, autotune=False, force="dequant")
    assert model[0].plan.names() == [(None, "dequant")]
    assert model[1].plan.names()[0][1] in ("onednn", "torch")       # float layers: dequant doesn't run them
    with pytest.raises(ValueError, match="registered"):
        select_kernels(model, max_rows=64, head_max_rows=8, autotune=False, force="fastest")


def test_the_table_is_measured_once_and_cached(tmp_path, monkeypatch):
    from tokenfab.kernels import tuning
    monkeypatch.setattr(tuning, "_others_share", lambda *a: 0.0)     # a busy machine would measure again
    model = _int4_model(2)
    path = str(tmp_path / "t.json")
    tbl = KernelTable({}, path)
    select_kernels(model, max_rows=8, head_max_rows=8, table=tbl)
    tbl.save()
    again = KernelTable.load(path)
    assert model[0].shape_key() in again.entries
    assert again.entries[model[0].shape_key()]["rows"] == [1, 4, 8]
    before = again.measured_s
    select_kernels(model, max_rows=8, head_max_rows=8, table=again)
    assert again.measured_s == before                                # nothing measured again


def test_a_shape_measured_while_other_processes_took_the_cpus_is_measured_again_keeping_the_minimum(tmp_path, monkeypatch):
    from tokenfab.kernels import tuning
    model = _int4_model(2)
    key = model[0].shape_key()
    path = str(tmp_path / "t.json")
    shares = iter([0.9, 0.9, 0.0])             # two loads under load (a parallel compile), then a quiet one
    monkeypatch.setattr(tuning, "_others_share", lambda before, after, wall: next(shares))
    tbl = KernelTable({}, path)
    select_kernels(model, max_rows=8, head_max_rows=8, table=tbl)
    assert tbl.entries[key]["busy"] == 1
    first = {k: list(v) for k, v in tbl.entries[key]["times"].items()}
    tbl.save()
    again = KernelTable.load(path)              # the flag survives the file
    assert not again.has(key, [1, 4, 8], list(first))
    timed = []
    real = tuning._time_rotating
    monkeypatch.setattr(tuning, "_time_rotating", lambda *a: (timed.append(1), real(*a))[1])
    select_kernels(model, max_rows=8, head_max_rows=8, table=again)
    assert timed and again.entries[key]["busy"] == 2           # every row measured again, still busy
    for k, ts in again.entries[key]["times"].items():          # each time the minimum of the two
        assert all(b is None or b <= a for a, b in zip(first[k], ts)), k
    select_kernels(model, max_rows=8, head_max_rows=8, table=again)
    assert again.entries[key]["busy"] == 0                     # quiet: settled, nothing measured after it
    timed.clear()
    select_kernels(model, max_rows=8, head_max_rows=8, table=again)
    assert not timed
    # a machine that is always busy stops paying after REMEASURE_LOADS more loads
    again.entries[key]["busy"] = tuning.REMEASURE_LOADS + 1
    assert again.has(key, [1, 4, 8], list(first))


def test_the_busy_share_counts_other_processes_cpu_time_only():
    from tokenfab.kernels.tuning import _others_share
    assert _others_share((100.0, 10.0), (104.0, 12.0), 2.0) == pytest.approx(2.0 / (2.0 * (os.cpu_count() or 1)))
    assert _others_share((100.0, 10.0), (102.0, 12.0), 2.0) == 0.0      # all of it was this process
    assert _others_share(None, (1.0, 1.0), 1.0) is None
    assert _others_share((100.0, 10.0), (100.01, 10.0), 0.005) is None   # one tick in 5 ms: too short to tell


# ------------------------------------------------------------------ greedy output with each choice forced
PROMPTS = ["the quick brown fox", "seven clever engineers write fast kernels for memory bound decoding",
           "a lazy dog", "on small machines under real load the quick brown fox jumps over"]


def _batched_equals_alone(llm):
    from tokenfab import SamplingParams
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = [llm.generate(p, params)[0].outputs[0].token_ids for p in PROMPTS]
    batched = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert batched == alone
    assert llm.engine.block_manager.num_used_blocks() == 0
    return alone


@pytest.mark.parametrize("backend,kernel,quantization", [
    ("torch", "torch", "none"),
    pytest.param("cpu", "onednn", "none", marks=pytest.mark.slow),
    pytest.param("torch", "onednn", "none", marks=pytest.mark.slow),
    pytest.param("cpu", "qgemm", "gguf", marks=pytest.mark.slow),
    pytest.param("torch", "qgemm", "gguf", marks=pytest.mark.slow),
    pytest.param("cpu", "float", "gguf", marks=pytest.mark.slow),
])
def test_greedy_output_is_batch_invariant_with_each_backend_and_kernel_forced(bundled_files, backend, kernel,
                                                                            quantization):
    from tokenfab import LLM
    llm = LLM(loaded=bundled_files, quantization=quantization, max_model_len=512, num_kv_blocks=256,
              attention_backend=backend, linear_kernel=kernel)
    assert llm.engine.model.attention_backend.name == backend
    _batched_equals_alone(llm)


def test_torch_and_cpu_attention_backends_give_the_same_greedy_tokens(bundled_llm, bundled_files):
    from tokenfab import LLM, SamplingParams
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert bundled_llm.engine.model.attention_backend.name in ("cpu", "torch")
    torch_llm = LLM(loaded=bundled_files, quantization="none", max_model_len=512, num_kv_blocks=256,
                    attention_backend="torch")
    a = [o.outputs[0].token_ids for o in bundled_llm.generate(PROMPTS, params)]
    b = [o.outputs[0].token_ids for o in torch_llm.generate(PROMPTS, params)]
    assert a == b


def test_the_torch_backend_never_calls_the_c_attention_kernels(bundled_files, monkeypatch):
    """The portable path is torch alone, even where the C kernels could read its float32 pools."""
    from tokenfab import LLM, SamplingParams

    def called(*args, **kwargs):
        raise AssertionError("the torch attention backend called a C attention kernel")
    for name in ("decode_attention", "rope_write_kv", "decode_layers"):
        monkeypatch.setattr(kernels, name, called)
    llm = LLM(loaded=bundled_files, max_model_len=256, num_kv_blocks=64, attention_backend="torch")
    assert llm.engine.model.attention_backend.name == "torch"
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.float32     # pools the C decode kernel could read
    outs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]


def test_forcing_the_cpu_backend_where_it_cannot_run_says_why(bundled_files):
    from tokenfab import LLM
    with pytest.raises(ValueError, match="attention_backend='cpu'"):
        LLM(loaded=bundled_files, dtype="bfloat16", quantization="none", max_model_len=64, num_kv_blocks=16,
            attention_backend="cpu")
