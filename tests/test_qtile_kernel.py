"""The AMX tile kernel (tf_qtile, "qtile"): int4 / int8 / Q8_0 blocks times a few activation rows.

It must compute what the weights times the int16-rounded activations are (the float reference within
the rounding) at every row count, give each row the same bits whatever rows run with it (the
speculative verify's rows and a 1-row decode must agree, or greedy speculation would drift from plain
decoding), give the same bits on AMX as its plain C reference, and keep the table from mixing it with
qgemm in the decode rows. The AMX-only tests skip, with the reason, on CPUs (or kernels) without it."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tokenfab import kernels
from tokenfab.kernels import linear as seam
from tokenfab.kernels.select import select_kernels
from tokenfab.kernels.tuning import KernelTable
from tests.test_qdot_kernels import ISAS, _layers as qdot_layers
from tokenfab.quant.linear import Int4Linear, Int8Linear, Q4_1Linear, Q8_0Linear

ROWS = (1, 2, 3, 5, 8, 9, 12, 16, 17, 29, 40, 64)   # above 16: groups of 16, the last of 1, 13 (padded to 16) or 8
QMAX = 32639.0                 # tf_qtile's int16 range: q = 256 hi + lo with hi, lo both int8

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="tokenfab's C kernels are not built here")


def _needs_amx():
    if not kernels.amx_available():
        pytest.skip(f"needs AMX int8 tiles and the kernel's permission (this CPU's kernels: {kernels.describe()})")


def _layers():
    """The qdot tests' random layers, in the formats qtile takes (the same weights and seeds), and two whose
    scales and offsets are float16 values, as GGUF's Q4_1 / Q8_0 blocks store them (tiled in float16)."""
    layers = {k: v for k, v in qdot_layers().items() if k in ("int4-g32", "int4-g128", "int8", "q8_0")}
    g = torch.Generator().manual_seed(8)
    d = (torch.rand(96, 16, generator=g) * 1e-2).half().float()
    m = (-torch.rand(96, 16, generator=g) * 8e-2).half().float()
    q = torch.randint(0, 16, (96, 512), generator=g, dtype=torch.uint8)
    layers["q4_1-f16"] = Q4_1Linear.from_codes(q, d, m)
    layers["q8_0-f16"] = Q8_0Linear(torch.randint(-128, 128, (96, 512), generator=g, dtype=torch.int8), d)
    return layers


def _state(layer):
    return kernels.qtile_pack(layer.cpu_layout(), layer.out_features)


def _rounded(x: torch.Tensor) -> torch.Tensor:
    """x as tf_qtile sees it: int16 per block of 32 in [-32639, 32639], back to float."""
    xb = x.reshape(x.shape[0], -1, 32)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, (QMAX / amax.double()).float(), torch.zeros_like(amax))
    return (torch.round(xb * inv) * (amax / QMAX)).reshape(x.shape)


@pytest.mark.parametrize("name", list(_layers()))
def test_qtile_matches_the_dequantized_weights_at_every_row_count(name):
    layer = _layers()[name]
    q, d, m, gs, bits = _state(layer)
    w = layer.dequantize(torch.float32)
    # int4's offsets multiply the float sums of x (as tf_qgemm's do), the rest the rounded x
    offsets = torch.zeros_like(w) if m is None else layer.cpu_layout()[2].repeat_interleave(gs, dim=1)[:, :512]
    g = torch.Generator().manual_seed(1)
    for rows in ROWS:
        x = torch.randn(rows, 512, generator=g)
        y = kernels.qtile(x, q, d, m, gs, bits, layer.out_features)
        exact = (F.linear(_rounded(x).double(), (w - offsets).double())
                 + F.linear(x.double(), offsets.double())).float()
        ref = F.linear(x, w)
        # the integer dots are exact: float32 sums of the block products separate it from W . x~
        assert float((y - exact).abs().max() / exact.abs().max()) < 1e-5, (name, rows)
        assert float((y - ref).abs().max() / ref.abs().max()) < 1e-4, (name, rows)


@pytest.mark.parametrize("name", list(_layers()))
def test_a_rows_result_is_the_same_bits_whatever_rows_run_with_it(name):
    layer = _layers()[name]
    state = _state(layer)
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(2)) * 3
    alone = torch.cat([kernels.qtile(x[i:i + 1], *state, layer.out_features) for i in range(40)])
    for rows in ROWS:
        together = kernels.qtile(x[:rows], *state, layer.out_features)
        assert torch.equal(together, alone[:rows]), (name, rows)


