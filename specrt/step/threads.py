"""CPU threads for the kernels: a default count that fits the machine, and a governor that drops
to fewer threads while the pool is starved.

The kernels' parallel loops (at::parallel_for, OpenMP) split a range statically and join every
thread at the end of each loop. When another process takes one of the cores, every join waits
for the descheduled thread's next time slice, and a decode step of a few hundred loops slows
down many times over. ``ThreadGovernor`` times the engine's steps at the configured count and,
in short interleaved trials, at half of it, and runs at whichever emits tokens faster; trials
back off while the choice holds, so an idle machine pays almost nothing for them.
``CpuLoad`` sees the other processes directly: every 0.1 s it reads how many cores they kept
busy (``/proc/stat`` less this process's own CPU time), so the governor runs at the cores left
from its first step on, without first losing steps at a starved count, and tries the full count
again only once they are free.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

import torch

TRIAL_STEPS = 8           # steps per trial, alternating the two counts (4 each)
FIRST_TRIAL_AFTER = 8     # steps before the first trial
GAP_AFTER_SWITCH = 64     # steps to the next trial after the choice changed
MAX_TRIAL_GAP = 4096      # steps between trials at most (the gap doubles while the choice holds)
MARGIN = 0.15             # the other count must take this much less time per token to switch
STALL_FACTOR = 4.0        # a step at the full count this many times the typical one starts a trial at once
TRIAL_ABORT = 2.0         # a trial step at the other count this many times the typical one ends the trial
LOAD_WINDOW = 0.1         # seconds between readings of the other processes' load (/proc/stat counts 10 ms ticks)
LOAD_HOLD = 16            # steps a reading of taken cores holds trials of the full count back


def available_cores() -> int:
    """Physical cores this process may run on: the CPU affinity mask with SMT siblings counted
    once, capped by a cgroup CPU quota (containers)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for c in cpus:
        try:
            cores.add(Path(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list").read_text().strip())
        except OSError:
            cores.add(str(c))
    n = len(cores)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            n = min(n, max(1, int(int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, n)


def default_threads() -> int:
    """The count for ``SpecConfig(threads=None)``: torch's when the process set one (or
    OMP_NUM_THREADS did), else ``available_cores()``. torch's own default counts logical CPUs,
    so an unset count is one equal to the affinity mask's size."""
    n = torch.get_num_threads()
    logical = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if os.environ.get("OMP_NUM_THREADS") or n != logical:
        return n
    return available_cores()


class CpuLoad:
    """How many cores other processes keep busy on the CPUs this process may run on: their busy
    time in ``/proc/stat`` (steal included: a hypervisor's other guests) less this process's own CPU
    time, over the span since the last reading. ``others()`` is None where /proc/stat is missing
    (not Linux) or the span is shorter than ``LOAD_WINDOW``."""

    def __init__(self):
        self.cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self.ncpus = len(self.cpus) or (os.cpu_count() or 1)
        self._names = {f"cpu{c}" for c in self.cpus}
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last = self._read()
        self.available = self._last is not None      # False: no /proc/stat (not Linux)

    def _read(self) -> tuple[float, float, float] | None:
        """(monotonic seconds, busy seconds of the watched CPUs, this process's CPU seconds)."""
        try:
            text = Path("/proc/stat").read_text()
        except OSError:
            return None
        busy = 0
        for line in text.splitlines():
            f = line.split()
            if f and f[0] in self._names:      # user nice system idle iowait irq softirq steal ...
                v = [int(x) for x in f[1:9]]
                busy += v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
        own = os.times()
        return time.monotonic(), busy / self._tick, own.user + own.system

    def due(self) -> bool:
        """Whether ``LOAD_WINDOW`` has passed since the last reading (a clock read, no file)."""
        return self._last is None or time.monotonic() - self._last[0] >= LOAD_WINDOW

    def others(self) -> float | None:
        now = self._read()
        if now is None or self._last is None:
            self._last = now
            return None
        span = now[0] - self._last[0]
        if span < LOAD_WINDOW:
            return None
        busy = (now[1] - self._last[1]) - (now[2] - self._last[2])
        self._last = now
        return max(busy / span, 0.0)


@dataclass
class ThreadGovernor:
    """The thread count of each engine step. ``threads``: the most it uses; ``adaptive``: try half
    of it now and then and keep the faster (off: always ``threads``); ``load``: the other
    processes' load (a ``CpuLoad``; None: trials alone decide)."""

    threads: int
    adaptive: bool = True
    load: CpuLoad | None = None
    current: int = 0                  # the count steps run at outside trials
    switches: int = 0                 # times the choice changed
    _steps: int = 0
    _next_trial: int = FIRST_TRIAL_AFTER
    _gap: int = FIRST_TRIAL_AFTER
    _trial: list[tuple[int, float, int]] = field(default_factory=list)   # (count, seconds, tokens) of the trial
    _typical: float = 0.0             # a running median-ish step time at ``current``
    _this_step: int = 0

    def __post_init__(self) -> None:
        self.current = self.threads
        if self.load is not None and not self.load.available:
            self.load = None

    @property
    def low(self) -> int:
        return max(1, self.threads // 2)

    def begin(self) -> None:
        """Before a step: set torch's thread count (on this thread) for it."""
        if self.load is not None and self.adaptive and self.threads > 1 and not self._trial and self.load.due():
            self._follow_load()
        n = self.current
        if self.adaptive and self.threads > 1 and (self._trial or self._steps >= self._next_trial):
            other = self.low if self.current == self.threads else self.threads
            n = other if len(self._trial) % 2 == 0 else self.current
        self._this_step = n
        torch.set_num_threads(n)            # every step: a server's step thread keeps its own count

    def end(self, seconds: float, tokens: int = 1) -> None:
        """After a step that took ``seconds`` and emitted ``tokens``."""
        if not self.adaptive or self.threads == 1:
            return
        self._steps += 1
        in_trial = bool(self._trial) or self._steps > self._next_trial
        if in_trial:
            self._trial.append((self._this_step, seconds, max(tokens, 0)))
            stalled = self._this_step != self.current and self._typical and seconds > TRIAL_ABORT * self._typical
            if len(self._trial) >= TRIAL_STEPS or stalled:    # (a slow step at the other count ends it at once)
                self._decide()
            return
        if self.current == self.threads and self._typical and seconds > STALL_FACTOR * self._typical:
            self._next_trial = self._steps       # a stall at the full count: try half of it at once
        self._typical = seconds if not self._typical else 0.9 * self._typical + 0.1 * seconds

    def _follow_load(self) -> None:
        """Run at the cores the other processes leave free: drop to them at once; no trial of the
        full count while they stay taken; a trial as soon as they are free again."""
        others = self.load.others()
        if others is None:
            return
        fits = max(1, min(self.threads, round(self.load.ncpus - others)))
        if fits < self.current:
            self.current, self.switches, self._typical = fits, self.switches + 1, 0.0
            self._next_trial = self._steps + GAP_AFTER_SWITCH
        elif fits < self.threads:
            self._next_trial = max(self._next_trial, self._steps + LOAD_HOLD)
        elif self.current < self.threads:
            self._next_trial = min(self._next_trial, self._steps)

    def _per_token(self, n: int) -> float:
        """Seconds per emitted token of the trial's steps at ``n`` threads."""
        secs = sum(s for c, s, _ in self._trial if c == n)
        return secs / max(1, sum(t for c, _, t in self._trial if c == n))

    def _decide(self) -> None:
        other = self.low if self.current == self.threads else self.threads
        t_other = self._per_token(other)
        # (a trial ended by a stall before any step at the current count keeps the current count)
        t_cur = self._per_token(self.current) if any(c == self.current for c, _, _ in self._trial) else 0.0
        typical = median(s for c, s, _ in self._trial if c == other)
        self._trial.clear()
        if t_other < (1.0 - MARGIN) * t_cur:
            self.current, self.switches, self._gap, self._typical = other, self.switches + 1, GAP_AFTER_SWITCH, typical
        else:
            self._gap = min(2 * self._gap, MAX_TRIAL_GAP)
        self._next_trial = self._steps + self._gap
