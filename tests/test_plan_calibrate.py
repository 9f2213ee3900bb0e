"""Calibration: the efficiency fit on synthetic timings, measured step tables, probe, and the engine run."""
import random
from dataclasses import replace

import numpy as np
import pytest

from tokenfab.costmodel.measured import MeasuredStepCost, choose_knots, shape_row
from tokenfab.plan import roofline
from tokenfab.plan.calibrate import Timing, fit_efficiency
from tokenfab.plan.hardware import Hardware, read_hardware_file, save_entry
from tokenfab.plan.models import preset
from tokenfab.plan.roofline import Deployment, Efficiency, RooflineCost
from tokenfab.plan.simulate import SchedulerConfig, simulate
from tokenfab.plan.workload import make_requests, parse_length

HW = Hardware(name="cpu-like", memory_gib=16, bandwidth_gb_s=20, tflops={"fp32": 0.2})
BASE = Deployment.make(preset("smollm2-135m"), HW, "fp32", act_dtype="fp32")
TIMINGS = ([Timing("prefill", p, 1, 0, 0.0) for p in (16, 64, 256, 512)]
           + [Timing("decode", 32, b, 56, 0.0) for b in (1, 2, 4, 8)])


def _synthetic(eff: Efficiency, noise: float = 0.0, seed: int = 0):
    rng = random.Random(seed)
    true = replace(BASE, eff=eff)
    shapes = [t.shape() for t in TIMINGS]
    return shapes, [roofline.step_time(true, s).total_s * (1 + rng.uniform(-noise, noise)) for s in shapes]


@pytest.mark.parametrize("eff", [Efficiency(0.6, 0.3, 0.002), Efficiency(0.9, 0.05, 0.0),
                                 Efficiency(0.2, 0.8, 0.01)])
def test_fit_recovers_the_efficiencies_that_made_the_timings(eff):
    shapes, times = _synthetic(eff)
    fit = fit_efficiency(BASE, shapes, times)
    assert fit.bandwidth == pytest.approx(eff.bandwidth, rel=1e-3)
    assert fit.compute == pytest.approx(eff.compute, rel=1e-3)
    assert fit.overhead_s == pytest.approx(eff.step_overhead_s, abs=1e-5)
    assert fit.mean_abs_rel_error < 1e-6


def test_fit_on_noisy_timings_predicts_within_the_noise():
    shapes, times = _synthetic(Efficiency(0.5, 0.25, 0.003), noise=0.03, seed=4)
    fit = fit_efficiency(BASE, shapes, times)
    assert fit.mean_abs_rel_error < 0.03
    assert fit.bound[:4] == ["compute"] * 4 and fit.bound[-1] == "memory"


def test_fit_needs_enough_positive_timings():
    shapes, times = _synthetic(Efficiency())
    with pytest.raises(ValueError, match="at least 3"):
        fit_efficiency(BASE, shapes[:2], times[:2])
    with pytest.raises(ValueError, match="positive"):
        fit_efficiency(BASE, shapes, [0.0] + times[1:])


def test_measured_step_table_replaces_the_roofline_in_the_simulator():
    # Rows measured from a linear "engine"; the fitted table must reproduce it and drive the simulator.
    truth = lambda tok, seqs, kv: 0.002 + 1e-5 * tok + 2e-5 * seqs + 3e-8 * kv  # noqa: E731
    rows = []
    for computed, n, count in ((0, 128, 1), (0, 512, 1), (0, 64, 4), (100, 1, 1), (500, 1, 8), (2000, 1, 32)):
        r = shape_row(computed, n, count, 0.0)
        r["step_s"] = truth(r["num_tokens"], r["num_seqs"], r["kv_tokens"])
        rows.append(r)
    table = MeasuredStepCost.fit(rows)
    assert table.mean_abs_rel_error < 1e-6
    s = table.new_shape()
    s.add(300, 1, 10)
    assert table.step_time(s) == pytest.approx(truth(10, 10, 3010), rel=1e-6)
    reqs = make_requests(5.0, 50, parse_length("200"), parse_length("20"), seed=1)
    assert len(simulate(table, reqs, SchedulerConfig()).requests) == 50


def test_step_table_follows_a_regime_switch_that_one_line_cannot():
    # An engine like tokenfab on CPU: up to 8 rows a decode kernel costing 8 ms a row, above that a
    # GEMM with a higher floor and a shallower slope. Rows per token count as a server logs them.
    truth = lambda tok: 0.010 + 0.008 * tok if tok <= 8 else 0.060 + 0.0027 * tok  # noqa: E731
    rows = []
    for tok in [1] * 40 + [2] * 30 + list(range(3, 9)) * 10 + list(range(9, 40)) * 3 + [64, 128, 200, 300] * 4:
        r = shape_row(100, 1, tok, 0.0)
        r["step_s"] = truth(tok)
        rows.append(r)
    table = MeasuredStepCost.fit(rows)
    assert table.mean_abs_rel_error < 0.01
    for tok in (1, 4, 8, 12, 100, 250):
        s = table.new_shape()
        s.add(100, 1, tok)
        assert table.step_time(s) == pytest.approx(truth(tok), rel=0.03)
    s = table.new_shape()
    s.add(100, 1, 600)                                # beyond the last knot: the last segment's slope
    assert table.step_time(s) == pytest.approx(truth(600), rel=0.03)