@pytest.mark.parametrize("name", list(_layers()))
def test_amx_tiles_give_the_plain_c_references_bits(name):
    _needs_amx()
    layer = _layers()[name]
    state = _state(layer)
    x = torch.randn(16, 512, generator=torch.Generator().manual_seed(3))
    for rows in ROWS:
        xr = x[:rows] if rows <= 16 else x.repeat(3, 1)[:rows]
        tiles = kernels.qtile(xr, *state, layer.out_features)
        plain = kernels.qtile(xr, *state, layer.out_features, path="reference")
        assert torch.equal(tiles, plain), (name, rows)


@pytest.mark.parametrize("isa", ISAS, indirect=True)   # each build this CPU runs; the rest skip
def test_every_isa_variant_gives_the_references_bits(isa):
    """Each C build this CPU runs (avx2: the reference loop; avx512: AMX alone; avx512_vnni: AMX and VNNI)
    computes qtile's bits; only the avx512_vnni build offers the VNNI path."""
    assert kernels.qtile_vnni_available() == (isa == "avx512_vnni")
    for name in ("int4-g32", "q8_0-f16"):
        layer = _layers()[name]
        state = _state(layer)
        x = torch.randn(17, 512, generator=torch.Generator().manual_seed(12))
        for rows in (1, 5, 17):
            auto = kernels.qtile(x[:rows], *state, layer.out_features)
            assert torch.equal(auto, kernels.qtile(x[:rows], *state, layer.out_features, path="reference")), (isa, name, rows)


def _needs_vnni():
    if not kernels.qtile_vnni_available():
        pytest.skip(f"needs a build for AVX-512 VNNI (this CPU's kernels: {kernels.describe()})")


@pytest.mark.parametrize("name", list(_layers()))
def test_the_vnni_path_gives_the_plain_c_references_bits(name):
    """The VNNI path (1-4 rows per pass; every row count where AMX is missing) computes the same exact
    integer dots and the same float steps in the same order as the reference, at every row count."""
    _needs_vnni()
    layer = _layers()[name]
    state = _state(layer)
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(5)) * 2
    x[3, 64:96] = 0                    # an all-zero block: scale 0
    for rows in ROWS:
        vnni = kernels.qtile(x[:rows], *state, layer.out_features, path="vnni")
        plain = kernels.qtile(x[:rows], *state, layer.out_features, path="reference")
        assert torch.equal(vnni, plain), (name, rows)


def test_the_vnni_path_takes_int8_weights_at_both_ends_of_their_range():
    """int8 weights go in as the signed operand and the activations plus 128 as the unsigned one: the
    weight sums that take the 128 back out must hold at -128 / 127 weights and full-scale activations."""
    _needs_vnni()
    w = torch.full((32, 64), 127, dtype=torch.int8)
    w[::2] = -128
    w[1::4, ::3] = 0
    layer = Int8Linear(w, torch.rand(32) + 0.5)
    state = _state(layer)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(6))
    x[:, ::5] = x.abs().max()
    vnni = kernels.qtile(x, *state, layer.out_features, path="vnni")
    assert torch.equal(vnni, kernels.qtile(x, *state, layer.out_features, path="reference"))


def test_the_seam_runs_qtile_through_the_layer_and_pads_int4_rows():
    _needs_amx()
    w = torch.randn(64, 224, generator=torch.Generator().manual_seed(4)) * 0.05    # 224: padded to 256 (groups of 64)
    layer = Int4Linear.from_float(w, group_size=64)
    layer.plan = seam.forced_plan(layer, "qtile")
    x = torch.randn(5, 224)
    ref = F.linear(x, layer.dequantize(torch.float32))
    assert float((layer(x) - ref).abs().max() / ref.abs().max()) < 1e-4


@pytest.mark.parametrize("path", ["auto", "reference", "vnni"])
def test_zero_rows_give_an_empty_result(path):
    # A step whose only work is a prefill chunk mid-prompt samples no row: the LM head gets 0 rows.
    # A 0-row tile configuration is a general-protection fault (the server died of it under mixed load).
    for name, layer in _layers().items():
        q, d, m, gs, bits = _state(layer)
        y = kernels.qtile(torch.randn(0, 512), q, d, m, gs, bits, layer.out_features, path=path)
        assert y.shape == (0, layer.out_features), name


