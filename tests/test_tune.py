"""`tokenfab tune` on the bundled model with a tiny budget, and the pieces it stands on.

One tune run with loose targets (module fixture) serves most tests: it must choose a measured point,
write a serve config that serve's own `--config` path loads, and pass validation. The space is one
build (the engine's defaults: GGUF blocks, auto KV, all cores, no speculation) at two sequence caps,
so one measurement calibrates the planner's prediction of the other.
"""
from __future__ import annotations

import json
import os

import pytest

from tokenfab.cli import main

WORKLOAD = "--dataset random --num-prompts 4 --input-len 24 --output-len 5 --request-rate 8"


def _space() -> list[str]:
    return ["--weights", "gguf", "--kv-cache-dtypes", "auto", "--threads", str(os.cpu_count() or 1),
            "--max-num-seqs", "64,4", "--max-num-batched-tokens", "2048", "--chunked-prefill", "on",
            "--speculative", "off", "--no-progress", "--workload", WORKLOAD]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    out = tmp_path_factory.mktemp("tune")
    import contextlib
    import io
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["tune", "--p99-ttft-ms", "60000", "--p99-tpot-ms", "20000", "--budget", "240",
                   "--out-dir", str(out), *_space()])
    return rc, out, err.getvalue()


def _summary(out) -> dict:
    return json.loads((out / "summary.json").read_text())


def _measured_lines(out) -> list[dict]:
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "measured"]


def test_tune_meets_loose_targets_with_a_measured_point_and_validates_it(tuned):
    rc, out, err = tuned
    assert rc == 0, err
    s = _summary(out)
    assert s["chosen"]["source"] == "measured" and s["chosen"]["meets"]
    assert s["chosen"]["metrics"]["p99_ttft_ms"] <= 60000 and s["chosen"]["metrics"]["failed"] == 0
    assert len(s["validation"]) == 3 and all(v["ok"] for v in s["validation"])
    assert "validated: 3 consecutive runs" in err
    assert {p["source"] for p in s["points"]} <= {"measured", "predicted"}
    assert (out / "tune.png").stat().st_size > 10_000


def test_the_written_config_loads_through_serves_own_config_path(tuned):
    from tokenfab.cli import _apply_config_file, build_parser
    from tokenfab.engine_args import engine_config_from_args
    _, out, _ = tuned
    chosen = _summary(out)["chosen"]["point"]
    parser = build_parser()
    argv = ["serve", "--config", str(out / "serve.yaml")]
    args = _apply_config_file(parser, argv, parser.parse_args(argv))
    config = engine_config_from_args(args)
    assert (config.quantization, config.max_num_seqs, config.num_threads) == \
        (chosen["weights"], chosen["max_num_seqs"], chosen["num_threads"])
    assert args.config is None and args.config_file == str(out / "serve.yaml")   # not read as a Ray config


def test_resume_measures_no_point_twice(tuned, tmp_path):
    import shutil
    _, out, _ = tuned
    again = tmp_path / "again"
    shutil.copytree(out, again)
    before = _measured_lines(again)
    assert main(["tune", "--p99-ttft-ms", "60000", "--p99-tpot-ms", "20000", "--budget", "240",
                 "--out-dir", str(again), "--validation-runs", "0", *_space()]) == 0
    s = _summary(again)
    assert s["measured_now"] == 0 and s["resumed"] == len(before) >= 1
    assert _measured_lines(again) == before


def test_an_impossible_target_exits_nonzero_naming_it_and_the_distance(tuned, tmp_path, capsys):
    """On the fixture's measurements (a results file resumed under new targets: its runs keep their
    requests, so every metric is computed again for these targets)."""
    import shutil
    shutil.copytree(tuned[1], tmp_path, dirs_exist_ok=True)
    (tmp_path / "serve.yaml").unlink()
    rc = main(["tune", "--p99-ttft-ms", "0.001", "--budget", "240", "--out-dir", str(tmp_path), *_space()])
    err = capsys.readouterr().err
    assert rc == 1
    assert "no configuration meets the targets" in err
    line = next(line for line in err.splitlines() if "P99 TTFT" in line and "target: at most 0.001 ms" in line)
    assert "over" in line and "x the target" in line
    assert not (tmp_path / "serve.yaml").exists()


