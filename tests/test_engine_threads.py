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
    # two steps before the drop, `patience` at two threads again to judge it, and a probe per 10 steps
    # that fails and returns to one thread
    assert seen.count(2) <= 2 + 3 + 30 // 10
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


def test_a_drop_that_does_not_speed_steps_up_is_undone_and_held_off():
    set_to = []
    ctl = ThreadController(2, patience=3, probe_every=10, set_threads=set_to.append)
    _run(ctl, {2: 0.010}, 20)
    # Contended, but one thread (two thirds of a core) is no faster than two half-cores.
    seen = _run(ctl, {2: 0.030, 1: 0.032}, 60)
    assert ctl.reductions >= 1 and ctl.reverts == ctl.reductions     # every trial of one thread undone
    assert seen.count(1) <= 3 * ctl.reductions                       # each trial lasts `patience` steps
    assert ctl.reductions <= 60 // 10 + 1                             # and a revert holds off the next one


def test_a_drop_that_helps_is_kept():
    ctl = ThreadController(2, patience=3, probe_every=100, set_threads=lambda n: None)
    _run(ctl, {2: 0.010}, 20)
    seen = _run(ctl, {2: 0.030, 1: 0.020}, 30)
    assert ctl.reductions == 1 and ctl.reverts == 0 and seen[-1] == 1


def test_a_drop_is_judged_against_the_count_before_measured_again_not_the_slow_steps_that_caused_it():
    """A burst of slow steps triggers the drop, but those are the worst two-thread steps: judged against
    them, a slower one-thread count looked like a gain. The typical two-thread steps measured after the
    trial are faster than one thread, so the thread comes back."""
    ctl = ThreadController(2, patience=3, probe_every=50, set_threads=lambda n: None)
    _run(ctl, {2: 0.010}, 20)
    _run(ctl, {2: 0.035}, 3)                       # a burst: three steps 3.5x the quiet median
    assert ctl.threads == 1 and ctl.reductions == 1
    seen = _run(ctl, {2: 0.022, 1: 0.028}, 12)     # contended: two threads (2.2x) beat one (2.8x)
    assert seen[:3] == [1, 1, 2] and seen[3:6] == [2, 2, 2]   # the trial, then the count before again
    assert ctl.reverts == 1 and set(seen[5:]) == {2}


def test_importing_tokenfab_shortens_openmps_spin_wait_unless_the_user_set_one():
    """libgomp reads GOMP_SPINCOUNT when torch loads it, so tokenfab sets its default on import, first."""
    import os
    import subprocess
    import sys
    code = "import tokenfab, torch, os; print(os.environ['GOMP_SPINCOUNT'])"
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip() == "20000"
    env["GOMP_SPINCOUNT"] = "300000"
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip() == "300000"


def test_with_room_above_the_cores_contention_raises_the_count_and_quiet_steps_bring_it_back():
    """cpu.c's pool does not wait for descheduled threads, so beside busy processes more threads than
    cores claim more of a fair scheduler's time: trials go up first, are kept while they help, and a probe
    of the core count every `probe_every` steps returns there once the contention has ended."""
    set_to = []
    ctl = ThreadController(2, patience=3, probe_every=20, max_over=2, set_threads=set_to.append)
    _run(ctl, {2: 0.010}, 20)
    contended = {1: 0.025, 2: 0.030, 3: 0.026, 4: 0.016}     # 3 still slow (2.6x quiet): it goes on up
    seen = _run(ctl, contended, 40)
    assert max(seen) == 4 and seen[-1] == 4 and ctl.raises >= 2 and ctl.reductions == 0
    assert max(set_to) == 4                                  # never above max_threads + max_over
    quiet = {2: 0.010, 3: 0.013, 4: 0.014}                   # oversubscribed in quiet: slower, not slow
    seen = _run(ctl, quiet, 30)
    assert seen[-1] == 2 and set_to[-1] == 2


def test_a_raise_that_does_not_help_is_undone_and_the_next_trial_goes_down():
    ctl = ThreadController(2, patience=3, probe_every=10, max_over=2, set_threads=lambda n: None)
    _run(ctl, {2: 0.010}, 20)
    seen = _run(ctl, {1: 0.020, 2: 0.030, 3: 0.031}, 40)
    assert ctl.raises >= 1 and ctl.reductions >= 1 and seen[-1] == 1
    assert ctl.reverts >= 1 and 3 not in seen[-10:]