def test_float16_scales_are_tiled_in_float16_only_where_that_is_exact():
    layers = _layers()
    for name in ("q4_1-f16", "q8_0-f16"):
        q, d, m, gs, bits = _state(layers[name])
        assert bits & kernels.QTILE_HALF and d.dtype == torch.float16, name
        assert m is None or m.dtype == torch.float16, name
    for name in ("int4-g32", "q8_0"):                 # float32 scales that float16 would round
        q, d, m, gs, bits = _state(layers[name])
        assert not bits & kernels.QTILE_HALF and d.dtype == torch.float32, name


def test_qtile_says_why_it_cannot_run_a_layer():
    w = torch.randn(40, 64) * 0.05                     # 40 outputs: not whole tiles of 16
    why = seam.get("qtile").supports(Int8Linear.from_float(w))
    assert why is not None and "16" in why


def _table(key, times, rows=(1, 4, 8, 16)):
    return KernelTable({key: {"rows": list(rows), "times": {k: list(v) for k, v in times.items()}}})


def test_the_table_never_mixes_qgemm_and_qtile_in_the_decode_rows(monkeypatch):
    """qgemm a little faster at 1 row, qtile far faster at 4-16: one of them for all of 1-16 rows (the
    one with the least total), so a 1-row decode and a 5-row verify compute a token alike."""
    for name in ("qgemm", "qtile"):
        monkeypatch.setattr(seam.get(name), "supports", lambda layer: None)
    layer = Int4Linear.from_float(torch.randn(64, 128) * 0.05, group_size=32)
    model = torch.nn.Sequential(layer)
    tbl = _table(layer.shape_key(), {"qgemm": [1.0, 4.0, 8.0, 16.0], "qtile": [1.3, 1.4, 1.6, 2.0],
                                     "dequant": [50.0] * 4})
    select_kernels(model, max_rows=16, head_max_rows=16, autotune=False, table=tbl)
    assert model[0].plan.names() == [(None, "qtile")]
    # qtile slower everywhere but one bucket: qgemm throughout
    tbl = _table(layer.shape_key(), {"qgemm": [1.0, 1.0, 1.0, 1.0], "qtile": [2.0, 0.8, 2.0, 2.0],
                                     "dequant": [50.0] * 4})
    select_kernels(model, max_rows=16, head_max_rows=16, autotune=False, table=tbl)
    assert model[0].plan.names() == [(None, "qgemm")]


def test_lossy_kernels_of_one_precision_compete_by_time_among_themselves(monkeypatch):
    """bf16 and qbf16 round alike: once either is LOSSY_MARGIN faster than the precise kernels, the faster
    of the two is taken (as between precise kernels), not the first in rank."""
    from tokenfab.kernels.tuning import _pick
    order, lossy = ["qtile", "qbf16", "bf16"], {"qbf16", "bf16"}
    assert _pick(order, {"qtile": 10.0, "qbf16": 4.0, "bf16": 2.0}, lossy) == "bf16"
    assert _pick(order, {"qtile": 10.0, "qbf16": 2.0, "bf16": 4.0}, lossy) == "qbf16"
    assert _pick(order, {"qtile": 10.0, "qbf16": 2.0, "bf16": 1.9}, lossy) == "qbf16"      # a tie: rank
    assert _pick(order, {"qtile": 10.0, "qbf16": 6.0, "bf16": 6.0}, lossy) == "qtile"      # not 2x faster


def test_the_bf16_copy_needs_only_1_5x_over_the_float32_copy_it_halves(monkeypatch):
    """Against a precise float copy, a lossy copy of half its bytes needs LOSSY_COPY_MARGIN (1.5x), not
    LOSSY_MARGIN (2x); against a precise kernel with no copy, 2x as before."""
    from tokenfab.kernels.tuning import _pick
    order, lossy = ["qgemm", "float", "bf16"], {"bf16"}
    assert _pick(order, {"qgemm": 30.0, "float": 12.9, "bf16": 7.4}, lossy) == "bf16"    # 1.75x the float copy
    assert _pick(order, {"qgemm": 30.0, "float": 12.9, "bf16": 9.0}, lossy) == "float"   # 1.43x: not enough
    assert _pick(order, {"qgemm": 10.0, "float": 30.0, "bf16": 6.0}, lossy) == "qgemm"   # 1.67x qgemm: 2x needed


