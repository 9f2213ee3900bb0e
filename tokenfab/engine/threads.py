"""Thread count that holds up when other processes share the cores.

A step runs its GEMMs and C kernels as OpenMP parallel regions, each ending in a barrier. When another
process takes a core, the OS deschedules one of our workers and every barrier waits a whole time
slice for it: on the 2-core VM one stream fell from 103 to 20 tok/s with two busy loops beside the
server, and `tokenfab generate` from 59.6 to 7.7 tok/s, while `--num-threads 1` kept 27.2 (issue 12).

`ThreadController` watches each step's time against the running median of quiet steps of the same
size (token count, in powers of two; a step counts as quiet at `max_threads` within `quiet_factor` of
that median, so the median follows slow drifts, such as longer contexts, but not contention). `patience` steps in a row slower than `slow_factor` x that
median, or a slow step while /proc/stat shows fewer free cores than threads, mean contention, and start
a trial: the candidate counts (see `candidates`), the current one first, take turns of `block` steps
until each has `judge`, all as slowdowns against the quiet median under the same contention. Turns,
not one count after another, because the machine has phases longer than a trial's steps (the OS moves
the busy processes between cores every 0.1-0.2 s; one thread alternated between a core of its own and
half of one). The fastest on average (less its worst step) is kept unless the preferred count is within
`min_gain` of it, and no trial starts for `probe_every` steps (a quarter of that, then half, after
trials in a row where the count above the cores lost: see `_next_candidate`). (Comparing with the slow
steps that started the trial favoured change: those are the worst steps at that count, picked for
being slow.)
Away from `max_threads`, it probes `max_threads` for `patience` steps and stays there when they look
quiet (within `quiet_factor` of the median) or are `min_gain` faster than the last steps at the count it
came from, so the count comes back when the contention ends. (The slow factor alone let probes stick at
the cores beside two busy loops: there 2 threads ran at ~2.2x the quiet median, steps at 1.5-2.0x were
common, and 3 of them kept the slower count until contention was detected again.) Probes come
`probe_every` steps apart at first; one that returns waits twice as long before the next, up to
PROBE_BACKOFF x `probe_every`, and one that stays resets the wait. (Each probe is `patience` steps at
the slower count, and one that stayed by noise cost a trial: beside two busy loops the controller ran at
0.46 of quiet speed against 0.52 for a fixed 4 threads, alternated in one process; with the backoff,
0.51 against 0.52 on the 2-core EPYC, `benchmarks/contention.py --against-fixed 4`.) It only ever calls
`set_threads`; the engine calls `observe` once per step.

More threads than cores (`max_over` counts above `max_threads`; the engine passes the core count where
the C kernels are built): with the decode GEMMs and attention on the C kernels' pool, which never waits for
a descheduled thread, extra threads are extra claims on the scheduler's time, not extra barriers to
wait at. On a 2-core AMD EPYC Zen 3 beside two busy loops, held for 128 tokens in steady state: 2
threads kept ~0.36 of the quiet speed, 4 threads ~0.58 (busy loops in sessions of their own, each its
own autogroup: 0.29 and 0.77). A trial then measures the cores and the limit and prefers the limit.
Counts above the cores go to the pool only (the engine gives torch at most `max_threads`).
"""
from __future__ import annotations

import functools
import os
import statistics
from collections import deque
from collections.abc import Callable

import torch

from tokenfab import kernels

PROBE_BACKOFF = 4        # failed probes space the next ones out to at most this many probe_every


def free_cores() -> int | None:
    """Cores in our affinity mask not running another runnable task right now (None: unknown).
    /proc/stat's procs_running counts every runnable task on the machine, ours included."""
    try:
        cores = len(os.sched_getaffinity(0))
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("procs_running"):
                    running = int(line.split()[1])
                    return max(0, cores - max(0, running - 1))     # minus this (stepping) thread
    except (OSError, AttributeError, ValueError):
        pass
    return None


