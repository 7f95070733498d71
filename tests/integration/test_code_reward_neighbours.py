"""Issue 44 item 3: judged concurrently in the namespace mode, a hostile completion changes no other completion's
verdict in its batch, the trainer can still create an inotify instance meanwhile, and nothing is left behind. Without
namespaces, a run as `nobody` leaves nothing in the machine's /dev/shm or /tmp.

One mixed batch per hostile kind: the hostile program, 3 correct neighbours and 1 wrong one, timeout 2 s,
concurrency 4, real subprocesses. Before issue 44 a worker took all 128 of root's inotify instances (the trainer's
inotify_init failed with EMFILE while it ran), and a /dev/shm file of a run without namespaces stayed on the
machine."""

from __future__ import annotations

import ctypes
import os
import secrets
import tempfile
import textwrap
import threading
import warnings
from pathlib import Path

import pytest

from trl_aspo.evaluation import isolation as probes
from trl_aspo.evaluation.rewards import code_unit_test_reward

ADD_TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]
RIGHT = "def add(a, b):\n    return a + b"
WRONG = "def add(a, b):\n    return a * b"
HOSTILE = {
    "memory hog": """
        import os
        for _ in range(3):
            if os.fork() == 0:
                break
        chunks = []
        while True:
            chunks.append(bytearray(16 * 2**20))
    """,
    "fork bomb": """
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """,
    "kill-all": """
        import os, signal
        for entry in filter(str.isdigit, os.listdir("/proc")):
            if int(entry) != os.getpid():
                try:
                    os.kill(int(entry), signal.SIGKILL)
                except OSError:
                    pass
        os.kill(-1, signal.SIGKILL)
    """,
    "folder fill": """
        index = 0
        while True:
            with open(f"fill-{index}", "wb") as file:
                file.write(b"x" * 2**20)
            index += 1
    """,
    "/dev/shm fill": """
        index = 0
        while True:
            with open(f"/dev/shm/fill-{index}", "wb") as file:
                file.write(b"x" * 2**20)
            index += 1
    """,
    "spinner": """
        while True:
            pass
    """,
    "inotify exhaustion": """
        import ctypes, time
        libc = ctypes.CDLL(None, use_errno=True)
        held = [libc.inotify_init() for _ in range(256)]
        time.sleep(60)
    """,
}


def _program(source: str) -> str:
    return f"```python\n{textwrap.dedent(source).strip()}\n```"


def _children() -> list[int]:
    me, found = os.getpid(), []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            found.append(int(entry))
    return found


def _run_cgroups() -> list[str]:
    parents = probes.sandbox_cgroup()
    if not isinstance(parents, probes.CgroupParents):
        return []
    prefix = f"aspo-run-{os.getpid()}-"
    return [name for parent in parents.directories for name in os.listdir(parent) if name.startswith(prefix)]


def _run_folders() -> set[str]:
    return {
        name for name in os.listdir(tempfile.gettempdir()) if name.startswith(("aspo-unit-test-", "aspo-unit-judge-"))
    }


class InotifyAttempts:
    """This process's inotify_init, tried every 10 ms while the batch runs: the failures' errno."""

    def __init__(self):
        self.tries, self.failures, self._stop = 0, [], threading.Event()
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._thread = threading.Thread(target=self._try, daemon=True)

    def _try(self):
        while not self._stop.is_set():
            descriptor = self._libc.inotify_init()
            self.tries += 1
            if descriptor < 0:
                self.failures.append(ctypes.get_errno())
            else:
                os.close(descriptor)
            self._stop.wait(0.01)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_a_hostile_completion_changes_no_neighbour_s_verdict(kind):
    if not probes.sandbox_isolates_network():
        pytest.skip("user namespaces (unshare) do not work on this machine")
    batch = [HOSTILE[kind], RIGHT, RIGHT, WRONG, RIGHT]
    folders_before = _run_folders()
    with InotifyAttempts() as inotify, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        given = code_unit_test_reward(
            [_program(source) for source in batch],
            [ADD_TESTS] * 5,
            timeout=2.0,
            memory_limit_mb=256,
            max_concurrency=4,
        )
    assert given == [0.0, 1.0, 1.0, 0.0, 1.0]
    assert inotify.tries > 0 and inotify.failures == []
    assert _children() == [] and _run_cgroups() == [] and _run_folders() <= folders_before


def test_without_namespaces_a_run_leaves_nothing_in_dev_shm_or_tmp(monkeypatch):
    """As `nobody` in the machine's file system: the files a program leaves in /dev/shm and /tmp are removed."""
    monkeypatch.setattr(probes, "sandbox_isolates_network", lambda: False)
    monkeypatch.setattr(probes, "_warned", [])
    if probes.sandbox_user() is None:
        pytest.skip("the program runs as the trainer's user here: its files cannot be told from the trainer's")
    name = f"aspo-leftover-{secrets.token_hex(4)}"
    paths = [Path("/dev/shm", name), Path("/tmp", name), Path("/tmp", f"{name}-folder")]
    source = (
        textwrap.dedent(f"""
        import os
        open({str(paths[0])!r}, "w").write("left")
        open({str(paths[1])!r}, "w").write("left")
        os.makedirs({str(paths[2] / "inside")!r})
    """)
        + RIGHT
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            assert code_unit_test_reward([_program(source)], [ADD_TESTS], timeout=10.0) == [1.0]
        assert [path.exists() for path in paths] == [False, False, False]
    finally:
        for path in paths[:2]:
            path.unlink(missing_ok=True)
        probes.remove_tree(str(paths[2]))
