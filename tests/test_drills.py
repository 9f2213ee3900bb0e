"""`tokenfab bench drills`: the ledger that gives every request one outcome, the flags, and the drills
themselves against `tokenfab serve` on the bundled model.

The default run keeps the quick drills (hang-ups, 1,000 idle connections, SIGTERM, and a corrupt
database through the CLI); slow readers, SIGKILL with a batch in flight, the full disk and a killed Ray
Serve replica are slow tests (`make test-all`). A drill that fails shows its table row and every check it made.
"""
from __future__ import annotations

import asyncio
import json

import pytest

from tokenfab.bench.client import RawResult
from tokenfab.bench.drill_cases import DRILLS, run_drill
from tokenfab.bench.drill_load import Tally, outcome
from tokenfab.bench.drills import COLUMNS, DrillConfig, DrillContext, DrillResult, check_lines, markdown_table
from tokenfab.bench.tokens import load_counter
from tokenfab.cli import build_parser, main

pytestmark = pytest.mark.timeout(300)


# -- the ledger and the table ---------------------------------------------------------------------

@pytest.mark.parametrize("raw, kind", [
    (RawResult(status=200, finish_reason="length"), "completed"),
    (RawResult(status=200), "lost"),                                          # ended without a finish reason
    (RawResult(status=200, hung_up=True), "aborted"),
    (RawResult(status=400, error="HTTP 400: max_tokens must be at least 1"), "failed"),
    (RawResult(status=503, error="HTTP 503: the server is shutting down"), "failed"),
    (RawResult(status=507, error="HTTP 507: the disk under the data dir is full"), "failed"),
    (RawResult(status=500, error="HTTP 500: internal error"), "lost"),
    (RawResult(status=200, error="error in stream: the engine stopped"), "failed"),
    (RawResult(status=200, error="structured output: not JSON"), "lost"),
    (RawResult(error="ConnectError: [Errno 111] Connection refused"), "refused"),
    (RawResult(error="timed out after 120 s"), "lost"),
    (RawResult(status=200, sent=1.0, end=3.0, error="RemoteProtocolError: peer closed connection"), "lost"),
])
def test_every_request_gets_exactly_one_outcome(raw, kind):
    assert outcome(raw) == kind


def test_a_connection_dropped_by_a_kill_while_it_ran_is_cut_not_lost():
    raw = RawResult(status=200, sent=1.0, end=3.0, error="RemoteProtocolError: peer closed connection")
    assert outcome(raw, killed=[2.0]) == "cut"
    assert outcome(raw, killed=[5.0]) == "lost"                  # the kill came after it ended


def test_a_drill_fails_on_a_lost_request_a_duplicate_a_held_block_or_a_failed_check():
    ok = DrillResult("x", "fault")
    ok.tally.add(RawResult(status=200, finish_reason="stop"))
    ok.tally.add(RawResult(error="ConnectError: refused"))
    ok.kv_idle_blocks = 0
    assert ok.passed and ok.tally.accepted == 1 and ok.tally.sent == 2
    lost = DrillResult("x", "fault", kv_idle_blocks=0)
    lost.tally.add(RawResult(status=500, error="HTTP 500: boom"))
    twice = DrillResult("x", "fault", tally=Tally(duplicated=1))
    held = DrillResult("x", "fault", kv_idle_blocks=3)
    check = DrillResult("x", "fault")
    check.check("exit status 0", False, "exit 1")
    assert not any(r.passed for r in (lost, twice, held, check))
    assert lost.tally.messages == {"lost: HTTP 500: boom": 1}
    skipped = DrillResult("x", "fault", skipped="no tmpfs here")
    table = markdown_table([ok, lost, skipped]).splitlines()
    assert len(table) == 5 and all(line.count("|") == len(COLUMNS) + 1 for line in table)
    assert table[2].endswith("| pass |") and table[3].endswith("| FAIL |") and "skipped: no tmpfs here" in table[4]
    assert check_lines([check]) == ["x: FAILED exit status 0: exit 1"]