def test_the_speculative_policy_prices_rows_by_the_decoders_kernel(monkeypatch):
    from tokenfab.engine.spec.policy import ROW_COST, row_cost_of
    for name in ("qgemm", "qtile"):
        monkeypatch.setattr(seam.get(name), "supports", lambda layer: None)
    model = torch.nn.Sequential(Int4Linear.from_float(torch.randn(64, 128) * 0.05, group_size=32))
    model[0].plan = seam.build_plan(model[0], [(16, "qtile"), (None, "dequant")])
    assert row_cost_of(model, 5) == seam.get("qtile").row_cost < ROW_COST
    model[0].plan = seam.build_plan(model[0], [(16, "qgemm"), (None, "dequant")])
    assert row_cost_of(model, 5) == ROW_COST


@pytest.mark.timeout(900)
def test_speculative_greedy_on_the_quantized_model_matches_plain_token_for_token(bundled_files):
    """The GGUF's own Q4_1 / Q8_0 blocks through qtile: 1-row decodes, 8-row batches and 5-row
    verifications (40 rows a step for 8 sequences) must pick the same tokens."""
    _needs_amx()
    from tokenfab import LLM, SamplingParams
    passage = ("The cache holds blocks of sixteen tokens each, and the scheduler admits requests while the "
               "budget allows. ")
    prompts = [f"Repeat the text.\nText: {passage * (1 + i % 3)}\nRepeat: " if i % 2 == 0 else
               " ".join(["seven clever engineers write fast kernels"] * (1 + i)) for i in range(8)]
    llm = LLM(loaded=bundled_files, linear_kernel="qtile", max_model_len=1024, num_kv_blocks=512,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                  "max_batch_size": 64, "adaptive": False})
    assert llm.engine.model.layers[0].mlp.gate_up_proj.plan.names() == [(None, "qtile")]
    greedy = dict(max_tokens=64, temperature=0, ignore_eos=True)
    plain = llm.generate(prompts, SamplingParams(**greedy, speculative=False))
    alone = llm.generate(prompts[:1], SamplingParams(**greedy, speculative=False))     # 1-row decode steps
    spec = llm.generate(prompts, SamplingParams(**greedy))
    st = llm.engine.stats()
    assert st.spec_decode_num_drafts > 0 and st.spec_decode_num_accepted_tokens > 0, st
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert alone[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert llm.engine.block_manager.num_used_blocks() == 0


def test_without_amx_qtile_runs_every_row_count_on_vnni():
    """TOKENFAB_NO_AMX=1 runs the process as on an AVX-512 VNNI CPU without AMX (Ice Lake, Zen 4): qtile
    is still offered, every row count takes the VNNI path, and the bits stay the reference's."""
    _needs_vnni()
    code = (
        "import torch\n"
        "from tokenfab import kernels\n"
        "from tokenfab.kernels import linear as seam\n"
        "from tests.test_qtile_kernel import _layers, _state\n"
        "assert not kernels.amx_available()\n"
        "for name, layer in _layers().items():\n"
        "    assert seam.get('qtile').supports(layer) is None, name\n"
        "    x = torch.randn(17, 512, generator=torch.Generator().manual_seed(7))\n"
        "    st = _state(layer)\n"
        "    assert torch.equal(kernels.qtile(x, *st, layer.out_features), kernels.qtile(x, *st, layer.out_features, path='reference')), name\n"
        "assert seam.get('qtile').row_cost == 0.3\n"
        "print('ok')\n")
    env = dict(os.environ, TOKENFAB_NO_AMX="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def _needs_amx_bf16():
    if not kernels.amx_bf16_available():
        pytest.skip(f"needs AMX bf16 tiles and the kernel's permission (this CPU's kernels: {kernels.describe()})")


def test_qbf16_as_the_first_tile_call_of_a_process_runs_or_refuses_without_crashing():
    """qbf16 called before anything asked for AMX: Linux grants the tile state only when asked, so a first
    tile instruction without it dies with SIGILL (it did, in a benchmark script); the wrapper asks first,
    and where AMX bf16 is missing (TOKENFAB_NO_AMX=1 here) it raises instead."""
    code = ("import torch\n"
            "from tokenfab import kernels\n"
            "from tokenfab.quant.linear import Int4Linear\n"
            "assert kernels.enabled()\n"
            "lay = kernels.qtile_pack(Int4Linear.from_float(torch.randn(64, 128) * 0.05, None, 32).cpu_layout(), 64)\n"
            "try:\n"
            "    print(tuple(kernels.qbf16(torch.randn(3, 128), *lay, 64).shape))\n"
            "except RuntimeError as e:\n"
            "    print('refused:', e)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for env, expect in ((dict(os.environ), "(3, 64)" if kernels.amx_bf16_available() else "refused"),
                        (dict(os.environ, TOKENFAB_NO_AMX="1"), "refused")):
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=root)
        assert out.returncode == 0 and out.stdout.strip().startswith(expect), (out.returncode, out.stdout, out.stderr[-2000:])


@pytest.mark.parametrize("name", list(_layers()))
def test_qbf16_computes_what_the_bf16_float_copy_computes(name):
    """tf_qbf16 expands each tile's weights to bf16 inside the kernel: the same bf16 weights as the float
    copy, the same bf16 activations, float32 sums; only the order of the sums differs. Row counts that are
    not whole tiles of 16 (17, 33, 100) keep their padding rows out of the result."""
    _needs_amx_bf16()
    layer = _layers()[name]
    state = _state(layer)
    wb = layer.dequantize(torch.float32).bfloat16().float()
    g = torch.Generator().manual_seed(9)
    for rows in (1, 16, 17, 33, 64, 100):
        x = torch.randn(rows, 512, generator=g)
        y = kernels.qbf16(x, *state, layer.out_features)
        ref = F.linear(x.bfloat16().double(), wb.double()).float()
        assert y.shape == (rows, layer.out_features)
        assert float((y - ref).abs().max() / ref.abs().max()) < 1e-5, (name, rows)


def test_qbf16_on_a_wide_layer_runs_every_thread_and_block_of_tiles():
    """A layer wide enough that each thread expands its tile pairs in several blocks (~1 MB of bf16 tiles
    at a time), with an odd number of 16-output tiles (the last pair holds one): the same result as the
    reference at row counts that end inside a row group."""
    _needs_amx_bf16()
    g = torch.Generator().manual_seed(11)
    N, K = 16 * 129, 1024
    d = (torch.rand(N, K // 32, generator=g) * 1e-2).half().float()
    m = (-torch.rand(N, K // 32, generator=g) * 8e-2).half().float()
    layer = Q4_1Linear.from_codes(torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8), d, m)
    state = _state(layer)
    wb = layer.dequantize(torch.float32).bfloat16().float()
    for rows in (40, 100):
        x = torch.randn(rows, K, generator=g)
        y = kernels.qbf16(x, *state, N)
        ref = F.linear(x.bfloat16().double(), wb.double()).float()
        assert float((y - ref).abs().max() / ref.abs().max()) < 1e-5, rows


def test_a_rows_qbf16_result_is_the_same_bits_whatever_rows_run_with_it():
    _needs_amx_bf16()
    layer = _layers()["q4_1-f16"]
    state = _state(layer)
    x = torch.randn(70, 512, generator=torch.Generator().manual_seed(10))
    full = kernels.qbf16(x, *state, layer.out_features)
    for rows in (17, 32, 33, 64):
        assert torch.equal(kernels.qbf16(x[:rows], *state, layer.out_features), full[:rows]), rows


def test_qtile_and_qbf16_in_one_plan_share_one_packed_layout():
    _needs_amx_bf16()
    layer = _layers()["q4_1-f16"]
    plan = seam.build_plan(layer, [(16, "qtile"), (None, "qbf16")])
    assert plan.state_of("qtile") is plan.state_of("qbf16")
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(11))
    ref = F.linear(x, layer.dequantize(torch.float32))
    for rows in (5, 40):                      # qtile, then qbf16
        assert float((plan(x[:rows], layer) - ref[:rows]).abs().max() / ref.abs().max()) < 2 ** -6
