"""CPU threads (specrt.step.threads, SpecConfig.threads / adaptive_threads):

- available_cores counts the affinity mask's physical cores; the default count respects a count
  the process set;
- the governor drops to half the threads when steps at the full count are slower (a starved
  pool), comes back when they are faster again, backs its trials off while the choice holds, and
  never moves with adaptive_threads=False or one thread;
- an engine runs its steps at the governed count, and greedy output does not depend on the
  thread count (1 and 2 threads, switching mid-request);
- bad settings name the field.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _engine_utils import make_pair, tokens  # noqa: E402

import specrt  # noqa: E402
from specrt import SamplingParams, SpecConfig  # noqa: E402
from specrt.step.threads import (FIRST_TRIAL_AFTER, MAX_TRIAL_GAP, ThreadGovernor, available_cores,  # noqa: E402
                                 default_threads)

TOKENS = [1, 3, 1, 2, 1, 1, 4, 1, 2]    # tokens per step, as a speculative engine emits them


@pytest.fixture(autouse=True)
def _keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def run(gov: ThreadGovernor, steps: int, cost) -> list[int]:
    """Drive the governor: each step's seconds are cost(thread count); returns the counts used."""
    used = []
    for i in range(steps):
        gov.begin()
        n = torch.get_num_threads()
        used.append(n)
        t = TOKENS[i % len(TOKENS)]
        gov.end(cost(n) * t, t)              # a step's time grows with what it emits
    return used


def test_available_cores_is_within_the_affinity_mask():
    n = available_cores()
    assert 1 <= n <= len(os.sched_getaffinity(0))


def test_the_default_keeps_a_count_the_process_set():
    torch.set_num_threads(1)
    assert default_threads() == 1
    logical = len(os.sched_getaffinity(0))
    if logical > 1:
        torch.set_num_threads(logical)          # what torch starts with: the machine decides
        assert default_threads() == available_cores()


def test_a_starved_pool_drops_to_half_and_comes_back():
    gov = ThreadGovernor(2)
    starved = {2: 0.200, 1: 0.010}              # a busy process took a core: every join waits
    used = run(gov, 200, lambda n: starved[n])
    assert gov.current == 1 and gov.switches == 1
    assert used[:FIRST_TRIAL_AFTER] == [2] * FIRST_TRIAL_AFTER
    assert used[-50:].count(1) >= 45            # after the switch almost every step runs at 1
    healthy = {2: 0.006, 1: 0.010}              # the other process ended
    run(gov, 3000, lambda n: healthy[n])
    assert gov.current == 2 and gov.switches == 2


def test_trials_back_off_while_the_choice_holds():
    gov = ThreadGovernor(2)
    healthy = {2: 0.006, 1: 0.010}
    used = run(gov, 20000, lambda n: healthy[n])
    assert gov.current == 2 and gov.switches == 0
    assert used.count(1) / len(used) < 0.01     # the trials' cost on an idle machine
    assert gov._gap == MAX_TRIAL_GAP


def test_a_stall_starts_a_trial_at_once():
    gov = ThreadGovernor(2)
    run(gov, 40, lambda n: 0.006)               # first trial done, the next one far away
    steps, nxt = gov._steps, gov._next_trial
    assert nxt - steps > 8
    gov.begin()
    gov.end(0.5)                                # a step 80x the typical one
    assert gov._next_trial <= gov._steps


@pytest.mark.parametrize("gov", [ThreadGovernor(2, adaptive=False), ThreadGovernor(1)])
def test_pinned_counts_never_move(gov):
    used = run(gov, 500, lambda n: 0.2 if n == gov.threads else 0.001)
    assert set(used) == {gov.threads} and gov.switches == 0


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "2"])
def test_bad_thread_counts_name_the_field(bad):
    with pytest.raises(ValueError, match="threads"):
        SpecConfig(threads=bad)
    with pytest.raises(ValueError, match="adaptive_threads"):
        SpecConfig(adaptive_threads="yes")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("threads"))


