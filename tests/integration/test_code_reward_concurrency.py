"""Issue 44 items 1-2: a batch is judged concurrently under one process-wide, node-aware limit, with the same
verdicts in the same order, and a run's timeout is the CPU time of its own processes, with a wall-clock cap.

Real subprocesses throughout; the overlap is observed from outside the limiter (the judges alive at once, seen in
/proc, and the batch's wall time). The code before issue 44 judged one completion after another, whatever
`max_concurrency` said (it went into `**kwargs`)."""

from __future__ import annotations

import math
import os
import threading
import time
import warnings

import pytest

from trl_aspo.evaluation import concurrency
from trl_aspo.evaluation import isolation as probes
from trl_aspo.evaluation.rewards import code_unit_test_reward

ADD_TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]
RIGHT = "def add(a, b):\n    return a + b"
WRONG = "def add(a, b):\n    return a - b"
SPIN = "while True:\n    pass"
SLEEP = "import time\ntime.sleep(60)"


def _program(source: str) -> str:
    return f"```python\n{source}\n```"


def _sleeping_then_right(seconds: float) -> str:
    return _program(f"import time\ntime.sleep({seconds})\n{RIGHT}")


def _needs_cpu_budgets():
    if not probes.sandbox_isolates_network():
        pytest.skip("user namespaces (unshare) do not work on this machine")
    parents = probes.sandbox_cgroup()
    if not (isinstance(parents, probes.CgroupParents) and parents.counts_cpu):
        pytest.skip("no cgroup that counts CPU time here: the timeout is wall time (documented)")


class JudgeCounter:
    """Counts this process's judges alive at once (children whose command line ends in `judge`), every 5 ms."""

    def __init__(self):
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self):
        me = os.getpid()
        while not self._stop.is_set():
            alive = 0
            for entry in filter(str.isdigit, os.listdir("/proc")):
                try:
                    with open(f"/proc/{entry}/stat") as stat:
                        parent = int(stat.read().rsplit(")", 1)[1].split()[1])
                    with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                        judge = cmdline.read().endswith(b"\0judge\0")
                except (OSError, ValueError, IndexError):
                    continue
                alive += parent == me and judge
            self.peak = max(self.peak, alive)
            time.sleep(0.005)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


