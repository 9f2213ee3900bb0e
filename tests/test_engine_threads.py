"""The thread controller: contention lowers the thread count, and its end restores it."""
from tokenfab.engine.threads import ThreadController, free_cores


def _run(ctl, seconds_per_thread_count, steps, tokens=1):
    seen = []
    for _ in range(steps):
        seen.append(ctl.observe(tokens, seconds_per_thread_count[ctl.threads]))
    return seen


def test_a_synthetic_slow_step_run_reduces_threads_and_quiet_steps_restore_them():
    set_to = []
    ctl = ThreadController(2, patience=3, probe_every=10, set_threads=set_to.append)
    quiet = {2: 0.010, 1: 0.016}           # quiet: two threads beat one
    contended = {2: 0.060, 1: 0.020}       # a busy neighbour: the second thread's barrier waits
    assert set(_run(ctl, quiet, 20)) == {2} and set_to == []
    seen = _run(ctl, contended, 30)
    assert seen[2] == 1 and ctl.reductions == 1       # three slow steps in a row, then one thread
    assert seen.count(2) <= 2 + 30 // 10               # a probe per 10 steps fails and returns to one thread
    assert ctl.reductions == 1
    assert set_to[0] == 1
    seen = _run(ctl, quiet, 30)
    assert seen[-1] == 2 and set_to[-1] == 2           # contention over: the probe sticks


def test_steps_of_other_sizes_do_not_count_as_slow():
    ctl = ThreadController(2, patience=2, set_threads=lambda n: None)
    _run(ctl, {2: 0.010}, 20, tokens=1)
    _run(ctl, {2: 0.200}, 20, tokens=512)              # a prefill: slower, but no baseline of its size yet
    assert ctl.threads == 2 and ctl.reductions == 0


def test_few_free_cores_with_slow_steps_lower_threads_even_before_patience_runs_out():
    ctl = ThreadController(4, patience=3, set_threads=lambda n: None, cores_free=lambda: 0)
    _run(ctl, {4: 0.01, 3: 0.01}, 12)
    ctl.observe(1, 0.05)
    assert ctl.threads == 3


def test_free_cores_reads_a_number_or_none():
    n = free_cores()
    assert n is None or n >= 0
