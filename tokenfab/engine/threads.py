"""Thread count that holds up when other processes share the cores.

A step runs its GEMMs and C kernels as OpenMP parallel regions, each ending in a barrier. When another
process takes a core, the OS deschedules one of our workers and every barrier waits a whole time
slice for it: on the 2-core VM one stream fell from 103 to 20 tok/s with two busy loops beside the
server, and `tokenfab generate` from 59.6 to 7.7 tok/s, while `--num-threads 1` kept 27.2 (issue 12).

`ThreadController` watches each step's time against the running median of quiet steps of the same
size (token count, in powers of two). `patience` steps in a row slower than `slow_factor` x that
median, or fewer free cores than threads (/proc/stat's running tasks against our affinity mask),
mean contention: it drops one thread. Fewer threads do not always help (with short OpenMP spin waits
two half-cores can beat one two-thirds core), so the drop is a trial: `patience` steps at the lower
count, then `patience` at the count before, both as slowdowns against the quiet median and under the
same contention, and unless the lower count is at least `min_gain` better it stays at the count
before, held there for `probe_every` steps. (Comparing the trial with the slow steps that caused the
drop instead favoured dropping: those are the worst steps at that count, picked for being slow.)
While lowered it probes one thread more every `probe_every` steps and keeps it when the probe step
is no longer slow, so the count comes back when the contention ends. It only ever calls
`set_threads`; the engine calls `observe` once per step.

More threads than cores (`max_over` counts above `max_threads`): with the decode GEMMs and attention on
cpu.c's own pool, which never waits for a descheduled thread, extra threads are extra claims on a fair
scheduler's time and no longer extra barriers to wait at. On the 2-core EPYC beside two busy loops (6
rounds, medians), 3 threads kept 0.47 of the quiet speed, 4 kept 0.42, 2 kept 0.38 and 1 kept 0.44 (a
fair share of 2 cores among 4 runnable threads caps 2 at 0.5). So a contention trial goes up first when
`max_over` allows (the engine passes 0 while the pool is off by default):
the same trial and judgement, one thread more; a rejected trial turns the next one the other way. Above
`max_threads` it probes `max_threads` every `probe_every` steps and stays there when that step is not
slow (the contention has ended and oversubscription only costs). `set_threads` gets the count; the
engine gives torch at most `max_threads` and the pool the rest (tokenfab.kernels.pool_config).
"""
from __future__ import annotations

import os
import statistics
from collections import deque
from collections.abc import Callable

import torch


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
    def __init__(self, max_threads: int, *, slow_factor: float = 2.5, patience: int = 3, window: int = 31,
                 probe_every: int = 64, min_samples: int = 8, min_gain: float = 0.1,
                 set_threads: Callable[[int], None] = torch.set_num_threads,
                 cores_free: Callable[[], int | None] | None = None, max_over: int = 0):
        self.max_threads = self.threads = max(1, max_threads)
        self.top = self.max_threads + max(0, max_over)     # the most threads a trial may go to
        self.slow_factor, self.patience, self.probe_every, self.min_samples = slow_factor, patience, probe_every, min_samples
        self.min_gain = min_gain
        self._set = set_threads
        self._cores_free = cores_free
        self._quiet: dict[int, deque[float]] = {}      # size bucket -> recent quiet step times at max threads
        self._window = window
        self._slow_run = 0
        self._since_change = 0
        self._probing = False
        self._trial: list[float] | None = None         # slowdowns at the trial count, while judging one
        self._control: list[float] | None = None       # then slowdowns back at the count before
        self._before = 0                               # the count before the trial
        self._up = max_over > 0                        # the next trial's direction
        self._probe_from = 0                           # the count a probe returns to when its step is slow
        self._low = 0.0                                # the trial's median slowdown
        self._hold = 0                                 # steps left before another drop may be tried
        self.reductions = 0                            # trials of one thread fewer (for logs/tests)
        self.raises = 0                                # trials of one thread more
        self.reverts = 0                               # trials undone because the count was no faster

    @staticmethod
    def bucket(num_tokens: int) -> int:
        return max(1, num_tokens - 1).bit_length()

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
        if self._trial is not None:                # judging a trial: the trial count's steps first
            if ratio is not None:
                self._trial.append(ratio)
            if len(self._trial) >= self.patience:
                self._low, self._trial, self._control = statistics.median(self._trial), None, []
                cand = self.threads
                self._change(self._before)          # then the count before, under the same contention
                self._before = cand
            return self.threads
        if self._control is not None:
            if ratio is not None:
                self._control.append(ratio)
            if len(self._control) >= self.patience:
                if self._low < (1 - self.min_gain) * statistics.median(self._control):
                    self._change(self._before)      # the trial count was faster: keep it
                else:
                    self._hold = self.probe_every  # no better: stay, and hold off the next trial a while
                    self.reverts += 1
                    self._up = not self._up if self.top > self.max_threads else False
                self._control = None
            return self.threads
        if self._probing:                          # the step just run had the probe's count
            self._probing = False
            if slow:
                self._change(self._probe_from)     # still contended: back, probe again later
            return self.threads
        if self.threads == self.max_threads and not slow:
            self._quiet.setdefault(b, deque(maxlen=self._window)).append(seconds)
        self._slow_run = self._slow_run + 1 if slow else 0
        crowded = False
        if slow and self._cores_free is not None and self.threads > 1 and self._since_change >= self.patience:
            free = self._cores_free()
            crowded = free is not None and free < self.threads - 1     # /proc/stat: read for slow steps only
        contended = self._slow_run >= self.patience or crowded
        up = self._up and self.threads < self.top
        if contended and self._hold == 0 and (up or self.threads > 1):
            self._before, self._trial = self.threads, []
            if up:
                self.raises += 1
            else:
                self.reductions += 1
            self._change(self.threads + 1 if up else self.threads - 1)
        elif self.threads > self.max_threads and self._since_change >= self.probe_every:
            self._probe_from, self._probing = self.threads, True
            self._change(self.max_threads)
        elif self.threads < self.max_threads and self._since_change >= self.probe_every:
            free = self._cores_free() if self._cores_free is not None else None
            if free is None or free >= 1:
                self._probe_from, self._probing = self.threads, True
                self._change(self.threads + 1)
        return self.threads

    def _change(self, n: int) -> None:
        self.threads = max(1, min(self.top, n))
        self._set(self.threads)
        self._slow_run = 0
        self._since_change = 0
