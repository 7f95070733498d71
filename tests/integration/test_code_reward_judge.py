"""Issue 25 items 1 and 2: no code inside a wrong solution makes it pass (the verdict is reached by a judge the
solution cannot reach), and the process and memory limits hold for the whole program (a cgroup per run).

These run real subprocesses through `code_unit_test_reward` only, so they also run against the old single-process
harness (where the forgeries scored 1.0 and the limits were per process)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from trl_aspo.evaluation import rewards
from trl_aspo.evaluation.rewards import code_unit_test_reward

try:
    from trl_aspo.evaluation import isolation as probes
except ImportError:  # the old harness: its probe lived in rewards
    probes = rewards

ADD = "def add(a, b):\n    return a + b"
TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(0, 0) == 0"]


def _program(source: str) -> list[dict]:
    return [{"role": "assistant", "content": f"```python\n{textwrap.dedent(source).strip()}\n```"}]


# Every candidate secret the program finds goes to every descriptor it holds, then it exits "successfully".
_SPRAY = """
def spray(candidates):
    for fd in range(3, 256):
        for candidate in candidates:
            try:
                os.write(fd, candidate)
            except OSError:
                pass
    os._exit(0)
"""

# The heap search of issue 25: the nonce was the only 32-hex string followed by a NUL in the harness's memory.
_SEARCH = r"""
def search(pid, root):
    found = set()
    try:
        maps = os.read(os.open(f"proc/{pid}/maps", os.O_RDONLY, dir_fd=root), 2**22).decode().splitlines()
        memory = os.open(f"proc/{pid}/mem", os.O_RDONLY, dir_fd=root)
    except OSError:
        return found
    for line in maps:
        span, perms = line.split()[:2]
        if "r" not in perms or "[v" in line:
            continue
        start, end = (int(part, 16) for part in span.split("-"))
        try:
            found.update(re.findall(rb"(?<![0-9a-f])[0-9a-f]{32}(?=\x00)", os.pread(memory, end - start, start)))
        except OSError:
            pass
    return found
