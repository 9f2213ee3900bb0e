"""Choosing every linear's kernels at load: `select_kernels` installs a LinearPlan in each KernelLinear,
from the measured table (tuning.py's KernelTable) or the hand-made rules, and keeps float copies of
quantized weights only where the table says they pay and their bytes fit the budget. `step_time` reads
where a step's linear time goes from the same table (`tokenfab doctor`).
"""
from __future__ import annotations

import contextlib
import logging
import sys
from dataclasses import dataclass, field

import torch

from tokenfab.kernels.linear import (KernelLinear, build_plan, candidates, get, merge_ranges, plan_linears, registered,
                                     row_buckets, SMALL_ROWS)
from tokenfab.kernels.tuning import BUSY_SHARE, REMEASURE_LOADS, KernelTable, default_rules

log = logging.getLogger("tokenfab.kernels")


@dataclass
class KernelReport:
    """What was chosen, for logs and `tokenfab info`."""
    plans: dict[str, str]                     # shape key -> "qgemm 1-16, float 17+"
    layers: dict[str, int]                    # shape key -> how many linears have it
    float_copy_bytes: int
    weight_bytes: int
    measured_s: float
    table_path: str | None
    forced: str | None
    ranges: dict[str, list[tuple[int | None, str]]] = field(default_factory=dict)   # shape key -> (max rows, kernel)


