"""The measured table's row buckets: big steps (32/64-stream decodes, prefill chunks) run the choice
measured at the smallest bucket at or above their row count, the buckets past 64 rows are timed only
for the kernels eligible there, and cached tables from before the big buckets are extended, not lost."""
import json

import pytest
import torch
from torch import nn

from tokenfab.kernels import linear as seam
from tokenfab.kernels import tuning
from tokenfab.kernels.select import select_kernels
from tokenfab.kernels.tuning import KernelTable
from tokenfab.model.layers import FloatLinear
from tokenfab.quant.linear import Int4Linear

BUCKETS = [1, 4, 8, 16, 32, 64, 128, 256, 512]


def _int4(n: int = 1) -> nn.ModuleList:
    g = torch.Generator().manual_seed(0)
    return nn.ModuleList(Int4Linear.from_float(torch.randn(64, 128, generator=g), group_size=32) for _ in range(n))


def test_row_buckets_reach_512_and_stop_at_the_first_bucket_covering_the_step():
    assert seam.row_buckets(2048) == BUCKETS               # the default token budget: 512 covers every bigger step
    assert seam.row_buckets(64) == BUCKETS[:6]              # the default LM head (max_num_seqs 64)
    assert seam.row_buckets(100) == BUCKETS[:7]
    assert seam.row_buckets(2048, limit=seam.SMALL_ROWS) == BUCKETS[:6]


def test_each_step_runs_the_choice_of_the_smallest_bucket_at_or_above_its_row_count(monkeypatch):
    for name in ("qgemm", "packed"):
        monkeypatch.setattr(seam.get(name), "supports", lambda layer: None)
    model = _int4()
    layer = model[0]
    # an injected table where each regime has its own winner: qgemm at 1-4 rows, packed (lossy, 2x
    # faster) at 8-64, the float copy at 128-256, dequant at 512 (qgemm/packed not timed past 64)
    none3 = [None] * 3
    times = {"qgemm": [1, 1, 9, 9, 9, 9] + none3, "packed": [9, 9, 1, 1, 1, 1] + none3,
             "float": [5, 5, 5, 5, 5, 5, 1, 1, 9], "dequant": [9, 9, 9, 9, 9, 9, 9, 9, 1]}
    tbl = KernelTable({layer.shape_key(): {"rows": BUCKETS, "times": times}}, path=None)
    select_kernels(model, max_rows=2048, head_max_rows=64, table=tbl, autotune=False, float_copy_budget=1 << 30)
    assert layer.plan.names() == [(4, "qgemm"), (64, "packed"), (256, "float"), (None, "dequant")]
    ran = []
    for name in ("qgemm", "packed", "float", "dequant"):
        k = seam.get(name)
        monkeypatch.setattr(k, "run", lambda st, x, m, _n=name: ran.append(_n) or torch.zeros(x.shape[0], m.out_features))
    # 32 and 64 streams decoding, a 65-row step, a 512-token prefill chunk (+ decodes), the whole budget
    expect = {1: "qgemm", 4: "qgemm", 5: "packed", 32: "packed", 64: "packed", 65: "float", 256: "float",
              257: "dequant", 512: "dequant", 520: "dequant", 2048: "dequant"}
    for rows, name in expect.items():
        ran.clear()
        layer(torch.randn(rows, 128))
        assert ran == [name], rows
    # a layer that never sees more than 64 rows (the LM head at max_num_seqs 64) ignores the big buckets
    select_kernels(model, max_rows=64, head_max_rows=64, table=tbl, autotune=False, float_copy_budget=1 << 30)
    assert layer.plan.names() == [(4, "qgemm"), (None, "packed")]


def test_big_buckets_are_timed_only_for_kernels_eligible_there_and_float_layers_not_at_all():
    model = nn.ModuleList([*_int4(2), FloatLinear(nn.Linear(128, 64))])
    tbl = KernelTable({}, path=None)
    select_kernels(model, max_rows=2048, head_max_rows=8, table=tbl, float_copy_budget=1 << 30)
    q = tbl.entries[model[0].shape_key()]
    assert q["rows"] == BUCKETS
    for name, ts in q["times"].items():
        big = dict(zip(q["rows"], ts))
        limit = seam.get(name).tune_max_rows
        assert all((t is None) == (limit is not None and r > limit) for r, t in big.items()), name
    assert any(t[-1] is not None for t in q["times"].values())      # the float copy at least
    assert tbl.entries[model[2].shape_key()]["rows"] == BUCKETS[:6]


def test_a_version_1_table_keeps_its_measurements_and_gains_the_big_buckets(tmp_path, monkeypatch):
    monkeypatch.setattr(tuning, "_others_share", lambda *a: 0.0)     # a busy machine would measure again
    model = _int4(2)
    key = model[0].shape_key()
    path = tmp_path / "t.json"
    # what version 1 saved: buckets up to 64; a sentinel time shows the old measurements survive
    old = KernelTable({}, None)
    select_kernels(model, max_rows=64, head_max_rows=8, table=old, float_copy_budget=1 << 30)
    old.entries[key]["times"]["dequant"] = [123.0] * 6
    path.write_text(json.dumps({"version": 1, "entries": old.entries}))
    tbl = KernelTable.load(str(path))
    assert tbl.entries[key]["rows"] == BUCKETS[:6]
    select_kernels(model, max_rows=2048, head_max_rows=8, table=tbl, float_copy_budget=1 << 30)
    e = tbl.entries[key]
    assert e["rows"] == BUCKETS and e["times"]["dequant"][:6] == [123.0] * 6
    tbl.save()
    assert json.loads(path.read_text())["version"] == tuning.TABLE_VERSION
    again = KernelTable.load(str(path))
    before = again.measured_s
    select_kernels(model, max_rows=2048, head_max_rows=8, table=again, float_copy_budget=1 << 30)
    assert again.measured_s == before                                  # nothing measured a third time


@pytest.mark.parametrize("content", [
    {"version": 99, "entries": {"int4:64x128": {"rows": [1], "times": {"qgemm": [1.0]}}}},   # a newer build's
    {"version": 2, "entries": {"int4:64x128": {"rows": [1, 4], "times": {"qgemm": [1.0]}}}},  # truncated times
    [1, 2, 3],
    {"version": 2, "entries": [1, 2]},
])
def test_unknown_versions_and_broken_entries_are_measured_afresh(tmp_path, content):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(content))
    assert KernelTable.load(str(path)).entries == {}