def test_flag_defaults_and_names_are_the_config_and_the_registry():
    args = build_parser().parse_args(["bench", "drills"])
    cfg = DrillConfig(workdir=None)
    assert args.only == list(DRILLS)
    assert (args.concurrency, args.load_seconds, args.idle_connections, args.slow_readers, args.batch_lines,
            args.seed) == (cfg.concurrency, cfg.load_s, cfg.idle_connections, cfg.slow_readers, cfg.batch_lines,
                           cfg.seed)


@pytest.mark.parametrize("flags, message", [
    (["--only", "sigterm,meteor"], "no drill named meteor"),
    (["--concurrency", "0"], "--concurrency 0"),
    (["--idle-connections", "0"], "--idle-connections 0"),
])
def test_bad_flags_get_one_clear_line_and_exit_2(flags, message, capsys, tmp_path):
    assert main(["bench", "drills", "--workdir", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert "tokenfab bench drills: error:" in err and message in err and "Traceback" not in err


# -- the drills against tokenfab serve --------------------------------------------------------------

@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    cfg = DrillConfig(workdir=tmp_path_factory.mktemp("drills"), load_s=2.0)
    context = DrillContext(cfg, load_counter(None))
    yield context
    context.close()


def drill(ctx: DrillContext, name: str) -> DrillResult:
    result = asyncio.run(run_drill(ctx, name))
    if result.skipped:
        pytest.skip(f"{name}: {result.skipped}")
    report = "\n".join([markdown_table([result]), *check_lines([result]),
                        ctx.server.log_tail(1500) if ctx.server is not None else ""])
    assert result.passed, report
    assert result.tally.accepted > 0 and result.checks, report
    return result


def test_hang_ups_mid_prefill_and_mid_stream_free_their_kv_by_the_next_engine_step(ctx):
    r = drill(ctx, "disconnect")
    assert r.tally["aborted"] >= 2 and r.kv_idle_blocks == 0


def test_a_thousand_idle_connections_leave_the_load_served(ctx):
    r = drill(ctx, "idle_connections")
    assert r.fault.startswith("1000 ") and r.tally["completed"] > 0


def test_sigterm_drains_what_runs_then_exits_0(ctx):
    r = drill(ctx, "sigterm")
    assert [c.held for c in r.checks] == [True, True, True] and r.recovery_s < ctx.cfg.shutdown_timeout_s


def test_corrupt_and_foreign_databases_are_refused_by_name_through_the_cli(tmp_path, capsys):
    out = tmp_path / "drills.json"
    rc = main(["bench", "drills", "--only", "corrupt_sqlite", "--load-seconds", "2", "--workdir", str(tmp_path),
               "--out", str(out), "--markdown", str(tmp_path / "drills.md")])
    [result] = json.loads(out.read_text())
    assert rc == 0, capsys.readouterr().out
    assert result["verdict"] == "pass" and result["lost"] == 0 and result["completed"] > 0
    assert len(result["checks"]) == 5 and all(c["held"] for c in result["checks"])
    assert "corrupt or foreign batch.sqlite at start" in (tmp_path / "drills.md").read_text()


@pytest.mark.slow
def test_slow_readers_neither_stall_other_streams_nor_grow_memory(ctx):
    drill(ctx, "slow_readers")


@pytest.mark.slow
def test_sigkill_mid_batch_then_restart_answers_every_line_once(ctx):
    r = drill(ctx, "sigkill")
    assert r.tally.duplicated == 0 and r.recovery_s is not None


@pytest.mark.slow
def test_a_full_data_dir_disk_is_a_clear_error_and_the_batch_resumes_with_space(ctx):
    drill(ctx, "enospc")


@pytest.mark.slow
def test_a_killed_ray_serve_replica_loses_no_request_and_is_replaced(ctx):
    pytest.importorskip("ray", reason="Ray Serve is the optional extra tokenfab[ray]")
    r = drill(ctx, "ray_replica")
    assert r.recovery_s is not None and r.kv_idle_blocks == 0
