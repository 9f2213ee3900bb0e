"""The planner's arithmetic: the seeds' numbers, KV sizes, model descriptions, roofline, memory and cost."""
import json
from dataclasses import replace

import pytest

from tokenfab.plan import roofline
from tokenfab.plan.cost import CostAssumptions, hourly_cost, usd_per_million_tokens
from tokenfab.plan.dtypes import parse_dtype
from tokenfab.plan.hardware import Hardware, get_hardware, load_catalog
from tokenfab.plan.memory import MemorySettings, plan_memory, tp_options
from tokenfab.plan.models import PRESETS, from_hf_config, preset, spec_from_gguf_reader
from tokenfab.plan.roofline import Deployment, Efficiency

GB = 1e9
IDEAL = Efficiency(bandwidth=1.0, compute=1.0)


def _hw(bw_gb_s: float, **kw) -> Hardware:
    return Hardware(name=f"test-{bw_gb_s}", memory_gib=kw.pop("memory_gib", 80), bandwidth_gb_s=bw_gb_s,
                    tflops=kw.pop("tflops", {"fp16": 100.0}), **kw)


@pytest.fixture(scope="module")
def catalog():
    return load_catalog(include_user=False)


# ---- the seeds' numbers ------------------------------------------------------------------------

def test_7b_fp16_weights_are_14_gb():
    assert parse_dtype("fp16").nbytes(7e9) == pytest.approx(14 * GB)
    assert preset("llama-2-7b").weight_bytes("fp16") == pytest.approx(14 * GB, rel=0.05)


@pytest.mark.parametrize("bw, ms, tok_s", [(336, 42, 24), (1000, 14, 70)])
def test_7b_fp16_decode_ceiling_is_weight_bytes_over_bandwidth(bw, ms, tok_s):
    dep = Deployment.make(preset("llama-2-7b"), _hw(bw), "fp16", eff=IDEAL)
    st = roofline.decode(dep, batch=1, context=0)
    assert st.bound == "memory"
    assert st.total_s == pytest.approx(ms / 1e3, rel=0.1)
    assert 1 / st.total_s == pytest.approx(tok_s, rel=0.1)
    # The nominal 7B of the seeds: 14 GB at that bandwidth.
    assert 14 * GB / (bw * GB) == pytest.approx(ms / 1e3, rel=0.02)


def test_7b_needs_about_14_gflops_per_token():
    m = preset("llama-2-7b")
    assert m.flops_per_token() == pytest.approx(14e9, rel=0.1)
    assert m.flops_per_token() == pytest.approx(2 * m.total_params, rel=0.03)


@pytest.mark.parametrize("name, gb", [("llama-2-7b", 3.5), ("llama-2-70b", 35)])
def test_int4_weights_are_half_a_byte_per_parameter_plus_group_scales(name, gb):
    m = preset(name)
    assert m.weight_bytes("int4") == pytest.approx(gb * GB, rel=0.05)
    assert parse_dtype("bpw:4").nbytes(2 * gb * 1e9) == pytest.approx(gb * GB)
    # One fp16 scale per 128 weights is 1/32 on top of the 4 bits.
    assert m.weight_bytes("int4") / m.weight_bytes("bpw:4") == pytest.approx(1 + 16 / 128 / 4)


def test_rtx_3090_catalog_entry_matches_the_seeds(catalog):
    hw = get_hardware("RTX-3090", catalog)
    assert (hw.memory_gib, hw.bandwidth_gb_s, hw.tflops["fp16"]) == (24, 936, 71)


def test_rtx_3090_holds_7b_int4_with_room_for_kv_but_not_27b_at_long_context(catalog):
    hw = get_hardware("rtx-3090", catalog)
    small = plan_memory(Deployment.make(preset("llama-2-7b"), hw, "int4"), MemorySettings(context=4096))
    assert small.fits and small.max_seqs >= 4
    big = Deployment.make(preset("gemma-3-27b"), hw, "int4")
    assert not plan_memory(big, MemorySettings(context=131072)).fits
    assert plan_memory(big, MemorySettings(context=4096)).fits     # it is the context that does not fit


