"""What a new user stumbled on, fixed: each check is one of issue 17's list."""
import io
import subprocess
import sys

import pytest

from tokenfab import engine_cli
from tokenfab.cli import main


def test_python_dash_m_tokenfab_runs_the_cli():
    out = subprocess.run([sys.executable, "-m", "tokenfab", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("tokenfab ")


def test_make_run_calls_the_cli_through_the_given_python():
    out = subprocess.run(["make", "-n", "run", "PY=/opt/venv/bin/python"], capture_output=True, text=True,
                         cwd=__file__.rsplit("/tests/", 1)[0])
    if out.returncode != 0 and "not found" in out.stderr:
        pytest.skip("make is not installed")
    assert "/opt/venv/bin/python -m tokenfab serve" in out.stdout


@pytest.mark.parametrize("argv", [["generate", ""], ["generate", "--chat", ""], ["generate", "--chat", "   "]])
def test_generate_refuses_an_empty_prompt_before_loading_the_model(argv, monkeypatch, capsys):
    def no_load(args):
        raise AssertionError("the model was loaded for an empty prompt")
    monkeypatch.setattr(engine_cli, "_engine", no_load)
    assert main(argv) == 2
    assert "tokenfab generate: error: the prompt is empty" in capsys.readouterr().err


def test_model_is_named_by_its_file_not_gguf_general_name(bundled_path):
    from tokenfab.files.bundled import model_display_name
    assert model_display_name(bundled_path) == "SmolLM2-135M-Instruct"
    assert model_display_name("/models/My-Model.Q8_0.gguf") == "My-Model.Q8_0"
    assert model_display_name("/models/qwen2-folder/") == "qwen2-folder"


def test_info_shows_the_file_name_and_keeps_general_name_apart(capsys):
    import json
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["name"] == "SmolLM2-135M-Instruct"
    assert info["gguf_general_name"] == "Smollm2 135M 8k Lc100K Mix1 Ep2"


def _help(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    return capsys.readouterr().out


def test_quant_eval_help_is_evals_own(capsys):
    text = _help(["quant", "eval", "--help"], capsys)
    assert text.startswith("usage: tokenfab quant eval") and "--candidate" in text
    assert "--scheme" not in text and "--out DIR" not in text
    assert "--scheme" in _help(["quant", "--help"], capsys)


def test_quantization_help_names_every_accepted_value(capsys):
    from tokenfab.quant.load import QUANTIZATIONS
    text = " ".join(_help(["serve", "--help"], capsys).split())
    start = text.index("--quantization QUANTIZATION, -q QUANTIZATION")
    entry = text[start:text.index("--scheduling-policy", start)]
    for q in QUANTIZATIONS:
        assert f" {q}" in entry, q


def test_bench_serve_help_states_each_default_once(capsys):
    text = " ".join(_help(["bench", "serve", "--help"], capsys).split())
    assert "(default: None)" not in text
    assert "$OPENAI_API_KEY if set)" in text and "if set) (default" not in text


def test_errors_name_the_subcommand_that_failed(capsys):
    assert main(["plan", "roofline", "--hardware", "no-such-gpu"]) == 2
    assert capsys.readouterr().err.startswith("tokenfab plan roofline: error: unknown hardware")


def test_plan_roofline_table_fits_80_columns(monkeypatch, capsys):
    from rich.console import Console

    from tokenfab.plan import render
    buf = io.StringIO()
    monkeypatch.setattr(render, "console", Console(file=buf, width=80, color_system=None))
    assert main(["plan", "roofline", "--hardware", "rtx-3090", "llama-2-7b"]) == 0
    lines = buf.getvalue().splitlines()
    assert max(map(len, lines)) <= 80
    rows = [line for line in lines if "decode b=" in line]
    assert len(rows) == 9 and all("tok/s" in line for line in rows)      # one line per row: nothing wrapped