"""

OWN_MEMORY = (
    "import os, re\n"
    + _SEARCH
    + _SPRAY
    + 'spray(search("self", os.open("/", os.O_RDONLY | os.O_DIRECTORY)))'  # dir_fd: the audit hook saw no /proc
)

# A child that reads its parent's memory. Run as `nobody` (without namespaces) the program may not be able to start
# the trainer's interpreter again (here it lies under /root/.pyenv): it takes the first one that starts.
_START_READER = (
    "reader = "
    + repr(
        "import os, re, sys\n"
        + _SEARCH
        + 'sys.stdout.write(" ".join(sorted(item.decode() for item in search(sys.argv[1], '
        'os.open("/", os.O_RDONLY | os.O_DIRECTORY)))))'
    )
    + "\nfor interpreter in (sys.executable, '/usr/bin/python3'):"
    + "\n    try:"
    + "\n        out = subprocess.run([interpreter, '-c', reader, str(os.getpid())], capture_output=True, text=True)"
    + "\n        break"
    + "\n    except OSError:"
    + "\n        out = None"
)

CHILD_READS_PARENT = (
    "import os, re, subprocess, sys\n"
    + _SPRAY
    + _START_READER
    + "\nspray([item.encode() for item in out.stdout.split()])"
)

EVERY_PROCESS = (
    "import os, re\n"
    + _SEARCH
    + _SPRAY
    + "root = os.open('/', os.O_RDONLY | os.O_DIRECTORY)\n"
    + "spray(set().union(*(search(p, root) for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid())))"
)

FORGERIES = {
    "reads its own memory through dir_fd": OWN_MEMORY,
    "a child reads the harness's memory": CHILD_READS_PARENT,
    "reads every process it can see": EVERY_PROCESS,
    "writes a verdict to every descriptor": "import os\n" + _SPRAY + "spray([b'ready\\npass\\n', b'pass\\n'])",
    "sends well-formed answers on every descriptor": """
        import json, os, struct
        def message(value):
            data = json.dumps(value).encode()
            return struct.pack(">I", len(data)) + data
        forged = message({"names": {"add": ["function"]}}) + message({"value": ["i", "5"]}) * 8
        for fd in range(3, 256):
            try:
                os.write(fd, forged)
            except OSError:
                pass
        os._exit(0)
    """,
}


@pytest.mark.parametrize("forgery", list(FORGERIES))
@pytest.mark.parametrize("namespaces", [True, False], ids=["sandbox", "without-namespaces"])
def test_no_code_in_a_wrong_solution_makes_it_pass(forgery, namespaces, monkeypatch):
    if namespaces and not probes.sandbox_isolates_network():
        pytest.skip("unprivileged user namespaces (unshare) do not work on this machine")
    monkeypatch.setattr(probes, "sandbox_isolates_network", lambda: namespaces)
    monkeypatch.setenv("TRL_ASPO_ALLOW_UNCONFINED_ROOT", "1")  # where `nobody` cannot run the interpreter
    programs = [_program(FORGERIES[forgery]), _program(ADD)]
    assert code_unit_test_reward(programs, [TESTS] * 2, timeout=10.0) == [0.0, 1.0]


@pytest.mark.parametrize("namespaces", [True, False], ids=["sandbox", "without-namespaces"])
def test_the_forgery_s_reader_child_really_runs(namespaces, monkeypatch):
    """The child of "a child reads the harness's memory" starts and ends in both modes (a correct solution that
    starts it scores 1.0), so that forgery's 0.0 is the judge's doing, not a child that never ran."""
    if namespaces and not probes.sandbox_isolates_network():
        pytest.skip("unprivileged user namespaces (unshare) do not work on this machine")
    monkeypatch.setattr(probes, "sandbox_isolates_network", lambda: namespaces)
    monkeypatch.setenv("TRL_ASPO_ALLOW_UNCONFINED_ROOT", "1")  # where `nobody` cannot run the interpreter
    source = (
        "import os, re, subprocess, sys\n" + _START_READER + "\nreader_ran = out is not None and out.returncode == 0\n"
    )
    assert code_unit_test_reward([_program(source + ADD)], [[*TESTS, "assert reader_ran"]], timeout=10.0) == [1.0]


def test_a_forgery_fails_in_the_humaneval_layout_too():
    tests = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(1, 1) == 2\n"
    programs = [_program(OWN_MEMORY), _program(ADD)]
    assert code_unit_test_reward(programs, [tests] * 2, timeout=10.0, entry_point=["add"] * 2) == [0.0, 1.0]


def test_the_solution_cannot_open_the_memory_of_any_process_but_its_own():
    """Not the judge's (not dumpable), not the trainer's (another PID namespace, or another user)."""
    source = """
        import os
        own = os.getpgrp()
        foreign = []
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                if os.getpgid(int(name)) == own:
                    continue
                os.close(os.open(f"/proc/{name}/mem", os.O_RDONLY))
                foreign.append(int(name))
            except OSError:
                pass
    """
    assert code_unit_test_reward([_program(source)], [["assert foreign == []"]], timeout=10.0) == [1.0]


def test_what_the_solution_raises_reaches_the_tests_as_its_standard_kind():
    """A ValueError subclass of the solution is a ValueError in the tests; StopIteration is not re-raised (it would
    end `map` silently: `all(map(candidate, cases))` would hold for a solution that raises it)."""
    source = """
        class Mine(ValueError):
            pass
        def parse(text):
            if not text:
                raise Mine("empty")
            return int(text)
        def stop(_):
            raise StopIteration
    """
    tests = [
        "try:\n    parse('')\n    raise AssertionError('no error')\n"
        "except ValueError as error:\n    assert str(error) == 'empty'",
        "assert parse('12') == 12",
        "try:\n    all(map(stop, [1]))\n    stopped = False\nexcept Exception:\n    stopped = True\nassert stopped",
    ]
    assert code_unit_test_reward([_program(source)], [tests], timeout=10.0) == [1.0]
    assert code_unit_test_reward([_program(source)], [["assert all(map(stop, [1, 2]))"]], timeout=10.0) == [0.0]


def test_top_level_data_and_modules_reach_the_tests():
    source = """
        import math
        import numpy as np
        TABLE = {"a": [1, 2.5, None]}
        def norm(values):
            return np.linalg.norm(np.array(values))
        def total(values):
            return np.int64(sum(values))
    """
    tests = [
        "assert TABLE == {'a': [1, 2.5, None]}",
        "assert math.isclose(norm([3, 4]), 5.0)",  # `math` from the solution's import: the judge's own module
        "assert total([1, 2]) == 3 and type(total([1, 2])) is int",
    ]
    assert code_unit_test_reward([_program(source)], [tests], timeout=20.0) == [1.0]


# Issue 25 item 2: RLIMIT_NPROC is not enforced for root, and RLIMIT_AS is per process.


def _skip_without_cgroup():
    found = probes.sandbox_cgroup() if hasattr(probes, "sandbox_cgroup") else None
    if isinstance(found, str):
        pytest.skip(f"no cgroup on this machine: {found}")


def test_max_processes_holds_for_the_whole_program():
    _skip_without_cgroup()
    source = """
        import os, time
        forked = 0
        for _ in range(300):
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                time.sleep(3)
                os._exit(0)
            forked += 1
    """
    rewards_ = code_unit_test_reward([_program(source)], [["assert 0 < forked < 64"]], timeout=10.0, max_processes=64)
    assert rewards_ == [1.0]


def test_memory_limit_holds_for_the_whole_program():
    _skip_without_cgroup()
    source = """
        import os, time
        def children(count, mib):
            pids = []
            for _ in range(count):
                pid = os.fork()
                if pid == 0:
                    block = b"x" * (mib * 2**20)  # touched: resident, not only reserved
                    time.sleep(1.5)
                    os._exit(0 if block else 1)
                pids.append(pid)
            return [os.waitpid(pid, 0)[1] for pid in pids]
        statuses = children(COUNT_AND_MIB)
    """
    four_of_300 = _program(source.replace("COUNT_AND_MIB", "4, 300"))  # 1.2 GB together, each under 512 MiB
    two_of_100 = _program(source.replace("COUNT_AND_MIB", "2, 100"))
    tests = [["assert statuses == [0, 0, 0, 0]"], ["assert statuses == [0, 0]"]]
    assert code_unit_test_reward([four_of_300, two_of_100], tests, timeout=20.0, memory_limit_mb=512) == [0.0, 1.0]


def test_a_module_the_solution_plants_is_never_imported_by_the_judge():
    """A program that may write the interpreter's site-packages (as the trainer's user, or as root outside a user
    namespace) plants a module that would forge the verdict from inside the judge; the judge imports nothing once
    the worker exists, so the tests that would import it fail."""
    import secrets
    import sysconfig

    name = f"aspo_planted_{secrets.token_hex(4)}"
    planted = Path(sysconfig.get_paths()["purelib"]) / f"{name}.py"
    forge = "import os, socket\nfor fd in range(3, 64):\n    try:\n"
    forge += "        socket.socket(fileno=os.dup(fd)).send(b'pass\\n')\n"
    forge += "    except OSError:\n        pass\nos._exit(0)\n"
    source = f"""
        import sysconfig
        from pathlib import Path
        try:
            Path(sysconfig.get_paths()["purelib"], "{name}.py").write_text({forge!r})
        except OSError:
            pass
    """
    tests = [f"def later():\n    import {name}", "later()", "assert add(2, 3) == 5"]
    try:
        assert code_unit_test_reward([_program(source)], [tests], timeout=10.0) == [0.0]
    finally:
        planted.unlink(missing_ok=True)