@pytest.mark.parametrize("limit", [1, 3])
def test_two_threads_calling_the_reward_never_run_more_than_the_limit_together(limit):
    """Two calls at once, each of four completions that sleep 0.4 s: never more than `limit` judges alive in the
    process (the limit is the process's, not each call's: two calls with limit 1 ran 2 at once before), the limit
    reached, and the eight sleeps take at least 8 x 0.4 / limit seconds."""
    _needs_cpu_budgets()
    batch = [_sleeping_then_right(0.4)] * 4
    results = []

    def call():
        results.append(code_unit_test_reward(batch, [ADD_TESTS] * 4, timeout=5.0, max_concurrency=limit))

    started = time.monotonic()
    with JudgeCounter() as counter:
        threads = [threading.Thread(target=call) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    elapsed = time.monotonic() - started
    assert results == [[1.0] * 4, [1.0] * 4]
    assert counter.peak == limit
    assert elapsed >= 8 * 0.4 / limit


def test_verdicts_are_the_same_and_in_order_at_any_concurrency():
    _needs_cpu_budgets()
    sources = [RIGHT, WRONG, "raise SystemExit(0)", RIGHT, "def add(a, b):\n    return None", RIGHT, WRONG, RIGHT]
    expected = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    for limit in (1, 4):
        with JudgeCounter() as counter:
            given = code_unit_test_reward([_program(s) for s in sources], [ADD_TESTS] * 8, max_concurrency=limit)
        assert given == expected
        assert counter.peak <= limit


def test_a_correct_completion_among_seven_spinners_is_not_failed_by_their_cpu_use():
    """Issue 44's case: a correct program needing 0.78 CPU seconds among 7 that spin, concurrency 8, timeout 2 s. With
    a wall-clock timeout it scored 0.0 (a quarter of a core for 2 s); its budget is now its own CPU time. All eight
    end by the wall cap, 2 x ceil(8 / CPUs) + 0.5 s after they started: the batch takes less than that plus 3 s
    (one after another it took 7 x 2 s = 14 s)."""
    _needs_cpu_budgets()
    slow = _program(f"import time\nwhile time.process_time() < 0.78:\n    pass\n{RIGHT}")
    cap = 2.0 * max(1, math.ceil(8 / concurrency.usable_cpus())) + concurrency.WALL_SLACK_S
    started = time.monotonic()
    given = code_unit_test_reward([slow] + [_program(SPIN)] * 7, [ADD_TESTS] * 8, timeout=2.0, max_concurrency=8)
    elapsed = time.monotonic() - started
    assert given == [1.0] + [0.0] * 7
    assert elapsed < min(cap + 3, 14), elapsed


def test_sleeping_completions_overlap_and_end_after_their_timeout_and_slack():
    """Eight programs that sleep, concurrency 8, timeout 1 s: each ends once the wall time passed its timeout plus
    0.5 s of slack (it waited for no CPU), all at once: the batch takes at least 1.5 s and less than the wall cap
    (1 x ceil(8 / CPUs) + 0.5 s) plus 3 s, where one after another took 8 s."""
    _needs_cpu_budgets()
    cap = 1.0 * max(1, math.ceil(8 / concurrency.usable_cpus())) + concurrency.WALL_SLACK_S
    started = time.monotonic()
    given = code_unit_test_reward([_program(SLEEP)] * 8, [ADD_TESTS] * 8, timeout=1.0, max_concurrency=8)
    elapsed = time.monotonic() - started
    assert given == [0.0] * 8
    assert 1.0 + concurrency.WALL_SLACK_S <= elapsed < min(cap + 3, 8), elapsed


def test_the_limit_is_for_the_node_divided_by_the_local_ranks(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert concurrency.process_limit(8, 512, True, True, False) == 2
    assert concurrency.process_limit(3, 512, True, True, False) == 1  # at least 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    cpus, memory = concurrency.usable_cpus(), concurrency.available_memory_mb()
    assert concurrency.process_limit(None, 512, True, True, False) == max(1, min(max(2, 4 * cpus), memory // 1024))
    assert concurrency.process_limit(None, 512, False, True, False) == max(1, min(cpus, memory // 1024))
    for wrong in (0, -1, 1.5, True, "4"):
        with pytest.raises(ValueError, match=r"`max_concurrency` must be None or an integer >= 1"):
            concurrency.process_limit(wrong, 512, True, True, False)


@pytest.fixture
def without_namespaces(monkeypatch):
    monkeypatch.setattr(probes, "sandbox_isolates_network", lambda: False)
    monkeypatch.setattr(probes, "_warned", [])
    monkeypatch.setattr(concurrency, "_warned_shared", [])
    monkeypatch.setenv("TRL_ASPO_ALLOW_UNCONFINED_ROOT", "1")


def test_without_namespaces_runs_are_one_at_a_time_unless_shared_neighbours_are_allowed(without_namespaces):
    batch, tests = [_sleeping_then_right(0.3)] * 4, [ADD_TESTS] * 4
    with pytest.raises(ValueError, match=r"`max_concurrency`=2: without namespaces .* allow_shared_neighbours=True"):
        code_unit_test_reward(batch, tests, max_concurrency=2)
    with warnings.catch_warnings(record=True) as caught, JudgeCounter() as counter:
        warnings.simplefilter("always")
        assert code_unit_test_reward(batch, tests) == [1.0] * 4
    assert counter.peak == 1
    assert not any("allow_shared_neighbours" in str(warning.message) for warning in caught)
    with warnings.catch_warnings(record=True) as caught, JudgeCounter() as counter:
        warnings.simplefilter("always")
        assert code_unit_test_reward(batch, tests, max_concurrency=2, allow_shared_neighbours=True) == [1.0] * 4
    assert counter.peak == 2
    shared = [str(warning.message) for warning in caught if "allow_shared_neighbours=True" in str(warning.message)]
    assert len(shared) == 1 and "can kill, ptrace (as root) or read the files and /dev/shm" in shared[0]
