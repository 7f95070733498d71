"""Issue 45 item 3: the reward call returns within `timeout` + 3 s in every mode, also in the opt-in unconfined-root
mode, where a completion can ptrace-attach to its judge: SIGKILL then leaves the judge a zombie its tracer holds,
and the code before issue 45 waited for it (a 1 s reward held as long as the tracer slept, 20 s here).

Real subprocesses: the program runs as root without namespaces (the probes' answers of a machine where neither
namespaces nor `nobody` work, with the opt-in), finds its judge in /proc and attaches with PTRACE_ATTACH."""

from __future__ import annotations

import os
import signal
import tempfile
import textwrap
import time
import warnings
from pathlib import Path

import pytest

from trl_aspo.evaluation import isolation as probes
from trl_aspo.evaluation import rewards
from trl_aspo.evaluation.rewards import code_unit_test_reward

TIMEOUT = 1.0
SLEEP_S = 20  # how long the tracer holds the judge: the old code's call took this long

FIND_AND_ATTACH = """
    import ctypes, os, time
    libc = ctypes.CDLL(None, use_errno=True)
    TRAINER = os.getppid()
    def judge_pid():
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                stat = open(f"/proc/{entry}/stat").read()
                cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == TRAINER and cmdline.endswith(b"\\0judge\\0"):
                return int(entry)
        return 0
    def attach_and_sleep(report):
        judge = judge_pid()
        attached = libc.ptrace(16, judge, None, None)  # PTRACE_ATTACH: the judge stops, traced by this process
        with open(report, "w") as file:
            file.write(f"{os.getpid()} {judge} {attached}")
        time.sleep(SLEEP_S)
"""


@pytest.fixture
def unconfined_root(monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("the program can ptrace its judge only as root (the opt-in unconfined-root mode)")
    monkeypatch.setattr(probes, "sandbox_isolates_network", lambda: False)
    monkeypatch.setattr(probes, "sandbox_user", lambda: None)
    monkeypatch.setattr(probes, "_warned", [])
    monkeypatch.setenv("TRL_ASPO_ALLOW_UNCONFINED_ROOT", "1")
    folder = Path(tempfile.mkdtemp(prefix="aspo-tracer-"))
    yield folder / "report"
    probes.remove_tree(str(folder))


def _program(body: str, report: Path) -> str:
    source = f"SLEEP_S = {SLEEP_S}\n{textwrap.dedent(FIND_AND_ATTACH)}\n{textwrap.dedent(body)}"
    return f"```python\n{source.replace('REPORT', repr(str(report)))}\n```"


def _report(path: Path) -> tuple[int, int, int]:
    tracer, judge, attached = map(int, path.read_text().split())
    return tracer, judge, attached


def test_a_program_tracing_its_judge_does_not_hold_the_reward(unconfined_root):
    """Issue 45's L4: the worker attaches to its judge and sleeps."""
    program = _program("attach_and_sleep(REPORT)\ndef add(a, b):\n    return a + b", unconfined_root)
    started = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        rewards_given = code_unit_test_reward([program], [["assert add(2, 3) == 5"]], timeout=TIMEOUT)
    elapsed = time.monotonic() - started
    assert rewards_given == [0.0]
    _, judge, attached = _report(unconfined_root)
    assert judge > 0 and attached == 0  # the tracer really held the judge
    assert elapsed < TIMEOUT + 3, elapsed


def test_a_detached_tracer_outside_any_cgroup_does_not_hold_the_reward(unconfined_root, monkeypatch):
    """The tracer setsids and double-forks, out of the worker's group, and no cgroup holds it: the judge cannot be
    reaped while it lives. The completion scores 0.0 with a warning, and a thread reaps the judge once the tracer
    is gone."""
    monkeypatch.setattr(probes, "sandbox_cgroup", lambda: "forced off by the test")
    body = """
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                attach_and_sleep(REPORT)
            os._exit(0)
        os.wait()
        while not os.path.exists(REPORT):  # the judge stays unstopped until the tracer attached: wait for it
            time.sleep(0.01)
        def add(a, b):
            return a + b
    """
    program = _program(body, unconfined_root)
    started = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rewards_given = code_unit_test_reward([program], [["assert add(2, 3) == 5"]], timeout=TIMEOUT)
    elapsed = time.monotonic() - started
    for _ in range(100):  # the grandchild writes its report once it attached
        if unconfined_root.exists() and unconfined_root.read_text().count(" ") == 2:
            break
        time.sleep(0.05)
    tracer, judge, attached = _report(unconfined_root)
    try:
        assert rewards_given == [0.0]
        assert judge > 0 and attached == 0
        assert elapsed < TIMEOUT + 3, elapsed
        messages = [str(warning.message) for warning in caught if warning.category is RuntimeWarning]
        assert any(f"the judge (pid {judge}) could not be reaped" in message for message in messages), messages
    finally:
        os.kill(tracer, signal.SIGKILL)
    reapers = [thread for process, thread in list(rewards._REAPERS.items()) if process.pid == judge]
    assert len(reapers) == 1
    reapers[0].join(10)
    assert not reapers[0].is_alive()  # reaped once its tracer died: nothing is left behind
