"""Issue 25 item 3: what the code reward cannot isolate on a machine is said (one RuntimeWarning per process, naming
each missing piece) and can be refused (`require_isolation`); where a cgroup works it holds what namespaces would.

Written against `code_unit_test_reward` and the probe's module, so that they also run (and fail) on the old harness,
whose fallback without namespaces was silent."""

from __future__ import annotations

import shutil
import tempfile
import textwrap
import time
import warnings
from pathlib import Path

import pytest

from trl_aspo.evaluation import rewards
from trl_aspo.evaluation.rewards import code_unit_test_reward

try:
    from trl_aspo.evaluation import isolation as probes
except ImportError:  # the old harness
    probes = rewards

ADD = "```python\ndef add(a, b):\n    return a + b\n```"
TESTS = [["assert add(2, 3) == 5"]]


def _program(source: str) -> str:
    return f"```python\n{textwrap.dedent(source).strip()}\n```"


@pytest.fixture
def without_namespaces(monkeypatch):
    monkeypatch.setattr(probes, "sandbox_isolates_network", lambda: False)
    monkeypatch.setattr(probes, "_warned", [], raising=False)
    monkeypatch.setenv("TRL_ASPO_ALLOW_UNCONFINED_ROOT", "1")  # where `nobody` cannot run the interpreter


def test_without_namespaces_one_warning_names_what_is_not_isolated(without_namespaces):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert code_unit_test_reward([ADD], TESTS, timeout=10.0) == [1.0]
        assert code_unit_test_reward([ADD], TESTS, timeout=10.0) == [1.0]
    messages = [str(warning.message) for warning in caught if warning.category is RuntimeWarning]
    assert len(messages) == 1  # once per process, not per call
    assert "namespaces: no user, mount, network, PID and IPC namespace" in messages[0]
    for consequence in ("127.0.0.1", "sees every process", "setsid"):
        assert consequence in messages[0]


def test_require_isolation_refuses_without_namespaces(without_namespaces):
    with pytest.raises(
        RuntimeError, match=r"require_isolation=True .* namespaces: no user, mount, network, PID and IPC"
    ):
        code_unit_test_reward([ADD], TESTS, timeout=10.0, require_isolation=True)


def test_require_isolation_names_a_missing_cgroup(monkeypatch):
    monkeypatch.setattr(probes, "sandbox_cgroup", lambda: "cgroup v2 at /x offers cpu, not pids and memory")
    with pytest.raises(RuntimeError, match=r"cgroup: no cgroup \(cgroup v2 at /x offers cpu, not pids and memory\)"):
        code_unit_test_reward([ADD], TESTS, timeout=10.0, require_isolation=["cgroup"])
    with pytest.raises(ValueError, match=r"`require_isolation`: unknown piece\(s\) \['net'\]"):
        code_unit_test_reward([ADD], TESTS, timeout=10.0, require_isolation=["net"])


def test_require_isolation_runs_where_namespaces_work():
    if not probes.sandbox_isolates_network():
        pytest.skip("unprivileged user namespaces (unshare) do not work on this machine")
    assert code_unit_test_reward([ADD], TESTS, timeout=10.0, require_isolation=True) == [1.0]


def test_without_namespaces_a_cgroup_still_kills_a_detached_grandchild(without_namespaces):
    found = probes.sandbox_cgroup() if hasattr(probes, "sandbox_cgroup") else None
    if isinstance(found, str):
        pytest.skip(f"no cgroup on this machine: {found}")
    shared = Path(tempfile.mkdtemp(prefix="aspo-test-"))
    shared.chmod(0o777)  # writable by `nobody`
    started, late = shared / "started", shared / "late"
    # A shell, not `sys.executable`: run as `nobody` the program may not be able to start this machine's interpreter
    # again (here it lies under /root/.pyenv), and a grandchild that never started would never write `late` either.
    child = ["setsid", "/bin/sh", "-c", f"touch {started}; sleep 1.5; touch {late}"]
    source = f"import subprocess\nsubprocess.Popen({child!r})\nwhile True:\n    pass"
    try:
        assert code_unit_test_reward([_program(source)], [["assert True"]], timeout=0.5) == [0.0]
        time.sleep(2.5)
        assert started.exists() and not late.exists()
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_without_namespaces_a_root_trainer_is_out_of_the_programs_reach(without_namespaces):
    """Run as `nobody`, the program cannot signal the trainer (its parent) or read its memory."""
    if not hasattr(probes, "sandbox_user") or probes.sandbox_user() is None:
        pytest.skip("the program runs as the trainer's user here (not root, or no setpriv): documented")
    source = """
        import os
        try:
            os.kill(os.getppid(), 0)
            signalled = True
        except PermissionError:
            signalled = False
        try:
            open(f"/proc/{os.getppid()}/mem", "rb").close()
            readable = True
        except OSError:
            readable = False
    """
    tests = [["assert not signalled and not readable"]]
    assert code_unit_test_reward([_program(source)], tests, timeout=10.0) == [1.0]
