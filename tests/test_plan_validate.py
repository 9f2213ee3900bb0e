"""The simulator against measured runs: the server's step log, and `plan validate` on a bench result."""
import json

import numpy as np
import pytest

from tests.oracle import make_tiny_model
from tokenfab import LLM, SamplingParams
from tokenfab.cli import main
from tokenfab.costmodel.measured import MeasuredStepCost, NoisyStepCost, StepLog, read_rows, shape_row
from tokenfab.plan.simulate import SchedulerConfig
from tokenfab.plan.simulate import simulate
from tokenfab.plan.validate import load_bench_run, validate
from tokenfab.plan.workload import make_requests, parse_length


def test_step_log_counts_the_loop_between_busy_steps_and_reads_back(tmp_path):
    path = tmp_path / "steps.jsonl"
    log = StepLog(path)
    log([(0, 20)], 10.0, 10.3, True)             # a 20-token prefill, requests left: runs to the next start
    log([(20, 1)], 10.4, 10.45, True)
    log([(21, 1), (0, 5)], 10.5, 10.6, False)    # the last step before idling: its own duration
    log.close()
    rows = read_rows(path)
    assert [r["num_tokens"] for r in rows] == [20, 1, 6]
    assert [r["num_seqs"] for r in rows] == [1, 1, 2]
    assert [r["step_s"] for r in rows] == pytest.approx([0.4, 0.1, 0.1])
    assert rows[0]["attn_pairs"] == 20 * 21 / 2 and rows[1]["kv_tokens"] == 21
    assert MeasuredStepCost.from_file(path).rows == 3


def test_engine_reports_every_step_to_its_observer(tmp_path, bundled_tokenizer):
    make_tiny_model("llama", str(tmp_path), bundled_tokenizer)
    llm = LLM(model=str(tmp_path), max_model_len=256, num_kv_blocks=32)
    seen = []
    llm.engine.step_observer = lambda steps, start, end, busy: seen.append((steps, end >= start, busy))
    llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert [s[0] for s in seen] == [[(0, 4)], [(4, 1)], [(5, 1)]]
    assert all(s[1] for s in seen) and [s[2] for s in seen] == [True, True, False]


def _bench_file(path, requests):
    path.write_text(json.dumps({"runs": [{"summary": {}, "requests": requests}]}))
    return path


def _req(i, due, prompt, out, ttft_ms, tpot_ms, end_s, success=True):
    return {"index": i, "scheduled_s": due, "prompt_len": prompt, "output_len": out, "ttft_ms": ttft_ms,
            "tpot_ms": tpot_ms, "end_s": end_s, "success": success}


def test_validate_replays_the_measured_arrivals_and_reports_relative_errors(tmp_path):
    # every step costs 0.1 s: a request alone gets its first token after one step, then one per step
    table = tmp_path / "steps.yaml"
    table.write_text("\n".join(f"- {{num_tokens: {n}, num_seqs: 1, attn_pairs: {n}, kv_tokens: {n}, step_s: 0.1}}"
                               for n in (1, 1, 16, 16)))
    bench = _bench_file(tmp_path / "b.json", [
        _req(0, 5.0, 16, 5, 100.0, 100.0, 5.5),
        _req(1, 15.0, 16, 5, 200.0, 125.0, 15.7),
        _req(2, 20.0, 16, 5, 0, None, 20.1, success=False),        # failed: not replayed
    ])
    reqs, measured = load_bench_run(bench)
    assert [(r.arrival, r.prompt_len, r.output_len) for r in reqs] == [(0.0, 16, 5), (10.0, 16, 5)]
    assert measured["output_tok_s"] == pytest.approx(10 / 10.7)
    v = validate(bench, MeasuredStepCost.from_file(table), SchedulerConfig())
    assert v.predicted["tpot_p50_ms"] == pytest.approx(100.0)
    assert v.predicted["ttft_p99_ms"] == pytest.approx(100.0)
    assert v.predicted["output_tok_s"] == pytest.approx(10 / 10.5)
    assert v.errors["tpot_p50_ms"] == pytest.approx(100.0 / 112.5 - 1)