# ---- KV and model descriptions -----------------------------------------------------------------

@pytest.mark.parametrize("name, kib", [("llama-2-7b", 512), ("llama-3-8b", 128)])
def test_kv_bytes_per_token(name, kib):
    assert preset(name).kv_bytes_per_token("fp16") == kib * 1024


def test_sliding_window_layers_hold_only_the_window():
    m = preset("gemma-3-27b")
    full = m.kv_bytes_per_token("bf16") * 100_000
    held = m.kv_bytes_for_context(100_000, "bf16")
    global_layers = m.layers - m.sliding_layers
    assert held == pytest.approx(full * global_layers / m.layers + m.kv_bytes_per_token("bf16")
                                 * m.sliding_window * m.sliding_layers / m.layers)
    assert m.kv_bytes_for_context(500, "bf16") == m.kv_bytes_per_token("bf16") * 500


def test_published_parameter_counts():
    expected = {"llama-2-7b": 6.74e9, "llama-3-8b": 8.03e9, "llama-3-70b": 70.6e9, "qwen2.5-7b": 7.62e9,
                "mistral-7b": 7.24e9, "mixtral-8x7b": 46.7e9, "smollm2-135m": 134.5e6}
    for name, n in expected.items():
        assert preset(name).total_params == pytest.approx(n, rel=0.01), name
    assert preset("mixtral-8x7b").active_params == pytest.approx(12.9e9, rel=0.01)


def test_gguf_description_matches_the_file(bundled_path):
    from gguf import GGUFReader
    reader = GGUFReader(bundled_path)
    m = spec_from_gguf_reader(reader, bundled_path)
    tensors = reader.tensors
    assert m.total_params == sum(int(t.n_elements) for t in tensors)
    assert (m.layers, m.hidden, m.heads, m.kv_heads, m.head_dim) == (30, 576, 9, 3, 64)
    assert m.tied_embeddings
    on_disk = sum(int(t.n_bytes) for t in tensors if len(t.shape) >= 2)
    assert m.weight_bytes(m.default_dtype) == pytest.approx(on_disk, rel=0.01)


def test_hf_config_description_matches_the_preset(tmp_path):
    cfg = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
           "max_position_embeddings": 8192, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = from_hf_config(str(tmp_path))
    p = preset("llama-3-8b")
    assert (m.total_params, m.kv_bytes_per_token("fp16"), m.default_dtype) == (p.total_params, p.kv_bytes_per_token("fp16"), "bf16")


def test_unknown_model_and_dtype_errors_name_the_choices():
    with pytest.raises(ValueError, match="Llama-2-7B"):
        preset("llama-9-1b")
    with pytest.raises(ValueError, match="int4-gN"):
        parse_dtype("int3")


# ---- roofline ----------------------------------------------------------------------------------

def test_fast_cost_model_agrees_with_the_roofline_formula():
    for name, tp in (("llama-3-70b", 4), ("mixtral-8x7b", 2), ("gemma-3-27b", 1)):
        hw = _hw(2000, interconnect_gb_s=300)
        dep = Deployment.make(preset(name), hw, "fp16", tp=tp, eff=Efficiency(0.7, 0.4, 0.001))
        fast = roofline.RooflineCost(dep)
        for computed, n, count in ((0, 700, 1), (3000, 1, 17), (5000, 300, 2)):
            s = fast.new_shape()
            s.add(computed, n, count)
            assert fast.step_time(s) == pytest.approx(roofline.step_time(dep, s).total_s, rel=1e-12)


def test_decode_turns_compute_bound_at_the_crossover_batch():
    dep = Deployment.make(preset("llama-3-8b"), _hw(1000, tflops={"fp16": 200.0}), "fp16")
    b = roofline.crossover_batch(dep, context=0)
    assert roofline.decode(dep, b, 0).bound == "compute"
    assert roofline.decode(dep, b - 1, 0).bound == "memory"
    # Longer contexts add KV reads per sequence: the crossover moves later or never comes.
    later = roofline.crossover_batch(dep, context=512)
    assert later is None or later > b