def test_greedy_output_does_not_depend_on_the_thread_count(pair):
    prompts = [[5, 6, 7, 8], [11, 12, 13, 14, 15, 16, 17], [20, 21] * 6]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = {}
    for threads in (1, 2):
        llm = specrt.LLM(target=str(pair[0]), draft=str(pair[1]), seed=0,
                         spec=SpecConfig(threads=threads, adaptive_threads=False, max_draft_length=3))
        outs[threads] = tokens(llm.generate(prompts, params))
        assert torch.get_num_threads() == threads and llm.stats()["threads"] == threads
    flip = specrt.LLM(target=str(pair[0]), draft=str(pair[1]), seed=0, spec=SpecConfig(threads=2, max_draft_length=3))
    flip.engine.threads._next_trial = 0          # trial steps alternate 1 and 2 threads mid-request
    assert tokens(flip.generate(prompts, params)) == outs[1] == outs[2]
    plain = specrt.LLM(target=str(pair[0]), draft=None, seed=0, spec=SpecConfig(threads=1))
    assert tokens(plain.generate(prompts, params)) == outs[1]


def test_a_slow_trial_step_ends_the_trial():
    gov = ThreadGovernor(2)
    starved = {2: 0.200, 1: 0.010}
    run(gov, 100, lambda n: starved[n])
    assert gov.current == 1
    used = run(gov, 5000, lambda n: starved[n])
    assert gov.current == 1 and gov.switches == 1
    assert used.count(2) <= 12                  # each trial stops after its first slow step at 2


class FakeLoad:
    """Other processes' load as the test sets it (cores busy), on ``ncpus`` CPUs."""

    available = True

    def __init__(self, ncpus: int = 2, others: float = 0.0):
        self.ncpus, self.value, self.reads = ncpus, others, 0

    def due(self):
        return True

    def others(self):
        self.reads += 1
        return self.value


def test_a_busy_core_seen_in_the_load_is_left_alone_from_the_first_step():
    """Another process spinning a core: the governor runs at one thread from its first step (no
    steps lost at two before a trial finds it) and tries two again only once the core is free."""
    from specrt.step.threads import LOAD_HOLD

    load = FakeLoad(2, others=1.0)
    gov = ThreadGovernor(2, load=load)
    starved = {2: 0.200, 1: 0.010}
    used = run(gov, 2000, lambda n: starved[n])
    assert used.count(2) == 0 and gov.current == 1 and gov.switches == 1
    load.value = 0.05                                       # the other process ended
    healthy = {2: 0.006, 1: 0.010}
    used = run(gov, 3 * LOAD_HOLD, lambda n: healthy[n])
    assert gov.current == 2 and used[-LOAD_HOLD:] == [2] * LOAD_HOLD


def test_the_load_reading_drops_to_the_cores_left():
    load = FakeLoad(8, others=2.6)                          # 8 cores, ~3 taken
    gov = ThreadGovernor(8, load=load)
    used = run(gov, 100, lambda n: 0.01)
    assert used[0] == 5 and gov.current == 5


@pytest.mark.parametrize("others", [None, 0.0, 0.4])
def test_an_idle_or_unknown_load_changes_nothing(others):
    gov, ref = ThreadGovernor(2, load=FakeLoad(2, others)), ThreadGovernor(2)
    healthy = {2: 0.006, 1: 0.010}
    assert run(gov, 3000, lambda n: healthy[n]) == run(ref, 3000, lambda n: healthy[n])


def test_cpu_load_sees_a_spinning_process():
    """The real reading: a child process spinning one core shows as about one core of load (this
    process's own CPU time is not counted)."""
    import subprocess
    import time

    from specrt.step.threads import CpuLoad

    if not os.path.exists("/proc/stat") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs Linux /proc/stat and two CPUs")
    load = CpuLoad()
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        load.others()                      # from here: the child alone
        t0 = time.monotonic()
        while time.monotonic() - t0 < 0.5:
            sum(i * i for i in range(10_000))   # this process busy too: its own time must not count
        seen = load.others()
    finally:
        spin.kill()
        spin.wait()
    assert seen is not None and 0.7 <= seen <= load.ncpus


def test_the_load_is_read_by_the_clock_not_every_step():
    """Readings come every LOAD_WINDOW seconds (a clock read per step, the file only then)."""
    import time

    from specrt.step.threads import LOAD_WINDOW, CpuLoad

    load = CpuLoad()
    if not load.available:
        pytest.skip("needs Linux /proc/stat")
    load.others()
    assert not load.due() or LOAD_WINDOW == 0
    time.sleep(LOAD_WINDOW * 1.2)
    assert load.due()
