"""The measured kernel table: which linear kernel runs which shape at which row count, on this CPU.

At load (`select_kernels`, kernels/select.py) every distinct (format, shape) among the model's linears is timed once
per candidate kernel at the row buckets (1, 4, 8, ... 512: linear.ROW_BUCKETS, up to what the layer
will see; above 64 rows only the kernels eligible there, and float layers not at all), on the layer's
real weights, on one thread, and the table is cached per CPU next to the C build (~/.cache/tokenfab/
tuning, keyed by the CPU model and flags, torch's version and the C source), so later loads
measure nothing. Each layer then gets a `LinearPlan`: for every measured row count the fastest
kernel (a kernel earlier in the registry keeps its place unless another beats it by TIE_MARGIN, so
noise on a shared machine doesn't flip choices), merged into ranges.

Float copies of quantized weights (the "float" kernel) are kept only for shapes where the table
says they win somewhere, and only while their bytes fit the budget; the shapes that save the most
time per byte are kept first.

Without measurement (`autotune=False`, or a layer built outside the engine) `default_rules` gives
the choices this project measured by hand on its 2-core dev machines (docs/quant.md).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field

import torch

from tokenfab.kernels.linear import (KernelLinear, LinearPlan, build_plan, candidates, get, registered, row_buckets,
                                     SMALL_ROWS)

log = logging.getLogger("tokenfab.kernels")

TIE_MARGIN = 0.10         # a later-registered kernel must be this much faster to displace an earlier one
REPEATS = 3               # timed passes per (kernel, row count) after a warm one; the minimum is kept
ROTATE = 8                # same-shaped layers a pass rotates over (weights stream from memory, not L1/L2)
SLOW_PASS_S = 0.05        # a pass slower than this is timed once more only
STACK_MARGIN = 0.5        # within the cpu backend's one-call decode rows, displacing qgemm turns that stack off
                          # for the whole model (8.7 vs 16 ms per token, docs/architecture.md), a cost no
                          # per-linear timing sees: another kernel must be 2x faster there ...
STACK_GAP_S = 1e-3        # ... or this many seconds a call faster. The stack saves a roughly fixed dispatch
                          # cost per layer (the bundled model's 7.3 ms over 30 layers: 0.25 ms each), while a
                          # kernel's gap grows with the shape: on a 1B model's FFN (16384x2048, 16 layers,
                          # Zen 5 EPYC) qmadd at 32 rows took 25.2 ms against the float copy's 12.8, and
                          # keeping the stack there cost 200 ms a step
# MEASURE_THREADS: the table is measured on one thread. Every kernel splits its output rows over the
# threads alike, so their ranking holds at any thread count, and one thread never waits on an OpenMP
# worker the OS descheduled: with other work on the 2-core VM (load average 10) a 20 us call measured
# on two threads took 10-15 ms, which made the table noise.
LOSSY_MARGIN = 0.5        # a kernel that rounds activations below the compute precision (torch's packed
                          # kernels: bf16, KL 1e-3 on the bundled model) must be this much faster to be chosen,
LOSSY_COPY_MARGIN = 1 / 3 # or this much (1.5x) where the precise pick is a float copy and the lossy kernel's copy
                          # is smaller: the bf16 copy against the float32 one also halves the copy's memory.
                          # On a Zen 5 EPYC bf16 measured 1.75-2.0x faster than float32 on a 1B model's shapes
                          # at 32-512 rows, so LOSSY_MARGIN flipped between the two tables by noise, and with
                          # it 2.3 or 3.8 GB of copies and 1.4x or 0.9x llama.cpp at 32 streams
TABLE_VERSION = 2         # what save() writes; 2 added the row buckets 128-512 (linear.ROW_BUCKETS)
READABLE_VERSIONS = (1, 2)  # a version-1 table's measurements still hold: it is read, and the buckets it
                          # lacks are measured on the next load (a second or so) and saved as version 2
CACHE_GENERATION = 1      # part of the cache file's name: bump when old measurements become wrong
BUSY_SHARE = 0.25         # other processes took more than this share of the CPUs while a shape was measured:
                          # its times are suspect (a parallel compile made a bf16 float copy look 10 % faster
                          # than qbf16 and cost the one-call stack 17-64 rows on an AMX Xeon), so the entry is
                          # flagged and measured again at later loads, keeping each time's minimum
BUSY_MIN_WALL_S = 0.1     # ... judged only over at least this long (a tick is 10 ms; the bundled model's shapes take 0.2-2.2 s)
REMEASURE_LOADS = 3       # ... at most this many times, so a machine that is always busy stops paying for it
STACK_KERNELS = ("qgemm", "qdot", "qtile")   # kernels whose layouts the one-call decode stack runs (tf_qgemm's flags)
STACK_BIG_KERNELS = ("qbf16", "qmadd")       # what the stack runs on those layouts from a linear's switch row on
UNIFORM_KERNELS = ("qgemm", "qtile", "qmadd")   # precise kernels whose float sums differ in the last bits: a plan runs one
UNIFORM_ROWS = 16         # of them for every row count up to here (at least the stack's rows), so a token's logits
                          # are the same in a 1-row decode and a 5-row speculative verify (greedy stays identical)


# ---------------------------------------------------------------------------- the hand-made rules
# What the pre-table code chose (benchmarks/quant_kernels.py, docs/quant.md, on the 2-core dev VMs):
# tf_qgemm up to 16 rows; torch's packed kernels up to a per-format limit (int4 32, int8 8, q8_0 1;
# 32 for weights of 8M+ elements such as the LM head); then the float copy where kept, else dequant.
QGEMM_DEFAULT_MAX_ROWS = 16
PACKED_DEFAULT_MAX_ROWS = {"int8": 8, "int4": 32, "q8_0": 1}
LARGE_WEIGHT_NUMEL = 8 << 20
LARGE_PACKED_MAX_ROWS = 32


def default_rules(layer: KernelLinear, allow_float_copy: bool = False) -> list[tuple[int | None, str]]:
    ok = {k.name for k in candidates(layer)}
    fmt = layer.weight_format
    if fmt == "float":
        return [(None, "onednn" if "onednn" in ok else "torch")]
    if fmt == "w8a8":
        return [(None, "w8a8" if "w8a8" in ok else "dequant")]
    ranges: list[tuple[int | None, str]] = []
    if "qtile" in ok:        # AMX: as precise as qgemm, as fast at 1 row, 3x faster at 5 (docs/speculative.md)
        ranges.append((QGEMM_DEFAULT_MAX_ROWS, "qtile"))
    elif "qgemm" in ok:
        ranges.append((QGEMM_DEFAULT_MAX_ROWS, "qgemm"))
    if "packed" in ok:
        limit = PACKED_DEFAULT_MAX_ROWS.get(fmt, 1)
        if layer.in_features * layer.out_features >= LARGE_WEIGHT_NUMEL:
            limit = max(limit, LARGE_PACKED_MAX_ROWS)
        if allow_float_copy and "float" in ok:
            limit = 8 if layer.in_features * layer.out_features >= LARGE_WEIGHT_NUMEL else 4
        if not ranges or limit > ranges[-1][0]:
            ranges.append((limit, "packed"))
    ranges.append((None, "float" if allow_float_copy and "float" in ok else "dequant"))
    return ranges


def default_plan(layer: KernelLinear) -> LinearPlan:
    return build_plan(layer, default_rules(layer))


# ---------------------------------------------------------------------------- the measured table
def _cpu_key() -> str:
    from tokenfab.kernels import _cpu_model, source_digest
    parts = [_cpu_model(), torch.__version__, str(CACHE_GENERATION)]
    try:
        parts.append(source_digest().hex())     # every C source and header: an edit to any one re-measures
    except OSError:
        pass
    from tokenfab import kernels as c
    parts.append(str(c.enabled()))
    parts.append(str(c.isa()))          # each ISA variant times differently: its own table
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def table_path() -> str:
    root = os.environ.get("TOKENFAB_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tokenfab")
    return os.path.join(root, "tuning", f"linear-{_cpu_key()}.json")


@dataclass
class KernelTable:
    """shape key -> {"rows": [..], "times": {kernel: [seconds per row count]}}."""
    entries: dict[str, dict] = field(default_factory=dict)
    path: str | None = None
    measured_s: float = 0.0           # time spent measuring in this process

    @classmethod
    def load(cls, path: str | None = None) -> "KernelTable":
        path = path or table_path()
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            return cls({}, path)
        version = data.get("version", 1) if isinstance(data, dict) else None
        if version not in READABLE_VERSIONS:
            log.info("kernel table %s has version %r (this build reads %s): measuring afresh",
                     path, version, READABLE_VERSIONS)
            return cls({}, path)
        entries = data.get("entries")
        entries = {k: e for k, e in entries.items() if _well_formed(e)} if isinstance(entries, dict) else {}
        return cls(entries, path)

    def save(self) -> None:
        if not self.path:
            return
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".json", dir=os.path.dirname(self.path))
            with os.fdopen(fd, "w") as f:
                json.dump({"version": TABLE_VERSION, "entries": self.entries}, f, indent=1)
            os.replace(tmp, self.path)        # atomic: a concurrent loader never reads half a file
        except OSError as e:
            log.warning("could not save the kernel table to %s: %s", self.path, e)

    def has(self, key: str, rows: list[int], kernels: list[str]) -> bool:
        e = self.entries.get(key)
        return (e is not None and all(r in e["rows"] for r in rows)
                and all(k in e["times"] for k in kernels)
                and not 0 < e.get("busy", 0) <= REMEASURE_LOADS)    # measured under load: again

    def measure(self, layers: list[KernelLinear], rows: list[int], skip: set[str] = frozenset()) -> float | None:
        """Time every candidate kernel on these same-shaped layers' real weights at these row counts.

        Calls rotate over the layers (up to ROTATE of them), so the weights stream from memory as in a
        forward pass instead of sitting hot in the cache after the first call (a single hot weight made
        4-byte float copies look as cheap as 0.5-byte int4 blocks). Returns the share of the CPUs other
        processes used meanwhile (None where /proc/stat is missing); above BUSY_SHARE the entry is
        flagged ("busy": how many such measurements) and measured again at later loads (`has`)."""
        t0 = time.perf_counter()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)        # see MEASURE_THREADS
        before = _cpu_seconds()
        try:
            self._measure(layers, rows, skip)
        finally:
            torch.set_num_threads(threads)
            self.measured_s += time.perf_counter() - t0
        share = _others_share(before, _cpu_seconds(), time.perf_counter() - t0)
        e = self.entries[layers[0].shape_key()]
        if share is not None and share > BUSY_SHARE:
            e["busy"] = e.get("busy", 0) + 1
        elif e.get("busy"):
            e["busy"] = 0                      # a quiet measurement: settled
        return share

    def _measure(self, layers: list[KernelLinear], rows: list[int], skip: set[str] = frozenset()) -> None:
        layer = layers[0]
        key = layer.shape_key()
        entry = self.entries.setdefault(key, {"rows": [], "times": {}})
        all_rows = sorted(set(entry["rows"]) | set(rows))
        gen = torch.Generator().manual_seed(0)
        xs = {r: torch.randn(r, layer.in_features, generator=gen).to(layer.compute_dtype) for r in all_rows}
        cands = [k for k in candidates(layer) if k.name not in skip]
        names = {k.name for k in cands}
        group = layers[:ROTATE]
        for k in cands:
            if k.name == "dequant" and "float" in names:
                continue          # the float copy is dequant without the per-call expansion: dequant only
                                  # runs where copies don't fit, and there the rules' fallback is dequant
            old = dict(zip(entry["rows"], entry["times"].get(k.name, [])))
            again = entry.get("busy", 0) > 0       # measured under load before: every row again, keep the minimum
            todo = [r for r in all_rows if (again or old.get(r) is None)
                    and (k.tune_max_rows is None or r <= k.tune_max_rows)]
            if todo:
                states = [k.prepare(m) for m in group]
                for r in todo:    # big row counts amortize the weight read: a few layers suffice
                    n = len(group) if r < 32 else min(len(group), 2)
                    t = _time_rotating(k, states[:n], group[:n], xs[r])
                    old[r] = t if old.get(r) is None else min(old[r], t)
                del states
            entry["times"][k.name] = [old.get(r) for r in all_rows]
        for name, ts in entry["times"].items():           # earlier rows of kernels not timed now
            if len(ts) != len(all_rows):
                entry["times"][name] = [dict(zip(entry["rows"], ts)).get(r) for r in all_rows]
        entry["rows"] = all_rows

    def ranges(self, layer: KernelLinear, allowed: set[str], stack_rows: int = 0,
               max_rows: int | None = None, big_stack_rows: int = 0) -> list[tuple[int | None, str]] | None:
        """Fastest allowed kernel per measured row count, as plan ranges; None if nothing measured.
        Up to stack_rows a kernel off the stack must be STACK_MARGIN (or STACK_GAP_S) faster than qgemm; from
        there up to big_stack_rows, that much faster than each kernel, no less precise than it, that the stack runs
        on the layout of the 1-row pick (that kernel, or the layout's big-batch kernel: STACK_BIG_KERNELS)."""
        e = self.entries.get(layer.shape_key())
        if e is None:
            return None
        ks = sorted((k for k in registered(layer.weight_format) if k.name in allowed and k.name in e["times"]),
                    key=lambda k: k.rank)
        order = [k.name for k in ks]
        # an opt-in kernel is allowed only when its precision was asked for (int8_activations): it then
        # competes on time, with TIE_MARGIN, not LOSSY_MARGIN
        lossy = {k.name for k in ks if k.lossy and not getattr(k, "opt_in", False)}
        if not order:
            return None
        if layer.weight_format == "float":
            # float kernels sum in different orders: one kernel for every row count keeps a token's
            # logits independent of its batch (the greedy-invariance tests hold exactly)
            small = [i for i, r in enumerate(e["rows"]) if r <= SMALL_ROWS]
            total = {k: sum(e["times"][k][i] or float("inf") for i in small) for k in order}
            return [(None, _pick(order, total, lossy))]
        ranges: list[tuple[int | None, str]] = []
        wanted = set(row_buckets(max_rows)) if max_rows else set(e["rows"])    # a step of T rows runs
        # the choice of the smallest bucket at or above T (LinearPlan), the last bucket's any bigger one
        for i, r in enumerate(e["rows"]):
            if r not in wanted:
                continue
            t = {k: e["times"][k][i] for k in order if e["times"][k][i] is not None}
            if t:
                free = r > max(stack_rows, UNIFORM_ROWS)
                pick = _pick([k for k in order if k in t], t, lossy, free)
                if r <= stack_rows and "qgemm" in t and pick not in STACK_KERNELS \
                        and not _leaves_stack(t[pick], t["qgemm"]):
                    pick = "qgemm"
                elif stack_rows < r <= big_stack_rows and ranges and ranges[0][1] in STACK_KERNELS:
                    first = ranges[0][1]
                    layout = _layout(first)
                    on = [k for k in order if k in t and (k == first or (
                        k in STACK_BIG_KERNELS and _layout(k) == layout))]
                    # on-stack kernels no less precise than the pick that it does not beat (_leaves_stack)
                    near = [k for k in on if (pick in lossy or k not in lossy) and not _leaves_stack(t[pick], t[k])]
                    if near and pick not in on:
                        pick = _pick(near, t, lossy, free)
                ranges.append((r, pick))
        if not ranges:
            return None
        _uniform(ranges, e, max(stack_rows, UNIFORM_ROWS))
        last = ranges[-1][1]
        covered = max_rows is not None and ranges[-1][0] >= max_rows     # the layer never sees more rows
        if not covered and get(last).tune_max_rows is not None and "dequant" in allowed:
            ranges.append((None, "float" if "float" in allowed and "float" in e["times"] else "dequant"))
        else:
            ranges[-1] = (None, last)
        return ranges


def _cpu_seconds() -> tuple[float, float] | None:
    """(CPU seconds every process has run, this process's), from /proc/stat; None where it is missing."""
    try:
        with open("/proc/stat") as f:
            fields_ = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    busy = sum(fields_) - fields_[3] - (fields_[4] if len(fields_) > 4 else 0)     # less idle and iowait
    t = os.times()
    return busy / os.sysconf("SC_CLK_TCK"), t.user + t.system


def _others_share(before, after, wall: float) -> float | None:
    """The share of all CPUs that other processes used between two _cpu_seconds() readings; None where it
    cannot be told, including windows under BUSY_MIN_WALL_S (both readings count clock ticks, 10 ms
    each: one tick in a tiny test shape's 5 ms window read as 100 %)."""
    if before is None or after is None or wall < BUSY_MIN_WALL_S:
        return None
    others = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, others) / (wall * (os.cpu_count() or 1))


