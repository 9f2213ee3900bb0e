"""The thread controller: contention lowers the thread count, and its end restores it."""
from tokenfab.engine.threads import PROBE_BACKOFF, ThreadController, free_cores


def _run(ctl, seconds_per_thread_count, steps, tokens=1):
    seen = []
    for _ in range(steps):
        seen.append(ctl.observe(tokens, seconds_per_thread_count[ctl.threads]))
    return seen


def test_a_synthetic_slow_step_run_reduces_threads_and_quiet_steps_restore_them():
    set_to = []
    ctl = ThreadController(2, patience=3, judge=4, block=2, probe_every=10, set_threads=set_to.append)
    quiet = {2: 0.010, 1: 0.016}           # quiet: two threads beat one
    contended = {2: 0.060, 1: 0.020}       # a busy neighbour: the second thread's barrier waits
    assert set(_run(ctl, quiet, 20)) == {2} and set_to == []
    seen = _run(ctl, contended, 40)
    # three slow steps start a trial: two steps at two threads, two at one, again, then the faster
    assert seen[:11] == [2, 2, 2, 2, 1, 1, 2, 2, 1, 1, 1] and ctl.trials == 1 and ctl.reductions == 1
    assert set_to[:4] == [1, 2, 1, 1]
    # then a probe of `patience` steps at two threads per 10 steps, which fails and returns to one
    assert seen[20:24] == [2, 2, 2, 1] and seen[-1] == 1 and ctl.trials == 1
    seen = _run(ctl, quiet, 30)
    assert seen[-1] == 2 and set_to[-1] == 2           # contention over: the probe sticks


def test_steps_of_other_sizes_do_not_count_as_slow():
    ctl = ThreadController(2, patience=2, set_threads=lambda n: None)
    _run(ctl, {2: 0.010}, 20, tokens=1)
    _run(ctl, {2: 0.200}, 20, tokens=512)              # a prefill: slower, but no baseline of its size yet
    assert ctl.threads == 2 and ctl.reductions == 0


def test_few_free_cores_with_slow_steps_start_a_trial_before_patience_runs_out():
    ctl = ThreadController(4, patience=3, judge=2, set_threads=lambda n: None, cores_free=lambda: 0)
    _run(ctl, {4: 0.01}, 12)
    ctl.observe(1, 0.05)
    assert ctl.trials == 1
    assert _run(ctl, {4: 0.05, 2: 0.02, 1: 0.03}, 6) == [4, 2, 2, 1, 1, 2]    # the fastest measured


def test_free_cores_reads_a_number_or_none():
    n = free_cores()
    assert n is None or n >= 0


def test_a_count_that_is_not_clearly_faster_is_not_kept_and_trials_are_held_off():
    set_to = []
    ctl = ThreadController(2, patience=3, judge=3, probe_every=10, set_threads=set_to.append)
    _run(ctl, {2: 0.010}, 20)
    # Contended, but one thread (two thirds of a core) is no faster than two half-cores.
    seen = _run(ctl, {2: 0.030, 1: 0.029}, 60)
    assert ctl.reverts >= 3 and ctl.reductions == 0                  # within min_gain: two threads kept
    assert ctl.trials <= ctl.reverts + 1                             # (the last may still be running)
    assert seen.count(1) <= 4 * ctl.trials                           # `judge` steps at one per trial
    assert ctl.trials <= 60 // (10 + 8) + 1                          # and each holds off the next


def test_a_count_that_helps_is_kept():
    ctl = ThreadController(2, patience=3, probe_every=100, set_threads=lambda n: None)
    _run(ctl, {2: 0.010}, 20)
    seen = _run(ctl, {2: 0.030, 1: 0.020}, 30)
    assert ctl.reductions == 1 and ctl.reverts == 0 and seen[-1] == 1