class ThreadController:
    def __init__(self, max_threads: int, *, slow_factor: float = 2.0, quiet_factor: float = 1.3, patience: int = 3,
                 judge: int = 8, block: int = 2, window: int = 31, probe_every: int = 64, min_samples: int = 8,
                 min_gain: float = 0.1,
                 set_threads: Callable[[int], None] = torch.set_num_threads,
                 cores_free: Callable[[], int | None] | None = None, max_over: int = 0):
        self.max_threads = self.threads = max(1, max_threads)
        self.top = self.max_threads + max(0, max_over)     # the most threads a trial may go to
        self.slow_factor, self.quiet_factor = slow_factor, quiet_factor
        self.patience, self.judge, self.block = patience, judge, max(1, block)
        self.probe_every, self.min_samples, self.min_gain = probe_every, min_samples, min_gain
        self._set = set_threads
        self._cores_free = cores_free
        self._quiet: dict[int, deque[float]] = {}      # size bucket -> recent quiet step times at max threads
        self._window = window
        self._slow_run = 0
        self._since_change = 0
        self._trial: dict[int, list[float]] | None = None   # slowdowns at each count a trial measures
        self._turn = 0                                 # steps left at the trial's current count
        self._probe: list[float] | None = None         # slowdowns at a probe's count, while it lasts
        self._probe_from = 0                           # the count a probe returns to when still slow
        self._recent: deque[float] = deque(maxlen=16)  # slowdowns at the current count away from max_threads
        self._probe_ref: float | None = None           # their median when a probe left that count
        self._gap = probe_every                        # steps between probes: doubles while they fail
        self._before = 0                               # the count a trial started from
        self._hold = 0                                 # steps left before another trial may start
        self._lost = 0                                 # trials in a row the count above the cores lost
        self.trials = 0                                # for logs, tests and benchmarks/contention.py
        self.reductions = 0                            # trials that settled below max_threads
        self.raises = 0                                # trials that settled above it
        self.reverts = 0                               # trials that kept the count before

    @staticmethod
    def bucket(num_tokens: int) -> int:
        return max(1, num_tokens - 1).bit_length()

    def candidates(self) -> list[int]:
        """The counts a trial measures, the current one first (the count to beat). With room above the
        cores (the C kernels' pool runs the step): the cores and that limit; fewer threads did not help there
        (EPYC, 2 cores, two busy loops: 2 threads ~0.36 of quiet, 4 threads ~0.58; 1 thread alternated
        between a core of its own and half of one as the OS moved the busy loops, ~0.42 on average, and
        a trial's few steps could not tell which). Without: the cores, half of them and one."""
        counts = [self.max_threads, self.top] if self.top > self.max_threads else \
            [self.max_threads, max(1, self.max_threads // 2), 1]
        return list(dict.fromkeys([self.threads] + counts))

    def _baseline(self, b: int) -> float | None:
        q = self._quiet.get(b)
        return statistics.median(q) if q is not None and len(q) >= self.min_samples else None

    def observe(self, num_tokens: int, seconds: float) -> int:
        """One step's size and wall time; returns the thread count for the next step."""
        b = self.bucket(num_tokens)
        base = self._baseline(b)
        ratio = seconds / base if base is not None else None
        slow = ratio is not None and ratio > self.slow_factor
        self._since_change += 1
        self._hold = max(0, self._hold - 1)
        if self._trial is not None:                # `block` steps at each candidate count, in turn
            if ratio is not None:
                self._trial[self.threads].append(ratio)
                self._turn -= 1
            if self._turn <= 0:
                self._next_candidate()
            return self.threads
        if self._probe is not None:                # `patience` steps at max_threads
            if ratio is not None:
                self._probe.append(ratio)
            if len(self._probe) >= self.patience:
                probe = statistics.median(self._probe)
                here = self._probe_ref
                if probe > self.slow_factor or (probe > self.quiet_factor and here is not None
                                                and probe > (1 - self.min_gain) * here):
                    self._change(self._probe_from)  # still contended: back, probe again later, twice as late
                    self._gap = min(2 * self._gap, PROBE_BACKOFF * self.probe_every)
                else:
                    self._gap = self.probe_every
                self._probe = None
            return self.threads
        if self.threads != self.max_threads and ratio is not None:
            self._recent.append(ratio)
        if self.threads == self.max_threads and (ratio is None or ratio <= self.quiet_factor):
            # near the median only: contended steps just under `slow_factor` (the OS's fast phases) had
            # moved a server's quiet median from 5.7 to 11.3 ms within 60 steps, hiding the contention
            self._quiet.setdefault(b, deque(maxlen=self._window)).append(seconds)
        self._slow_run = self._slow_run + 1 if slow else 0
        if self.threads != self.max_threads:
            if self._since_change >= self._gap:               # has the contention ended?
                free = self._cores_free() if self._cores_free is not None and self.threads < self.max_threads \
                    else None
                if free is None or free >= 1:
                    self._probe_from, self._probe = self.threads, []
                    self._probe_ref = statistics.median(self._recent) if self._recent else None
                    self._change(self.max_threads)
            return self.threads
        crowded = False
        if slow and self._cores_free is not None and self.threads > 1 and self._since_change >= self.patience:
            free = self._cores_free()
            crowded = free is not None and free < self.threads - 1     # /proc/stat: read for slow steps only
        if (self._slow_run >= self.patience or crowded) and self._hold == 0 and len(self.candidates()) > 1:
            self.trials += 1
            self._trial = {n: [] for n in self.candidates()}   # the count before first, measured again
            self._before, self._turn = self.threads, self.block
        return self.threads

    def _next_candidate(self) -> None:
        """The trial's next turn, round robin: slow phases of the machine (the OS moves the busy processes
        between cores every ~0.1-0.2 s) then fall on every count alike. Once each count has `judge`
        steps, the fastest on average (less its worst step) is kept, unless the preferred count is within
        `min_gain` of it: the count before, or with room above the cores, that limit (in steady state it
        beat the cores by 1.6x, more than a trial's few steps resolve; see candidates)."""
        counts = list(self._trial)
        if any(len(r) < self.judge for r in self._trial.values()):
            nxt = counts[(counts.index(self.threads) + 1) % len(counts)]
            self._turn = self.block
            if nxt != self.threads:
                self._change(nxt)
            return
        cost = {n: (sum(r) - max(r)) / (len(r) - 1) if len(r) > 1 else r[0] for n, r in self._trial.items()}
        best = min(cost, key=cost.get)
        prefer = self.top if self.top > self.max_threads else self._before
        if cost[best] >= (1 - self.min_gain) * cost[prefer]:
            best = prefer                          # not clearly faster than the preferred count: that one
        self.reverts += best == self._before
        self.reductions += best < self.max_threads
        self.raises += best > self.max_threads
        if prefer > self.max_threads and best < prefer:
            # The count above the cores lost, often to a passing phase: the first trial of a contention,
            # in its first second, has kept the cores and the next one, 64 steps later, took twice
            # them (measured on an AMD EPYC Zen 3). So the next trial comes sooner: a quarter, then half the hold.
            self._lost += 1
            hold = self.probe_every >> max(0, 3 - self._lost)
        else:
            self._lost, hold = 0, self.probe_every
        self._trial, self._hold = None, hold
        self._change(best)

    def _change(self, n: int) -> None:
        self.threads = max(1, min(self.top, n))
        self._set(self.threads)
        self._recent.clear()
        self._slow_run = 0
        self._since_change = 0


def _set_threads(cores: int, n: int) -> None:
    """The thread controller's count: torch's up to `cores`, the C kernels' pool all of it (above `cores`,
    oversubscribed on purpose: see the module docstring)."""
    torch.set_num_threads(min(n, cores))
    kernels.pool_threads(n if n > cores else 0)


def engine_controller(adaptive: bool, device: str, threads: int) -> ThreadController | None:
    """The engine's controller over `threads` (torch's count at start): torch's up to it, the C kernels' own
    pool (tf_cols, kernels/csrc/pool.c) up to twice that; None when off, not on the CPU or on one thread."""
    if not adaptive or device != "cpu" or threads <= 1:
        return None
    return ThreadController(threads, cores_free=free_cores, max_over=threads if kernels.enabled() else 0,
                            set_threads=functools.partial(_set_threads, threads))
