"""How many completions the code reward judges at once (issue 44): one limit for the whole process, shared by every
call (both trainers, evaluation, several reward functions at once), divided among the ranks on the node, and the
wall-clock cap of a run whose timeout is CPU time.

verl's sandbox runs its requests under a concurrency limit and open-r1's code reward runs its sandboxes in parallel;
here a run mostly waits (two interpreters start, the tests' calls cross a socket), so the default is several runs per
usable CPU where each run's timeout is its own CPU time (a run's cgroup with CPU accounting), and one run per usable
CPU where the timeout is wall time."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
import time
import warnings
from pathlib import Path

import trl_aspo.evaluation.isolation as isolation  # as a module: not through the package

RUNS_PER_CPU = 4  # k of the default `max(2, k x usable CPUs)`: a run mostly waits, and is charged its own CPU time
WALL_SLACK_S = 0.5  # added to a run's wall-clock cap: process starts and socket round trips the CPU budget omits
LOCAL_WORLD_SIZE_ENV = "LOCAL_WORLD_SIZE"  # the ranks on this node (torchrun, accelerate)
_SHARED_NEIGHBOURS = (
    "without namespaces every run's program shares the machine's PID space and user: a program can kill, ptrace "
    "(as root) or read the files and /dev/shm of the programs judged beside it, so a hostile completion can change "
    "its neighbours' verdicts"
)
_warned_shared: list[bool] = []


def usable_cpus() -> int:
    """The CPUs this process may use: its affinity, bounded by its cgroup's CPU quota (v2 `cpu.max`, v1
    `cpu.cfs_quota_us` / `cpu.cfs_period_us`) rounded up; at least 1."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = _cpu_quota()
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)


def _cpu_quota() -> float | None:
    """This process's cgroup CPU quota in CPUs, or None when unlimited or unknown."""
    own = isolation.own_cgroups()
    for mount, kind, options in isolation.mounts():
        if kind == "cgroup2" and "" in own:
            text = _read(f"{mount}{own['']}/cpu.max")
            if text and text.split()[0] != "max":
                quota, period = text.split()
                return int(quota) / int(period)
        elif kind == "cgroup" and "cpu" in options.split(",") and "cpu" in own:
            quota, period = (
                _read(f"{mount}{own['cpu']}/cpu.cfs_quota_us"),
                _read(f"{mount}{own['cpu']}/cpu.cfs_period_us"),
            )
            if quota and period and int(quota) > 0:
                return int(quota) / int(period)
    return None


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


@functools.cache
def available_memory_mb() -> int:
    """The memory available when the code reward is first called (MemAvailable of /proc/meminfo), in MiB; read once,
    since the runs' own memory would lower it later."""
    text = _read("/proc/meminfo") or ""
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    return 0


def default_concurrency(memory_limit_mb: int, cpu_budgets: bool) -> int:
    """The node's default: `max(2, RUNS_PER_CPU x usable CPUs)` where each run's timeout is its own CPU time, else
    the usable CPUs; capped by memory, each run charged `memory_limit_mb` for its program and as much for its judge
    (whose address space has the same bound), against the memory available at the first call; at least 1."""
    cpus = usable_cpus()
    by_cpu = max(2, RUNS_PER_CPU * cpus) if cpu_budgets else cpus
    available = available_memory_mb()
    by_memory = available // (2 * memory_limit_mb) if available else by_cpu
    return max(1, min(by_cpu, by_memory))