def test_validate_cli_prints_json_and_refuses_a_file_without_request_records(tmp_path, capsys):
    table = tmp_path / "steps.jsonl"
    table.write_text("".join(json.dumps({"num_tokens": n, "num_seqs": 1, "attn_pairs": n, "kv_tokens": n,
                                         "step_s": 0.01 * n}) + "\n" for n in (1, 2, 8, 16)))
    bench = _bench_file(tmp_path / "b.json", [_req(0, 0.0, 8, 4, 50.0, 20.0, 0.2), _req(1, 1.0, 8, 4, 60.0, 25.0, 1.2)])
    argv = ["plan", "validate", "--step-table", str(table)]
    assert main(argv + ["--bench", str(bench), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert set(res["relative_error"]) == {"tpot_p50_ms", "ttft_p99_ms", "output_tok_s"}
    assert main(argv + ["--bench", str(bench)]) == 0                      # the table renders
    assert "P99 TTFT" in capsys.readouterr().out
    empty = _bench_file(tmp_path / "empty.json", [])
    assert main(argv + ["--bench", str(empty)]) == 2
    assert "re-run the bench without --no-requests" in capsys.readouterr().err


def test_serve_refuses_an_unwritable_step_log_before_loading_the_model(tmp_path, capsys):
    assert main(["serve", "--port", "0", "--step-log", str(tmp_path / "missing" / "steps.jsonl")]) == 2
    assert "--step-log" in capsys.readouterr().err


def _scattered_rows(n=400, slow_every=100, seed=0):
    """A step log of an engine whose costs scatter ±20 % around 10 ms + 1 ms/token, with a 1.5x slow
    stretch of 20 steps every `slow_every` (the machine busy elsewhere), each row carrying its start."""
    rng = np.random.default_rng(seed)
    rows, t = [], 0.0
    for i in range(n):
        tok = int(rng.choice([1, 4, 8, 128]))
        step = (0.010 + 0.001 * tok) * rng.uniform(0.8, 1.2) * (1.5 if i % slow_every < 20 else 1.0)
        rows.append({**shape_row(50, 1, tok, step), "t": t})
        t += step
    return rows


def test_step_table_keeps_its_scatter_and_noisy_costs_reproduce_it():
    table = MeasuredStepCost.fit(_scattered_rows())
    assert len(table.noise) == 64 and np.mean(table.noise) == pytest.approx(1.0)
    assert table.noise[6] < 0.9 and table.noise[-7] > 1.1          # P10 / P90 of the ratios
    assert table.noise_corr > 0.5                                    # the slow stretches
    untimed = MeasuredStepCost.fit([{k: v for k, v in r.items() if k != "t"} for r in _scattered_rows()])
    assert untimed.noise_corr == 0.0 and untimed.noise
    assert not MeasuredStepCost.fit(_scattered_rows(n=20)).noise     # too few rows for quantiles

    noisy = NoisyStepCost(table, seed=3)
    s = table.new_shape()
    s.add(50, 1, 8)
    draws = np.array([noisy.step_time(s) for _ in range(4000)]) / table.step_time(s)
    assert draws.mean() == pytest.approx(1.0, abs=0.03)
    assert np.percentile(draws, 10) == pytest.approx(table.noise[6], abs=0.05)
    lr = np.log(draws) - np.log(draws).mean()
    assert float(lr[1:] @ lr[:-1] / (lr @ lr)) == pytest.approx(table.noise_corr, abs=0.1)
    noisy.reset()
    assert [noisy.step_time(s) for _ in range(3)] == pytest.approx(list(draws[:3] * table.step_time(s)))


def test_step_scatter_raises_the_tail_not_the_throughput_and_runs_reproduce():
    table = MeasuredStepCost.fit(_scattered_rows())
    reqs = make_requests(8.0, 300, parse_length("64"), parse_length("16"), seed=2)
    plain = simulate(table, reqs, SchedulerConfig()).summary()
    noisy = NoisyStepCost(table, seed=1)
    first, again = (simulate(noisy, reqs, SchedulerConfig()).summary() for _ in range(2))
    assert first == again                                            # every run starts the noise afresh
    assert first["ttft"]["p99"] > plain["ttft"]["p99"] * 1.05
    assert first["output_tok_s"] == pytest.approx(plain["output_tok_s"], rel=0.05)


def test_validate_replays_with_the_scatter_and_reports_the_spread(tmp_path, capsys):
    table = tmp_path / "steps.jsonl"
    table.write_text("".join(json.dumps(r) + "\n" for r in _scattered_rows()))
    reqs = make_requests(8.0, 120, parse_length("64"), parse_length("16"), seed=5)
    bench = _bench_file(tmp_path / "b.json", [_req(r.id, 100.0 + r.arrival, r.prompt_len, r.output_len, 300.0, 40.0,
                                                  100.0 + r.arrival + 1.0) for r in reqs])
    cost = MeasuredStepCost.from_file(table)
    v = validate(bench, cost, SchedulerConfig(), replicates=8, seed=4)
    assert v.replicates == 8
    for key, (lo, hi) in v.band.items():
        assert lo <= v.predicted[key] <= hi and lo < hi
    one = validate(bench, cost, SchedulerConfig(), replicates=1)
    assert one.replicates == 1 and not one.band
    assert one.predicted == validate(bench, cost, SchedulerConfig()).predicted
    argv = ["plan", "validate", "--step-table", str(table), "--bench", str(bench), "--json"]
    assert main(argv + ["--replicates", "5"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["replicates"] == 5 and res["cost_model"]["noise"]["lag1_corr"] > 0.5
    assert main(argv + ["--no-step-noise"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["replicates"] == 1 and "noise" not in res["cost_model"] and not res["predicted_p10_p90"]
    assert main(argv + ["--replicates", "0"]) == 2
    assert "--replicates" in capsys.readouterr().err


def test_capacity_with_a_step_log_uses_its_scatter_unless_told_not_to(tmp_path, capsys):
    table = tmp_path / "steps.jsonl"
    table.write_text("".join(json.dumps(r) + "\n" for r in _scattered_rows()))
    argv = ["plan", "capacity", "smollm2-135m", "--hardware", "rtx-4090", "--rate", "20", "--prompt-len", "64",
            "--output-len", "16", "--slo", "ttft_p99:2000", "--num-requests", "200", "--step-table", str(table), "--json"]
    assert main(argv) == 0
    noisy = json.loads(capsys.readouterr().out)
    assert noisy["cost_model"]["noise"]["ratio_p90"] > 1.1 and noisy["replicas"] >= 1
    assert main(argv + ["--no-step-noise"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert "noise" not in plain["cost_model"] and plain["replicas"] >= 1