def test_step_table_knots_thin_out_to_a_line_on_sparse_rows():
    assert choose_knots(np.array([1.0, 8, 32, 128, 512])) == [1.0, 512.0]
    assert choose_knots(np.array([16.0] * 5)) == [16.0]
    knots = choose_knots(np.array([1.0] * 10 + [2.0] * 10 + [100.0] * 10))
    assert knots == [1.0, 2.0, 100.0]
    # a table whose costs fall with the token count never extrapolates below zero
    rows = [{"num_tokens": n, "num_seqs": 1, "attn_pairs": 0, "kv_tokens": 0, "step_s": 1.0 / n} for n in (1, 2, 4, 8) * 3]
    table = MeasuredStepCost.fit(rows)
    s = table.new_shape()
    s.num_tokens, s.num_seqs = 1000, 1
    assert table.step_time(s) > 0


def test_step_table_rows_must_carry_the_features():
    with pytest.raises(ValueError, match="kv_tokens"):
        MeasuredStepCost.fit([{"num_tokens": 1, "num_seqs": 1, "attn_pairs": 1, "step_s": 0.1}] * 3)


def test_probe_writes_an_entry_the_catalog_can_read(tmp_path):
    pytest.importorskip("torch")
    from tokenfab.plan.probe import ProbeSettings, probe
    entry = probe(ProbeSettings(buffer_mib=8, matmul_n=128, seconds_per_test=0.02, dtypes=("fp32",)))
    assert entry["bandwidth_gb_s"] > 0 and entry["tflops"]["fp32"] > 0
    path = save_entry(tmp_path / "hw.yaml", "local-cpu", entry)
    hw = read_hardware_file(path)["local-cpu"]
    assert hw.kind == "cpu" and hw.peak_flops("fp32") == pytest.approx(entry["tflops"]["fp32"] * 1e12)


def test_calibrated_entry_changes_the_cost_model(tmp_path):
    entry = {**HW.to_entry(), "efficiency": {"bandwidth": 0.4, "compute": 0.2}, "step_overhead_ms": 5.0}
    hw = read_hardware_file(save_entry(tmp_path / "hw.yaml", "cpu-like", entry))["cpu-like"]
    eff = Efficiency.resolve(hw)
    assert (eff.bandwidth, eff.compute, eff.step_overhead_s, eff.source) == (0.4, 0.2, 0.005, "calibrated")
    assert Efficiency.resolve(hw, bandwidth=0.9).bandwidth == 0.9          # a flag still wins
    slow = RooflineCost(Deployment.make(BASE.model, hw, "fp32", act_dtype="fp32"))
    fast = RooflineCost(BASE)
    s = slow.new_shape()
    s.add(100, 1, 4)
    assert slow.step_time(s) > fast.step_time(s)


@pytest.mark.slow
def test_calibrate_against_the_engine_fits_its_timings(tmp_path, bundled_path):
    pytest.importorskip("tokenfab.llm")
    import argparse

    from tokenfab.plan.commands import run_calibrate
    hw_file = tmp_path / "hw.yaml"
    save_entry(hw_file, "local-cpu", {"kind": "cpu", "memory_gib": 8, "bandwidth_gb_s": 10, "tflops": {"fp32": 0.05}})
    args = argparse.Namespace(
        model=bundled_path, hardware=None, device="cpu", engine_dtype="fp32", prompt_lens=[16, 32, 64],
        batches=[1, 2], decode_tokens=[2, 5], repeats=1, max_num_batched_tokens=64, validate_batch=2,
        validate_output=3,
        no_validate=False, name=None, output=str(hw_file), save_table=str(tmp_path / "steps.yaml"), dry_run=False,
        hardware_file=[str(hw_file)], weight_dtype=None, kv_dtype=None, act_dtype=None)
    out = run_calibrate(args)
    assert len(out["rows"]) == 5 and all(r["step_s"] > 0 for r in out["rows"])
    # how well the roofline fits this machine's steps is a measurement (tokenfab plan calibrate prints it)
    assert 0 <= out["fit"]["mean_abs_rel_error"] < float("inf")
    written = read_hardware_file(hw_file)["local-cpu"]
    assert written.efficiency["bandwidth"] == pytest.approx(out["fit"]["bandwidth_efficiency"], rel=1e-3)
    assert MeasuredStepCost.from_file(tmp_path / "steps.yaml").rows == 5
    assert out["validation"]["measured_s"] > 0