def _uniform(ranges: list[tuple[int | None, str]], e: dict, upto: int) -> None:
    """Where the picks up to `upto` rows name more than one of UNIFORM_KERNELS, all of them become the one
    with the least time summed over those buckets (in place)."""
    idx = [i for i, (r, pick) in enumerate(ranges) if r <= upto and pick in UNIFORM_KERNELS]
    names = {ranges[i][1] for i in idx}
    if len(names) < 2:
        return
    col = {r: i for i, r in enumerate(e["rows"])}
    total = {k: sum(e["times"][k][col[ranges[i][0]]] or float("inf") for i in idx) for k in names}
    best = min(sorted(names), key=lambda k: total[k])
    for i in idx:
        ranges[i] = (ranges[i][0], best)


def _well_formed(e) -> bool:
    """An entry a hand-edited or truncated file could have broken is dropped (and measured again)."""
    try:
        n = len(e["rows"])
        return all(isinstance(r, int) for r in e["rows"]) and all(len(t) == n for t in e["times"].values())
    except (TypeError, KeyError, AttributeError):
        return False


def _layout(name: str) -> str:
    return getattr(get(name), "layout", name)


def _pick(order: list[str], times: dict[str, float], lossy: set[str] = frozenset(), free: bool = False) -> str:
    """The best-ranked kernel in `order` unless a later one is TIE_MARGIN (LOSSY_MARGIN for a lossy
    kernel, LOSSY_COPY_MARGIN for a lossy copy smaller than a float-copy pick) faster than the best before
    it: noise on a shared machine must not flip choices.
    `free` (row counts above the uniform and stack rows): kernels that share a prepared layout (qgemm and
    qmadd) compete on time alone. Nothing rides on keeping the earlier one there, no bytes and no
    identical sums, and the margin was a bias: at 32 rows qmadd measured 6 % faster than qgemm's four
    passes in one table and 17 % in another, so one build ran qgemm there and 32 streams ran ~10 %
    slower (measured on an AMD EPYC Zen 3)."""
    def tie_pick(names):
        best = names[0]
        for k in names[1:]:
            margin = 0.0 if free and _layout(k) == _layout(best) else TIE_MARGIN
            if times[k] < times[best] * (1 - margin):
                best = k
        return best

    precise = [k for k in order if k not in lossy] or order
    best = tie_pick(precise)

    def lossy_margin(k):
        smaller_copy = 0 < getattr(get(k), "copy_bytes", 0) < getattr(get(best), "copy_bytes", 0)
        return LOSSY_COPY_MARGIN if smaller_copy else LOSSY_MARGIN
    # lossy kernels of one precision (bf16 activations) compete among themselves as precise ones do
    faster = [k for k in order if k in lossy and times[k] < times[best] * (1 - lossy_margin(k))]
    return tie_pick(faster) if faster else best


def _leaves_stack(t_off: float, t_on: float) -> bool:
    """A kernel off the one-call decode stack (t_off seconds a call) is worth leaving it for over one on it."""
    return t_off < t_on * (1 - STACK_MARGIN) or t_on - t_off > STACK_GAP_S


def _time_rotating(kernel, states, layers, x) -> float:
    """Seconds per call: the fastest single call over REPEATS timed passes (after a warm one) over the
    layers. The minimum, not the mean: on shared cores a call that waited for a descheduled OpenMP
    thread took 10-15 ms instead of 20 us (measured on the 2-core VM), and that is not the kernel."""
    def one_pass(best):
        for st, m in zip(states, layers):
            t = time.perf_counter()
            kernel.run(st, x, m)
            best = min(best, time.perf_counter() - t)
        return best

    t0 = time.perf_counter()
    one_pass(float("inf"))                  # warm: first-call allocations, page faults
    slow = time.perf_counter() - t0 > SLOW_PASS_S
    best = float("inf")
    for _ in range(1 if slow else REPEATS):
        best = one_pass(best)
    return best