def test_a_trial_measures_the_count_before_again_not_the_slow_steps_that_started_it():
    """A burst of slow steps starts the trial, but those are the worst two-thread steps: judged against
    them, a slower one-thread count looked like a gain. The typical two-thread steps measured first in
    the trial are faster than one thread, so two threads stay."""
    ctl = ThreadController(2, patience=3, judge=4, block=2, probe_every=50, set_threads=lambda n: None)
    _run(ctl, {2: 0.010}, 20)
    _run(ctl, {2: 0.035}, 3)                       # a burst: three steps 3.5x the quiet median
    assert ctl.trials == 1 and ctl.threads == 2
    seen = _run(ctl, {2: 0.022, 1: 0.028}, 14)     # contended: two threads (2.2x) beat one (2.8x)
    assert seen[:8] == [2, 1, 1, 2, 2, 1, 1, 2]    # two steps each, in turn, from the count before
    assert ctl.reverts == 1 and set(seen[7:]) == {2}


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
    """The C kernels' pool does not wait for descheduled threads, so beside busy processes more threads than
    cores claim more of a fair scheduler's time: a trial measures max_threads + max_over too, keeps it
    while it is the fastest, and a probe of the core count every `probe_every` steps returns there once
    the contention has ended."""
    set_to = []
    ctl = ThreadController(2, patience=3, judge=4, block=2, probe_every=20, max_over=2, set_threads=set_to.append)
    assert ctl.candidates() == [2, 4]
    _run(ctl, {2: 0.010}, 20)
    contended = {2: 0.030, 4: 0.016}
    seen = _run(ctl, contended, 52)
    assert seen[:11] == [2, 2, 2, 2, 4, 4, 2, 2, 4, 4, 4]    # 3 slow, then 2 and 4 in turn, 2 steps each
    assert seen[30:34] == [2, 2, 2, 4]             # a probe of the cores, still slow: back
    assert seen[-1] == 4 and ctl.raises == 1 and ctl.reductions == 0 and ctl.trials == 1
    assert set(set_to) == {2, 4}                             # never above max_threads + max_over
    quiet = {2: 0.010, 4: 0.014}                             # oversubscribed in quiet: slower, not slow
    seen = _run(ctl, quiet, 30)
    assert seen[-1] == 2 and set_to[-1] == 2


def test_a_probe_returns_when_the_cores_are_slower_than_the_count_it_left_even_if_not_slow():
    """Contended steps at the cores can sit just under the slow factor; the probe compares them with the
    steps at the count it came from, and returns there while that count is faster."""
    ctl = ThreadController(2, patience=3, judge=4, block=2, probe_every=20, max_over=2, set_threads=lambda n: None)
    _run(ctl, {2: 0.010}, 20)
    seen = _run(ctl, {2: 0.030, 4: 0.016}, 20)    # contention: a trial settles on 4
    assert seen[-1] == 4 and ctl.raises == 1
    seen = _run(ctl, {2: 0.019, 4: 0.015}, 60)     # 2 threads 1.9x the quiet median: not slow, but slower
    assert seen.count(2) <= 3 * 3 and seen[-1] == 4 and ctl.trials == 1
    seen = _run(ctl, {2: 0.011, 4: 0.014}, PROBE_BACKOFF * 20 + 3)   # the contention ends: 2 threads are
    assert seen[-1] == 2                                              # faster again, found by the next probe


def test_failed_probes_come_twice_as_late_each_time_up_to_the_backoff_and_a_kept_one_resets_it():
    """Each probe costs `patience` steps at the slower count while the contention lasts: after one
    fails the next waits twice as long, up to PROBE_BACKOFF x probe_every, so a long contention costs
    a probe per 80 steps here instead of per 20; the count comes back at most that late when it ends."""
    ctl = ThreadController(2, patience=3, judge=4, block=2, probe_every=20, max_over=2, set_threads=lambda n: None)
    _run(ctl, {2: 0.010}, 20)
    _run(ctl, {2: 0.030, 4: 0.016}, 20)           # a trial settles on 4
    seen = _run(ctl, {2: 0.030, 4: 0.016}, 400)
    starts = [i for i in range(1, len(seen)) if seen[i] == 2 and seen[i - 1] == 4]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps[:4] == [40 + 3, 80 + 3, 80 + 3, 80 + 3] and ctl.trials == 1
    seen = _run(ctl, {2: 0.010, 4: 0.014}, 80 + 3)
    assert seen[-1] == 2 and ctl._gap == 20       # back at the cores, and probes as often as at first
    seen = _run(ctl, {2: 0.010}, 10)
    assert set(seen) == {2}


