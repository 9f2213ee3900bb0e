"""`tokenfab quant` and `tokenfab quant eval` from the command line: exit codes, JSON, plot, errors."""
import json
import os

import pytest

from tokenfab.cli import main


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def reuse_bundled_files(monkeypatch, bundled_files):
    """The commands read the bundled model once per test session instead of once per command."""
    import tokenfab.model.loader as loader
    real = loader.load_model_files

    def load(model):
        return bundled_files if model is None else real(model)
    monkeypatch.setattr(loader, "load_model_files", load)


def _json(capsys):
    return json.loads(capsys.readouterr().out)


def test_eval_prints_parsable_json_with_every_metric_and_writes_the_plot(reuse_bundled_files, capsys, tmp_path):
    png = tmp_path / "kl.png"
    rc = main(["quant", "eval", "--candidate", "int4-g32", "--ctx", "64", "--max-windows", "2", "--json",
               "--plot", str(png)])
    assert rc == 0
    d = _json(capsys)
    assert d["candidate"] == "int4-g32" and d["windows"] == 2 and d["tokens"] == 2 * 63
    for key in ("kl_mean", "kl_stderr", "kl_median", "kl_p99", "kl_max", "same_top1_pct", "dp_mean", "dp_rms",
                "ppl_base", "ppl_cand", "ppl_ratio"):
        assert isinstance(d[key], float), key
    assert 0 < d["kl_mean"] <= d["kl_max"] and d["kl_median"] <= d["kl_p99"] <= d["kl_max"]
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def test_eval_sensitivity_table_has_one_row_per_group(reuse_bundled_files, capsys):
    rc = main(["quant", "eval", "--candidate", "int8", "--ctx", "32", "--max-windows", "1", "--sensitivity",
               "--sensitivity-by", "kind", "--json"])
    assert rc == 0
    rows = _json(capsys)["sensitivity"]["rows"]
    assert sorted(r["name"] for r in rows) == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    assert [r["kl_mean"] for r in rows] == sorted((r["kl_mean"] for r in rows), reverse=True)


def test_eval_table_output_names_the_metrics(reuse_bundled_files, capsys):
    assert main(["quant", "eval", "--candidate", "gguf", "--kernel", "packed", "--ctx", "32", "--max-windows", "1"]) == 0
    out = capsys.readouterr().out
    assert "mean KL" in out and "same top-1" in out and "PPL ratio" in out and "packed kernels" in out


def test_quant_writes_a_checkpoint_folder_and_reports_json(reuse_bundled_files, capsys, tmp_path):
    out = tmp_path / "ckpt"
    rc = main(["quant", "--scheme", "awq-int4-g128", "--calib-tokens", "64", "--keep-float", "lm_head,layers.0",
               "--out", str(out), "--json"])
    assert rc == 0
    d = _json(capsys)
    assert d["scheme"] == "awq-int4-g128" and d["calib_tokens"] == 64
    assert d["quantized_linears"] == 29 * 4 and "layers.0.mlp.down_proj" in d["kept_float"]
    assert d["weight_bytes_after"] < d["weight_bytes_before"] / 4
    names = set(os.listdir(out))
    assert {"model.safetensors", "quant_config.json", "config.json", "tokenizer.json"} <= names
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"


@pytest.mark.parametrize("argv, says", [
    (["quant", "--scheme", "int9", "--out", "x"], "unknown quantization scheme 'int9'"),
    (["quant", "--out", "x"], "needs --scheme"),
    (["quant", "--scheme", "int8", "--candidate", "int8", "--out", "x"], "--candidate belong(s) to `tokenfab quant eval`"),
    (["quant", "eval", "--scheme", "int8"], "--scheme belong(s) to"),
    (["quant", "eval"], "eval needs --candidate"),
    (["quant", "eval", "--candidate", "no-such-thing"], "not a scheme"),
    (["quant", "eval", "--candidate", "int8", "--ctx", "1"], "--ctx must be at least 2"),
])
def test_user_mistakes_exit_2_with_one_line(argv, says, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err


def test_quant_refuses_to_write_into_a_folder_with_other_files(tmp_path, capsys):
    (tmp_path / "weights.safetensors").write_bytes(b"x")
    assert main(["quant", "--scheme", "int8", "--out", str(tmp_path)]) == 2
    assert "not empty" in capsys.readouterr().err


def test_info_shows_about_twice_the_bf16_tokens_per_gib_for_the_int8_kv_cache(reuse_bundled_files, capsys):
    assert main(["info", "--json"]) == 0
    per_gib = _json(capsys)["kv_tokens_per_gib"]
    assert 1.8 < per_gib["int8"] / per_gib["bfloat16"] <= 2.0