def process_limit(
    max_concurrency, memory_limit_mb: int, cpu_budgets: bool, namespaces: bool, allow_shared_neighbours: bool
) -> int:
    """The runs this process judges at once: `max_concurrency` (or `default_concurrency`) for the node, divided by
    `LOCAL_WORLD_SIZE`, at least 1. Without namespaces the runs share the machine's PID space and user: the limit is
    1, and more is refused (ValueError) unless `allow_shared_neighbours`, which warns once naming what neighbours
    can do."""
    if max_concurrency is not None and (
        isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or max_concurrency < 1
    ):
        raise ValueError(f"`max_concurrency` must be None or an integer >= 1, got {max_concurrency!r}")
    if not namespaces:
        if not allow_shared_neighbours:
            if max_concurrency is not None and max_concurrency > 1:
                raise ValueError(
                    f"`max_concurrency`={max_concurrency}: {_SHARED_NEIGHBOURS}. Without namespaces only 1 is "
                    "allowed unless allow_shared_neighbours=True"
                )
            return 1
        if not _warned_shared:
            _warned_shared.append(True)
            warnings.warn(
                f"code_unit_test_reward: allow_shared_neighbours=True: {_SHARED_NEIGHBOURS}",
                RuntimeWarning,
                stacklevel=3,
            )
    node = max_concurrency if max_concurrency is not None else default_concurrency(memory_limit_mb, cpu_budgets)
    return max(1, node // _local_world_size())


def _local_world_size() -> int:
    value = os.environ.get(LOCAL_WORLD_SIZE_ENV, "1")
    return int(value) if value.isdigit() and int(value) >= 1 else 1


def wall_cap(timeout: float, concurrency: int, cpu_budgets: bool) -> float:
    """A run's wall-clock bound: with CPU-time budgets, `timeout x max(1, ceil(concurrency / usable CPUs))` plus
    `WALL_SLACK_S` (what a run would take if every run beside it spun for its whole budget), which ends a sleeping
    program; without them the timeout itself is wall time."""
    if not cpu_budgets:
        return timeout
    return timeout * max(1, math.ceil(concurrency / usable_cpus())) + WALL_SLACK_S


class RunClock:
    """When one run's time is up. With a cgroup that counts CPU time (`RunCgroup.cpu_seconds`): once its processes
    (the cgroup's and the judge) used `timeout` CPU seconds, or once the wall time passed `timeout` + `WALL_SLACK_S`
    + the time they waited for a CPU (runnable, not running: /proc/<pid>/schedstat), and in any case at
    `wall_timeout` (`wall_cap`). A sleeping program ends near `timeout` + slack; one that computes among spinning
    neighbours gets its own `timeout` of CPU time. Without such a cgroup: at `wall_timeout` (wall time)."""

    def __init__(self, timeout: float, wall_timeout: float, cgroup, judge_pid: int):
        self.started = time.monotonic()
        self.timeout, self.cap = timeout, self.started + wall_timeout
        self._cgroup, self._judge = cgroup, judge_pid
        self._counts = cgroup is not None and cgroup.cpu_seconds() is not None
        if self._counts:
            self._cpu_start = self._cpu()
            self._wait_start = self._waits()
            self._waited = 0.0

    def expired(self) -> bool:
        now = time.monotonic()
        if now >= self.cap or not self._counts:
            return now >= self.cap
        if self._cpu() - self._cpu_start > self.timeout:
            return True
        waits = self._waits()
        waited = sum(wait - self._wait_start.get(pid, 0.0) for pid, wait in waits.items())
        self._waited = max(self._waited, waited)
        return now >= self.started + self.timeout + WALL_SLACK_S + self._waited

    def _cpu(self) -> float:
        return (self._cgroup.cpu_seconds() or 0.0) + _process_cpu_seconds(self._judge)

    def _waits(self) -> dict[int, float]:
        """Seconds each process of the run (the cgroup's and the judge) waited for a CPU so far."""
        waits = {}
        for pid in [*self._cgroup.pids(), self._judge]:
            text = _read(f"/proc/{pid}/schedstat")
            if text:
                waits[pid] = int(text.split()[1]) / 1e9
        return waits


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _process_cpu_seconds(pid: int) -> float:
    """User and system CPU time of one process (/proc/<pid>/stat), 0.0 once it is gone."""
    text = _read(f"/proc/{pid}/stat")
    if not text:
        return 0.0
    fields = text.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


class ProcessSlots:
    """The process-wide limit: a run starts only while fewer runs than its call's limit are running in the whole
    process (a counting semaphore whose bound each call brings; calls passing the same limit never exceed it
    together)."""

    def __init__(self):
        self._condition = threading.Condition()
        self.running = 0

    @contextlib.contextmanager
    def slot(self, limit: int):
        with self._condition:
            self._condition.wait_for(lambda: self.running < limit)
            self.running += 1
        try:
            yield
        finally:
            with self._condition:
                self.running -= 1
                self._condition.notify_all()


SLOTS = ProcessSlots()
