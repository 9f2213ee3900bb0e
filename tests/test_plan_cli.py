"""`tokenfab plan ...` end to end: JSON output, plots, catalog files, errors."""
import json
import subprocess
import sys

import pytest

import tokenfab.cli
from tokenfab.cli import main


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    # The user's own ~/.config/tokenfab/hardware.yaml must not leak into the tests.
    monkeypatch.setenv("TOKENFAB_HARDWARE_FILE", str(tmp_path / "user-hardware.yaml"))
    # Only `plan` is registered, so another part's parser being mid-edit cannot fail these tests.
    monkeypatch.setattr(tokenfab.cli, "_COMMAND_MODULES", ["tokenfab.plan.cli"])


def _json(capsys, *argv) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _is_png(path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_roofline_json_reports_phases_and_crossover(capsys):
    r = _json(capsys, "roofline", "llama-2-7b", "--hardware", "rtx-3090", "--batch", "3", "--context", "512")
    assert r["prefill"]["bound"] == "compute" and r["prefill"]["ttft_s"] > 0
    batches = [d["batch"] for d in r["decode"]]
    assert 3 in batches and batches == sorted(batches)
    assert r["decode"][0]["bound"] == "memory"
    tok_s = [d["tok_s"] for d in r["decode"]]
    assert tok_s == sorted(tok_s)
    assert r["crossover_batch"]["0"] > 1


def test_memory_json_lists_tensor_parallel_options(capsys):
    r = _json(capsys, "memory", "llama-3-70b", "--hardware", "h100-sxm", "--context", "8192", "--weight-dtype", "bf16")
    assert not r["plan"]["fits"]
    fits = {o["tp"]: o["memory"]["fits"] for o in r["tp_options"]}
    assert fits[1] is False and fits[8] is True


def test_compare_json_gives_throughput_power_and_cost_for_each_hardware(capsys):
    r = _json(capsys, "compare", "llama-3-8b", "--hardware", "rtx-4090,h100-sxm,gaudi3",
              "--workload", "prompt=256,output=64", "--max-num-seqs", "32")
    rows = {row["hardware"]: row for row in r["rows"]}
    assert rows["h100-sxm"]["tok_s"] > rows["rtx-4090"]["tok_s"] > 0
    assert rows["h100-sxm"]["usd_per_m_output"] > 0 and rows["h100-sxm"]["tok_s_per_w"] > 0
    assert "cost_unavailable" in rows["gaudi3"]          # no price published: said, not invented
    assert r["assumptions"]["years"] == 3


def test_capacity_json_meets_the_slo_with_the_replicas_it_names(capsys):
    r = _json(capsys, "capacity", "llama-3-8b", "--hardware", "h100-sxm", "--rate", "40", "--num-requests", "300",
              "--slo", "ttft_p99:800,tpot_p99:60", "--prompt-len", "uniform:100:900", "--output-len", "exp:100")
    chosen = {e["replicas"]: e for e in r["evaluations"]}
    assert chosen[r["replicas"]]["meets_slo"]
    assert r["online"]["ttft"]["p99"] <= 0.8 and r["online"]["tpot"]["p99"] <= 0.06
    fewer = chosen.get(r["replicas"] - 1)
    assert r["replicas"] == 1 or (fewer is not None and not fewer["meets_slo"])
    assert r["cost"]["usd_per_m_output"] > 0


def test_capacity_with_offline_share_reports_separate_pools(capsys):
    r = _json(capsys, "capacity", "llama-3-8b", "--hardware", "rtx-4090", "--rate", "6", "--num-requests", "200",
              "--offline-share", "0.5", "--slo", "ttft_p99:3000,tpot_p99:200", "--output-len", "64")
    assert r["scheduler"]["policy"] == "priority"
    sp = r["separate_pools"]
    assert sp["combined"] == r["replicas"] and sp["total"] == sp["online_replicas"] + sp["offline_replicas"]


@pytest.mark.parametrize("argv", [
    ["roofline", "llama-3-8b", "--hardware", "a100-80gb"],
    ["memory", "llama-3-70b", "--hardware", "h100-sxm"],
    ["compare", "llama-3-8b", "--hardware", "rtx-3090,l40s", "--workload", "prompt=128,output=32,batch=8"],
    ["capacity", "llama-3-8b", "--hardware", "h100-sxm", "--rate", "5", "--num-requests", "100"],
])
def test_plot_writes_a_png(tmp_path, capsys, argv):
    path = tmp_path / "out.png"
    assert main(["plan", *argv, "--plot", str(path)]) == 0
    assert _is_png(path)
    assert "plot written" in capsys.readouterr().out


def test_hardware_file_adds_and_overrides_entries(tmp_path, capsys):
    f = tmp_path / "mine.yaml"
    f.write_text("my-box:\n  memory_gib: 48\n  bandwidth_gb_s: 500\n  tflops: {fp16: 100}\n  source: test\n"
                 "rtx-3090:\n  memory_gib: 24\n  bandwidth_gb_s: 1\n  tflops: {fp16: 71}\n  source: slowed\n")
    r = _json(capsys, "roofline", "llama-2-7b", "--hardware", "my-box", "--hardware-file", str(f))
    assert r["bandwidth"] == 500e9
    slow = _json(capsys, "roofline", "llama-2-7b", "--hardware", "rtx-3090", "--hardware-file", str(f))
    assert slow["bandwidth"] == 1e9
    names = [e["name"] for e in _json(capsys, "hardware", "--hardware-file", str(f))["entries"]]
    assert "my-box" in names and "h100-sxm" in names


def test_default_model_is_the_bundled_gguf(capsys):
    r = _json(capsys, "memory", "--hardware", "rtx-3090", "--context", "2048")
    assert r["model"]["source"].endswith(".gguf") and r["model"]["layers"] == 30


def test_models_lists_presets(capsys):
    names = [m["name"] for m in _json(capsys, "models")["presets"]]
    assert {"Llama-2-7B", "Mixtral-8x7B", "Qwen2.5-72B", "SmolLM2-135M"} <= set(names)


def test_probe_dry_run_measures_without_writing(tmp_path, capsys):
    r = _json(capsys, "probe", "--dry-run", "--buffer-mib", "8", "--seconds", "0.02")
    assert r["written"] is None and r["entry"]["bandwidth_gb_s"] > 0
    assert not (tmp_path / "user-hardware.yaml").exists()


@pytest.mark.parametrize("argv, message", [
    (["roofline", "llama-2-7b", "--hardware", "tpu-v9"], "unknown hardware"),
    (["capacity", "llama-2-7b", "--hardware", "h100-sxm", "--rate", "1", "--slo", "ttft:5"], "bad SLO"),
    (["capacity", "llama-2-7b", "--hardware", "h100-sxm", "--rate", "1", "--prompt-len", "gauss:5"], "length distribution"),
    (["memory", "llama-2-7b", "--hardware", "h100-sxm", "--weight-dtype", "int3"], "unknown dtype"),
])
def test_user_mistakes_exit_2_with_a_message(capsys, argv, message):
    assert main(["plan", *argv]) == 2
    assert message in capsys.readouterr().err


def test_registering_the_plan_parser_does_not_import_torch():
    code = ("import sys, argparse; import tokenfab.plan.cli as c; p = argparse.ArgumentParser(); "
            "c.add_parser(p.add_subparsers()); assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
