"""`die_with_parent` (tests/helpers.py), which the vLLM tier's server is started with: a parent killed by SIGKILL,
as `timeout -s KILL` kills a test run, takes the child it started in its own session along."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from helpers import REPO_ROOT

PARENT = textwrap.dedent(
    """
    import subprocess, sys, time
    sys.path.insert(0, {tests!r})
    from helpers import die_with_parent
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True, preexec_fn={preexec}
    )
    print(child.pid, flush=True)
    time.sleep(120)
    """
)


def _child_outlives_a_killed_parent(preexec: str) -> bool:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT.format(tests=str(REPO_ROOT / "tests"), preexec=preexec)],
        stdout=subprocess.PIPE,
        text=True,
    )
    child = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return False
        if Path(f"/proc/{child}/stat").read_text().split()[2] == "Z":  # exited, not yet reaped by init
            return False
        time.sleep(0.1)
    os.kill(child, 9)
    return True


def test_a_child_started_with_die_with_parent_ends_when_its_parent_is_killed():
    assert not _child_outlives_a_killed_parent("die_with_parent")


def test_without_it_the_child_outlives_its_killed_parent():
    assert _child_outlives_a_killed_parent("None")