def test_moe_decode_reads_only_the_experts_it_uses():
    m = preset("mixtral-8x7b")
    one = m.weight_bytes_read("fp16", 1)
    assert one < m.weight_bytes("fp16") / 2
    assert m.weight_bytes_read("fp16", 1000) == pytest.approx(m.weight_bytes("fp16") - m.embedding_params * 2, rel=1e-6)


def test_tensor_parallel_splits_work_and_adds_communication():
    hw = _hw(2000, interconnect_gb_s=100, interconnect_latency_us=10)
    one = Deployment.make(preset("llama-3-70b"), hw, "fp16", eff=IDEAL)
    four = replace(one, tp=4)
    s1, s4 = roofline.decode(one, 8, 1000), roofline.decode(four, 8, 1000)
    assert s4.memory_s == pytest.approx(s1.memory_s / 4, rel=0.01)
    assert s4.comm_s == pytest.approx(2 * 80 * (1.5 * 8 * 8192 * 2 / 100e9 + 10e-6))


# ---- memory ------------------------------------------------------------------------------------

def test_max_sequences_is_the_kv_pool_over_kv_per_request():
    dep = Deployment.make(preset("llama-2-7b"), _hw(1000, memory_gib=40), "fp16")
    plan = plan_memory(dep, MemorySettings(context=2000, block_size=16))
    assert plan.kv_per_request == 2000 * 512 * 1024                    # 2000 is a whole number of blocks
    assert plan.kv_budget == pytest.approx(plan.usable - plan.weights - plan.activations - plan.overhead)
    assert plan.max_seqs == int(plan.kv_budget // plan.kv_per_request)


def test_tensor_parallel_options_hold_more_sequences_as_the_degree_grows():
    dep = Deployment.make(preset("llama-3-70b"), _hw(3350, interconnect_gb_s=450), "fp16")
    opts = tp_options(dep, MemorySettings(context=8192))
    assert [o.plan.tp for o in opts] == [1, 2, 4, 8]
    assert not opts[0].plan.fits and opts[-1].plan.fits
    seqs = [o.plan.max_seqs for o in opts]
    assert seqs == sorted(seqs) and seqs[-1] > seqs[1]


# ---- cost --------------------------------------------------------------------------------------

def test_owned_hardware_cost_per_hour_by_hand():
    hw = _hw(1000, price_usd=8760.0, tdp_w=500)
    c = hourly_cost(hw, CostAssumptions(years=2, usd_per_kwh=0.2, pue=1.5, extra_usd_per_hour=0.1), devices=2)
    # capex 8760 / (2 × 8760) = 0.5 $/h; power 0.5 kW × 1.5 × 0.2 = 0.15 $/h; extra 0.1; all × 2 devices.
    assert (c.capex, c.power, c.extra) == pytest.approx((1.0, 0.3, 0.2))
    assert c.total == pytest.approx(1.5)


def test_rented_hardware_cost_and_cost_per_million_by_hand():
    hw = _hw(1000, usd_per_hour=3.6)
    c = hourly_cost(hw, CostAssumptions(pricing="rent"))
    assert c.total == 3.6
    # 3.6 $/h at 1000 tok/s → 3.6M tokens per hour → $1 per million; at 50% utilization, $2.
    assert usd_per_million_tokens(c.total, 1000) == pytest.approx(1.0)
    assert usd_per_million_tokens(c.total, 1000, utilization=0.5) == pytest.approx(2.0)


def test_cost_without_prices_says_what_to_add():
    with pytest.raises(ValueError, match="usd_per_hour"):
        hourly_cost(_hw(1000), CostAssumptions())
    with pytest.raises(ValueError, match="utilization"):
        CostAssumptions(utilization=0)


def test_every_catalog_entry_has_a_source_and_the_required_numbers(catalog):
    for name in ("rtx-3090", "rtx-4090", "a100-40gb", "a100-80gb", "h100-sxm", "h200", "l40s", "mi300x",
                 "ascend-910b", "gaudi2", "gaudi3"):
        hw = catalog[name]
        assert hw.source and hw.memory_gib > 0 and hw.bandwidth_gb_s > 0 and hw.tdp_w
        assert hw.peak_flops("bf16") > 0
    assert len(PRESETS) >= 11