@contextlib.contextmanager
def _progress(total: int):
    """A transient bar on stderr while the table measures (a 1B model's first load on a CPU: a minute or two),
    yielding the step callback; nothing when there is nothing to measure or stderr is not a terminal."""
    if total == 0 or not sys.stderr.isatty():
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    with Progress(TextColumn("measuring kernels"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("", total=total)
        yield lambda: bar.advance(task)


def select_kernels(model: torch.nn.Module, *, max_rows: int, head_max_rows: int, autotune: bool = True,
                   force: str = "auto", float_copy_budget: int = 0, table: KernelTable | None = None,
                   head: torch.nn.Module | None = None, dtype: torch.dtype | None = None,
                   stack_rows: int = 0, big_stack_rows: int = 0, int8_activations: bool = False,
                   after_plan=None) -> KernelReport:
    """Install a LinearPlan in every KernelLinear of `model`, once.

    max_rows: the most rows a decoder linear sees in a step (the token budget); head_max_rows: the
    most the LM head sees (one per sampled sequence). force: a kernel name for every layer that it can
    run (the rest stay automatic); "auto" measures (autotune) or uses the default rules. stack_rows:
    decode steps up to this many rows may take a one-call decode stack that needs qgemm (STACK_MARGIN);
    big_stack_rows: bigger ones up to this many may take it where the plans keep their layout.
    int8_activations: opt-in kernels (`opt_in`, qdot) are measured and chosen too; otherwise they run
    only when forced. after_plan: called with each layer once its plan is in (the engine drops float
    weights that the plan holds its own copy of, layer by layer: `float_weight_releaser`)."""
    layers = plan_linears(model)
    if dtype is not None:
        for m in layers:
            if m.weight_format != "float":
                m.compute_dtype = dtype
    if force != "auto":
        get(force)                            # unknown names fail loudly, before anything changes
    by_key: dict[str, list[KernelLinear]] = {}
    for m in layers:
        by_key.setdefault(m.shape_key(), []).append(m)
    heads = {key for key, ms in by_key.items() if any(m is head for m in ms) and len(ms) == 1}
    rows_for = {key: head_max_rows if key in heads else max_rows for key in by_key}
    big_for = {key: 0 if key in heads else big_stack_rows for key in by_key}     # the LM head is not in the stack

    opt_out = set() if int8_activations else {k.name for k in registered() if getattr(k, "opt_in", False)}
    tbl = table if table is not None else (KernelTable.load() if autotune else None)
    if tbl is not None and autotune:
        dirty, busy, todo = False, [], []
        for key, ms in by_key.items():
            rows = row_buckets(rows_for[key], SMALL_ROWS if ms[0].weight_format == "float" else None)
            names = [k.name for k in candidates(ms[0]) if k.name not in opt_out]
            if len(names) > 1 and not tbl.has(key, rows, [n for n in names if n != "dequant" or "float" not in names]):
                todo.append((key, ms, rows))
        if todo:
            log.info("measuring the kernel table for %d layer shapes (once per CPU and build; cached in %s)",
                     len(todo), tbl.path)
        with _progress(len(todo)) as advance:
            for key, ms, rows in todo:
                share = tbl.measure(ms, rows, opt_out)
                dirty = True
                if tbl.entries[key].get("busy"):
                    busy.append(f"{key} ({100 * share:.0f} %)")
                advance()
        if busy:
            log.warning("kernel table: other processes used more than %d %% of the CPUs while %s were measured; "
                        "those shapes are measured again at the next %d loads at most, keeping each time's "
                        "minimum", 100 * BUSY_SHARE, ", ".join(busy), REMEASURE_LOADS)
        if dirty and table is None:
            tbl.save()

    chosen: dict[str, list[tuple[int | None, str]]] = {}
    for key, ms in by_key.items():
        ok = {k.name for k in candidates(ms[0])}
        if force != "auto" and force in ok:
            chosen[key] = [(None, force)]
            continue
        ok -= opt_out
        r = tbl.ranges(ms[0], ok, stack_rows, rows_for[key], big_for[key]) if tbl is not None else None
        chosen[key] = r if r is not None else default_rules(ms[0], allow_float_copy=float_copy_budget > 0)

    _one_float_copy(chosen, tbl)
    _fit_float_copies(chosen, by_key, tbl, float_copy_budget, stack_rows, rows_for, opt_out, big_for)
    weight_bytes = sum(b.numel() * b.element_size() for m in layers for b in list(m.buffers()) + list(m.parameters()))
    for key, ms in by_key.items():
        for m in ms:
            m.plan = build_plan(m, chosen[key])
            if after_plan is not None:
                after_plan(m)
    float_bytes = sum(m.plan.float_copy_bytes() for m in layers)
    return KernelReport({k: build_describe(v) for k, v in chosen.items()}, {k: len(v) for k, v in by_key.items()},
                        float_bytes, weight_bytes, tbl.measured_s if tbl is not None else 0.0,
                        tbl.path if tbl is not None else None, None if force == "auto" else force,
                        {k: merge_ranges(v) for k, v in chosen.items()})


def step_time(table: KernelTable, ranges: dict[str, list], layers: dict[str, int],
              rows: int) -> list[tuple[str, int, str, float]]:
    """Where a step of `rows` rows spends its linear-kernel time, from the table's measurements: (shape
    key, linears of that shape, the kernel the plan runs at `rows`, seconds for all of them), slowest
    first. A row count between the table's buckets takes the next bucket up's time (a bound from above);
    shapes or kernels the table has not measured are left out."""
    out = []
    for key, plan in ranges.items():
        e = table.entries.get(key)
        kernel = next((name for top, name in plan if top is None or rows <= top), None)
        if e is None or kernel not in e["times"]:
            continue
        i = next((i for i, r in enumerate(e["rows"]) if r >= rows), len(e["rows"]) - 1)
        t = e["times"][kernel][i]
        if t is not None:
            out.append((key, layers.get(key, 1), kernel, t * layers.get(key, 1)))
    return sorted(out, key=lambda x: -x[3])


def build_describe(ranges: list[tuple[int | None, str]]) -> str:
    out, lo = [], 1
    for rows, name in merge_ranges(ranges):
        out.append(f"{name} {lo}+" if rows is None else f"{name} {lo}-{rows}")
        lo = (rows or 0) + 1
    return ", ".join(out)


def _one_float_copy(chosen, tbl: KernelTable | None) -> None:
    """Where a shape's plan names both float copies, its "float" ranges run on the "bf16" copy when the table
    measured bf16 no slower over them, so each weight keeps one copy of 2 bytes instead of 6 (in place).

    LOSSY_MARGIN keeps the precise float32 copy wherever bf16 is less than 2x faster; but a shape that
    holds a bf16 copy already rounds its activations to bf16 in the steps that copy serves, and its second,
    float32, copy costs twice the first one's memory and load time for a smaller gain. On a Zen 5 EPYC the
    1B Q4_K_M file's plans ran bf16 at 9-128 rows and float beyond (bf16 1.98x faster there): 7.4 GB of
    copies for 0.64 GB of weights, and 19 of 24 s of start-up spent making them."""
    if tbl is None:
        return
    for key, ranges in chosen.items():
        names = {n for _, n in ranges}
        e = tbl.entries.get(key)
        if not {"float", "bf16"} <= names or e is None or not {"float", "bf16"} <= set(e["times"]):
            continue
        t, rows, used, lo = e["times"], e["rows"], set(), 0
        for top, n in ranges:             # the buckets each float range covers: (the range below's top, top]
            if n == "float":
                hit = {i for i, r in enumerate(rows) if lo < r and (top is None or r <= top)}
                used |= hit or {len(rows) - 1}       # an open range above every bucket: the biggest one's time
            lo = top or lo
        if any(t["bf16"][i] is None or t["float"][i] is None for i in used):
            continue
        if sum(t["bf16"][i] for i in used) <= sum(t["float"][i] for i in used):
            chosen[key] = merge_ranges([(top, "bf16" if n == "float" else n) for top, n in ranges])


def _fit_float_copies(chosen, by_key, tbl: KernelTable | None, budget: int, stack_rows: int, rows_for,
                      opt_out: set[str] = frozenset(), big_for: dict | None = None) -> None:
    """Drop the float copies ("float", "bf16") from shapes (best saving per byte kept first) until they fit
    `budget`."""
    copies = {k.name: k.copy_bytes for k in registered() if k.float_copy}   # bytes per weight

    def cost(key):
        m = by_key[key][0]
        per = sum(copies[n] for n in {n for _, n in chosen[key]} if n in copies)
        return per * m.in_features * m.out_features * len(by_key[key])

    users = [k for k, r in chosen.items() if any(n in copies for _, n in r)]
    if not users:
        return

    def saving(key):                 # seconds saved per byte, summed over the row counts it wins
        e = tbl.entries.get(key) if tbl is not None else None
        if e is None:
            return 0.0
        s = 0.0
        for i in range(len(e["rows"])):
            f = [e["times"][n][i] for n in copies if n in e["times"] and e["times"][n][i] is not None]
            others = [t[i] for n, t in e["times"].items() if n not in copies and t[i] is not None]
            if f and others:
                s += max(0.0, min(others) - min(f))
        return s / max(cost(key), 1)

    kept = 0
    for key in sorted(users, key=saving, reverse=True):
        if kept + cost(key) <= budget:
            kept += cost(key)
            continue
        m = by_key[key][0]
        ok = {k.name for k in candidates(m)} - set(copies) - opt_out
        r = tbl.ranges(m, ok, stack_rows, rows_for[key], (big_for or {}).get(key, 0)) if tbl is not None else None
        chosen[key] = r if r is not None else default_rules(m, allow_float_copy=False)