def test_prediction_of_the_measured_points_own_settings_gives_back_its_measurement(tuned):
    from tokenfab.tune.measure import run_metrics
    from tokenfab.tune.predict import predict
    from tokenfab.tune.space import Point
    _, out, _ = tuned
    row = _measured_lines(out)[0]
    point = Point.from_dict(row["point"])
    slos = {"ttft": 60000.0, "tpot": 20000.0}
    measured = run_metrics(row["run"], slos)
    got = predict(point, measured, str(out / "bench" / row["bench"]), str(out / "steps" / row["step_log"]),
                  [point], slos)[point]
    assert got["p99_ttft_ms"] == pytest.approx(measured["p99_ttft_ms"], rel=1e-6)
    assert got["p99_tpot_ms"] == pytest.approx(measured["p99_tpot_ms"], rel=1e-6)


# -- no server ------------------------------------------------------------------------------------
def test_targets_say_which_fails_and_by_how_much():
    from tokenfab.tune.targets import Targets
    t = Targets(p99_ttft_ms=100, p99_tpot_ms=50, min_top1=95)
    ttft, tpot = t.speed_checks({"p99_ttft_ms": 250.0, "p99_tpot_ms": 40.0, "failed": 0})
    assert not ttft.ok and ttft.excess == pytest.approx(1.5) and "150 ms over, 2.5x the target" in ttft.describe()
    assert tpot.ok
    (top1,) = t.quality_checks({"kl_mean": 0.1, "same_top1_pct": 90.0})
    assert not top1.ok and "5 % short" in top1.describe()
    with pytest.raises(ValueError, match="at least one latency target"):
        Targets(max_kl=0.01).validate()


def test_results_file_refuses_another_workload(tmp_path):
    from tokenfab.tune.results import Results
    Results(tmp_path / "r.jsonl", {"model": None, "workload": ["--num-prompts", "5"]})
    with pytest.raises(ValueError, match="another --out-dir"):
        Results(tmp_path / "r.jsonl", {"model": None, "workload": ["--num-prompts", "6"]})


@pytest.mark.parametrize("text, says", [
    ("max_num_seq: 3\n", "'max_num_seq' is not a serve flag; did you mean max_num_seqs"),
    ("max-num-seqs: 0\n", "must be a positive integer"),
    ("kv_cache_dtype: int9\n", "invalid choice"),
    ("enable_chunked_prefill: 3\n", "must be true or false"),
    ("- 1\n- 2\n", "expected a mapping of serve flags"),
])
def test_a_bad_serve_config_file_is_refused_with_a_message(tmp_path, capsys, text, says):
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    assert main(["serve", "--port", "0", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"--config {path}" in err and says in err


def test_command_line_flags_win_over_the_config_file(tmp_path):
    from tokenfab.cli import _apply_config_file, build_parser
    path = tmp_path / "serve.json"
    path.write_text(json.dumps({"max-num-seqs": 8, "num_threads": 1, "enable_chunked_prefill": False,
                                "kv_cache_memory_bytes": "64MiB", "port": 9001, "ui": False,
                                "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}))
    parser = build_parser()
    argv = ["serve", "--config", str(path), "--max-num-seqs", "3"]
    a = _apply_config_file(parser, argv, parser.parse_args(argv))
    assert (a.max_num_seqs, a.num_threads, a.enable_chunked_prefill, a.kv_cache_memory_bytes, a.port, a.ui) == \
        (3, 1, False, 64 << 20, 9001, False)
    assert a.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}


def test_a_workload_that_sets_what_tune_owns_is_refused():
    from tokenfab.tune.workload import parse_workload
    with pytest.raises(ValueError, match="--sweep"):
        parse_workload("--dataset random --sweep 1,2", {"ttft": 100.0})
    with pytest.raises(ValueError, match="--num-prompts"):
        parse_workload("--num-prompts many", {"ttft": 100.0})
