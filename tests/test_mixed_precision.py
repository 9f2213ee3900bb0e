"""`tokenfab quant --max-kl`: automatic mixed precision meets its KL budget on the calibration text, measured
again from the written folder, with fewer bytes than all-int8; the greedy choice raises the linears with
the most KL per byte first."""
import contextlib
import io
import json
import os

import pytest

from tests.oracle import make_tiny_model
from tokenfab.cli import main
from tokenfab.quant.mixed import FLOAT, choose_formats, format_order

pytestmark = pytest.mark.usefixtures("one_thread")

BUDGET = 0.01           # on the tiny model: all-int4 measures ~0.22, all-int8 ~0.0016 (seed 0)
CALIB_TOKENS = 128


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, bundled_tokenizer):
    """A tiny random-weight Llama and a calibration text (the end of the bundled text) of one window."""
    from tokenfab.quant.text import load_eval_text
    d = tmp_path_factory.mktemp("mixed")
    make_tiny_model("llama", str(d / "model"), bundled_tokenizer)
    (d / "calib.txt").write_text(load_eval_text()[-3000:])
    return str(d / "model"), str(d / "calib.txt")


def _run(argv) -> tuple[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(argv)
    return rc, buf.getvalue()


@pytest.fixture(scope="module")
def mixed(tiny, tmp_path_factory):
    model, calib = tiny
    out = str(tmp_path_factory.mktemp("mixed-out") / "q")
    rc, text = _run(["quant", model, "--max-kl", str(BUDGET), "--calib", calib, "--calib-tokens", str(CALIB_TOKENS),
                     "--out", out, "--json"])
    assert rc == 0
    return out, json.loads(text)


def test_mixed_precision_meets_its_kl_budget_with_fewer_bytes_than_all_int8(mixed):
    _, info = mixed
    m = info["mixed"]
    assert 0 < m["measured_kl"] <= BUDGET
    assert m["bytes"] < m["bytes_by_format"]["int8"] and info["weight_bytes_after"] == m["bytes"]
    # a real mix: some linears at int4, some raised above it
    assert m["counts"].get("int4-g32", 0) > 0 and sum(m["counts"].values()) > m["counts"]["int4-g32"]


def test_written_mixed_folder_measures_within_budget_on_the_calibration_text(tiny, mixed):
    """The KL is measured again by `quant eval` from the folder on disk, not taken from the plan."""
    from tokenfab.quant.checkpoint import read_quant_config
    from tokenfab.quant.compare import evaluate
    model, calib = tiny
    out, info = mixed
    layers = read_quant_config(out)["layers"]
    assert len(layers) == info["quantized_linears"] == len(info["mixed"]["formats"]) - len(info["kept_float"])
    res = evaluate(model, out, text=calib, ctx=CALIB_TOKENS, max_windows=1)
    assert res.report.tokens == CALIB_TOKENS - 1
    assert res.report.kl_mean == pytest.approx(info["mixed"]["measured_kl"], rel=1e-3)
    assert res.report.kl_mean <= BUDGET


def test_mixed_folder_serves_in_the_engine(mixed):
    from tokenfab import LLM, SamplingParams
    out, _ = mixed
    llm = LLM(model=out, max_model_len=128, num_kv_blocks=32)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    assert len(llm.generate([[5, 17, 300]], params)[0].outputs[0].token_ids) == 5
    assert llm.engine.block_manager.num_used_blocks() == 0


def test_greedy_raises_the_most_kl_per_byte_first():
    formats = format_order("int4-g32")
    assert formats == ["int4-g32", "int8", FLOAT]
    kl = {"a": {"int4-g32": 0.05, "int8": 0.001, FLOAT: 0.0},     # sensitive and small: raised first
          "b": {"int4-g32": 0.05, "int8": 0.001, FLOAT: 0.0},     # as sensitive, 4x the bytes
          "c": {"int4-g32": 0.001, "int8": 0.0001, FLOAT: 0.0}}   # insensitive: stays int4
    nbytes = {"a": {"int4-g32": 10, "int8": 20, FLOAT: 80},
              "b": {"int4-g32": 40, "int8": 80, FLOAT: 320},
              "c": {"int4-g32": 10, "int8": 20, FLOAT: 80}}
    assert choose_formats(kl, nbytes, formats, 0.06) == {"a": "int8", "b": "int4-g32", "c": "int4-g32"}
    assert choose_formats(kl, nbytes, formats, 0.01) == {"a": "int8", "b": "int8", "c": "int4-g32"}
    assert choose_formats(kl, nbytes, formats, 1.0) == {n: "int4-g32" for n in kl}
    assert set(choose_formats(kl, nbytes, formats, 1e-9).values()) == {FLOAT}


def test_awq_is_not_a_mixed_precision_format():
    with pytest.raises(ValueError, match="round-to-nearest"):
        format_order("awq-int4-g128")


@pytest.mark.parametrize("argv, says", [
    (["quant", "--max-kl", "0", "--out", "x"], "--max-kl must be a positive KL"),
    (["quant", "--max-kl", "-0.5", "--out", "x"], "--max-kl must be a positive KL"),
    (["quant", "--max-kl", "0.01"], "--out DIR"),
    (["quant", "--max-kl", "0.01", "--keep-float", "lm_head", "--out", "x"], "--keep-float does not apply"),
    (["quant", "/no/such/model", "--max-kl", "0.01", "--out", "x"], "no such file or folder"),
])
def test_max_kl_mistakes_exit_2_with_one_line(argv, says, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err


def test_a_budget_no_mix_meets_says_so(tiny, tmp_path, capsys):
    """A KL budget below float rounding noise keeps every linear float: refused, nothing written."""
    model, calib = tiny
    out = str(tmp_path / "q")
    assert main(["quant", model, "--scheme", "int8", "--max-kl", "1e-30", "--calib", calib, "--calib-tokens", "32",
                 "--out", out]) == 2
    assert "raise --max-kl" in capsys.readouterr().err and not os.path.exists(os.path.join(out, "model.safetensors"))