def test_more_threads_than_cores_are_kept_unless_clearly_slower():
    """Above the cores is the preferred count under contention: a tie keeps it, a clear loss does not."""
    ctl = ThreadController(2, patience=3, judge=4, probe_every=10, max_over=2, set_threads=lambda n: None)
    _run(ctl, {2: 0.010}, 20)
    seen = _run(ctl, {2: 0.030, 4: 0.031}, 20)
    assert ctl.trials == 1 and ctl.raises == 1 and seen[-1] == 4
    ctl = ThreadController(2, patience=3, judge=4, probe_every=10, max_over=2, set_threads=lambda n: None)
    _run(ctl, {2: 0.010}, 20)
    seen = _run(ctl, {2: 0.030, 4: 0.036}, 40)
    assert ctl.trials >= 2 and ctl.raises == 0 and ctl.reverts >= ctl.trials - 1
    assert seen[-1] == 2 or ctl.trials > ctl.reverts          # 2 threads, but while a trial measures 4


def test_after_the_count_above_the_cores_loses_a_trial_the_next_trial_comes_sooner_then_later():
    """The first trial of a contention can catch a passing phase where more threads than cores run
    slower: the next trial then waits a quarter of `probe_every`, then half, then all of it."""
    ctl = ThreadController(2, patience=3, judge=4, block=2, probe_every=40, max_over=2, set_threads=lambda n: None)
    _run(ctl, {2: 0.010}, 20)
    seen = _run(ctl, {2: 0.030, 4: 0.036}, 11)     # 3 slow steps, an 8-step trial: 4 threads lose
    assert ctl.trials == 1 and ctl.reverts == 1 and seen[-1] == 2
    seen = _run(ctl, {2: 0.030, 4: 0.016}, 10 + 8 + 1)   # the phase passes: a 10-step hold, a trial
    assert ctl.trials == 2 and ctl.raises == 1 and seen[-1] == 4
    ctl = ThreadController(2, patience=3, judge=4, block=2, probe_every=40, max_over=2, set_threads=lambda n: None)
    _run(ctl, {2: 0.010}, 20)
    seen = _run(ctl, {2: 0.030, 4: 0.036}, 300)    # 4 threads always slower: trials spaced out again
    starts = [i for i in range(4, len(seen)) if seen[i] == 4 and seen[i - 4:i] == [2, 2, 2, 2]]
    gaps = [b - a for a, b in zip(starts, starts[1:])]        # a trial's 8 steps, then its hold
    assert ctl.raises == 0 and gaps[:4] == [8 + 10, 8 + 20, 8 + 40, 8 + 40]


def test_contended_steps_just_under_the_slow_factor_do_not_become_the_quiet_median():
    ctl = ThreadController(2, patience=3, set_threads=lambda n: None)
    _run(ctl, {2: 0.010}, 20)
    _run(ctl, {2: 0.019}, 40)                      # 1.9x: not slow, and not quiet either
    assert ctl._baseline(1) == 0.010
    _run(ctl, {2: 0.012}, 40)                      # a slow drift (longer contexts) is followed
    assert ctl._baseline(1) == 0.012 and ctl.trials == 0


def test_without_room_above_the_cores_a_trial_measures_only_the_cores_and_fewer():
    ctl = ThreadController(8, max_over=0, set_threads=lambda n: None)
    assert ctl.candidates() == [8, 4, 1]
