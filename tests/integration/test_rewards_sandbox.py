"""The code reward of the archer2_code recipe: passing only by running the tests to the end, in a sandbox (the tests
execute programs in subprocesses)."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from trl_aspo.evaluation import rewards
from trl_aspo.evaluation.rewards import code_unit_test_reward

try:  # the probes moved to their own module with the judge (issue 25); this file also runs against the old harness
    from trl_aspo.evaluation import isolation as probes
except ImportError:
    probes = rewards


@pytest.fixture
def shared_tmp():
    """A directory the program may write even when it runs as `nobody` (pytest's tmp_path is closed to it)."""
    path = Path(tempfile.mkdtemp(prefix="aspo-test-"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_code_unit_test_reward():
    good = [{"role": "assistant", "content": "Sure:\n```python\ndef add(a, b):\n    return a + b\n```"}]
    wrong = [{"role": "assistant", "content": "```python\ndef add(a, b):\n    return a - b\n```"}]
    hang = [{"role": "assistant", "content": "```python\nwhile True:\n    pass\n```"}]
    no_code = [{"role": "assistant", "content": "add is a+b"}]
    tests = [["assert add(2, 3) == 5"]] * 4
    assert code_unit_test_reward([good, wrong, hang, no_code], tests, timeout=2.0) == [1.0, 0.0, 0.0, 0.0]


def test_code_unit_test_reward_discards_program_output():
    import resource

    # 256 MiB on stdout and stderr each: read into memory, they would raise this process's peak by at least that.
    flood = "\n".join(
        [
            "import sys",
            "chunk = 'x' * 2**20",
            "for _ in range(256):",
            "    sys.stdout.write(chunk)",
            "    sys.stderr.write(chunk)",
        ]
    )
    completion = [{"role": "assistant", "content": f"```python\n{flood}\n```"}]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert code_unit_test_reward([completion], [["assert True"]], timeout=60.0) == [1.0]
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 64


def _program(source: str) -> list[dict]:
    return [{"role": "assistant", "content": f"```python\n{textwrap.dedent(source).strip()}\n```"}]


ADD = "def add(a, b):\n    return a + b"
ADD_TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]


def test_a_correct_solution_passes_and_a_wrong_one_fails():
    wrong = "def add(a, b):\n    return a - b"
    assert code_unit_test_reward([_program(ADD), _program(wrong)], [ADD_TESTS] * 2, timeout=5.0) == [1.0, 0.0]


# Issue 17 item 8: with the tests appended after the code and the exit code read, each of these scored 1.0.
EXITS_BEFORE_THE_TESTS = {
    "sys.exit(0)": "import sys\nsys.exit(0)",
    "os._exit(0)": "import os\nos._exit(0)",
    "raise SystemExit": "raise SystemExit",
    "raise SystemExit(0) in a function": "def add(a, b):\n    raise SystemExit(0)",
    "atexit handler exiting 0": "import atexit, os\natexit.register(lambda: os._exit(0))\nraise RuntimeError",
    "kills itself": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
    "writes to every descriptor": """
        import os
        for fd in range(3, 256):
            try:
                os.write(fd, b"0" * 32)
            except OSError:
                pass
        os._exit(0)
    """,
    "steals the nonce from the harness frame": """
        import os, sys
        frame = sys._getframe(1)
        os.write(frame.f_locals["proof_fd"], frame.f_locals["nonce"])
        os._exit(0)
    """,
    "steals the nonce through a traceback": """
        import os
        try:
            raise KeyError
        except KeyError as error:
            frame = error.__traceback__.tb_frame.f_back
        os.write(frame.f_locals["proof_fd"], frame.f_locals["nonce"])
        os._exit(0)
    """,
    "steals the nonce in a signal handler's frame": """
        import os, signal
        def steal(number, frame):
            while frame is not None:
                if "nonce" in frame.f_locals:
                    os.write(frame.f_locals["proof_fd"], frame.f_locals["nonce"])
                    os._exit(0)
                frame = frame.f_back
        signal.signal(signal.SIGUSR1, steal)
        os.kill(os.getpid(), signal.SIGUSR1)
    """,
    "announces the end of the tests itself": "import sys\nsys.audit('aspo.tests_done')\nsys.exit(0)",
    "rebinds exec so the tests do not run": "import builtins\nbuiltins.exec = lambda *args, **kwargs: None",
    "rebinds the harness's names": """
        import builtins, __main__
        builtins.all, builtins.list = (lambda items: True), int
        __main__._INTROSPECTION = frozenset()
        class Anything:
            def __eq__(self, other):
                return True
        def add(a, b):
            return [Anything()]
    """,
    "reads its memory through a /proc alias": """
        import os
        os.symlink("/proc/self/mem", "memory")
        os.path.realpath = lambda path: "/tmp/elsewhere"
        open("memory", "rb")
    """,
    "reads stdin": "import os, sys\nos.write(3, sys.stdin.buffer.read())\nos._exit(0)",
    "equal to everything": """
        class Anything:
            def __eq__(self, other):
                return True
        def add(a, b):
            return Anything()
    """,
    "equal to everything inside a list": """
        class Anything:
            def __eq__(self, other):
                return True
        def add(a, b):
            return [Anything()]
    """,
    "int subclass equal to everything": """
        class Five(int):
            def __eq__(self, other):
                return True
        def add(a, b):
            return Five(0)
    """,
    "rebinds a builtin": "import builtins\nbuiltins.abs = lambda x: 0\ndef add(a, b):\n    return 0",
    "shadows a builtin": "abs = lambda x: 0\ndef add(a, b):\n    return 0",
}


@pytest.mark.parametrize("exploit", list(EXITS_BEFORE_THE_TESTS))
def test_a_program_that_does_not_run_the_tests_to_the_end_scores_zero(exploit):
    tests = ["assert add(2, 3) == 5", "assert [add(1, 1)] == [2]", "assert abs(add(2, 2) - 4) < 1e-9"]
    source = EXITS_BEFORE_THE_TESTS[exploit]
    assert code_unit_test_reward([_program(source), _program(ADD)], [tests] * 2, timeout=5.0) == [0.0, 1.0]


def test_legitimate_results_still_compare():
    """Results that are data cross as their standard type and compare as such: Fractions, namedtuples (as tuples),
    floats with nan/inf/-0.0, sets, bytes, nested containers. (Instances of a solution-defined class such as a
    dataclass are not data since issue 25: tests that compare them score 0.0, docs/code_reward.md.)"""
    source = """
        import math
        from collections import namedtuple
        from fractions import Fraction
        Point = namedtuple("Point", "x y")
        def half(n):
            return Fraction(n, 2)
        def point():
            return Point(1, 2)
        def floats():
            return [math.inf, -0.0, math.nan]
        def mixed():
            return {"a": (1, {2, 3}), b"k": frozenset({4})}
    """
    tests = [
        "from fractions import Fraction",
        "import math",
        "assert half(1) == Fraction(1, 2) and half(1) != Fraction(1, 3)",
        "assert point() == (1, 2) and point() == Point(1, 2)",
        "assert floats()[0] == math.inf and math.copysign(1, floats()[1]) == -1 and math.isnan(floats()[2])",
        "assert mixed() == {'a': (1, {2, 3}), b'k': frozenset({4})}",
        "assert [1, {'a': (2, 3)}] == [1, {'a': (2, 3)}]",
    ]
    assert code_unit_test_reward([_program(source)], [tests], timeout=5.0) == [1.0]


def test_tests_as_one_string_list_or_tuple():
    wrong = "def add(a, b):\n    return a - b"
    one_string = "\n".join(ADD_TESTS)  # was joined character by character: every program scored 0.0
    programs = [_program(ADD), _program(wrong)] * 3
    rows = [one_string, one_string, ADD_TESTS, ADD_TESTS, tuple(ADD_TESTS), tuple(ADD_TESTS)]
    assert code_unit_test_reward(programs, rows, timeout=5.0) == [1.0, 0.0] * 3


def test_humaneval_layout_calls_check_with_the_entry_point():
    tests = (
        "METADATA = {}\n\n\ndef check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(0, 0) == 0\n"
    )
    wrong = "def add(a, b):\n    return a * b + 1"
    rewards = code_unit_test_reward([_program(ADD), _program(wrong)], [tests] * 2, entry_point=["add"] * 2)
    assert rewards == [1.0, 0.0]
    with pytest.raises(ValueError, match=r"`tests` row 0 defines check\(candidate\) but never calls it"):
        code_unit_test_reward([_program(ADD)], [tests])


@pytest.mark.parametrize(
    ("tests", "message"),
    [
        ([5], r"`tests` row 0: expected a string of test code or a list of strings.*got int 5"),
        ([["assert True"], ["assert True", 3]], r"`tests` row 1: .*got a list of int, str"),
        ([{"assert": 1}], r"`tests` row 0: .*got dict"),
        ("assert True", r"`tests` must hold one entry per completion, got a single string"),
    ],
)
def test_other_kinds_of_tests_are_refused_by_name(tests, message):
    with pytest.raises(TypeError, match=message):
        code_unit_test_reward([_program(ADD)] * (2 if len(tests) == 2 else 1), tests)


# Issue 17 item 9: isolation of the executed program.


def test_the_program_sees_none_of_the_trainers_environment(monkeypatch):
    monkeypatch.setenv("ASPO_TEST_SECRET_API_KEY", "sk-do-not-leak")
    source = (
        "import os\nleaked = {k: v for k, v in os.environ.items() if 'sk-do-not-leak' in v or 'SECRET' in k}\n"
        "names = sorted(os.environ)"
    )
    tests = [
        "assert leaked == {}",
        "assert set(names) <= {'PATH', 'HOME', 'TMPDIR', 'LANG', 'OMP_NUM_THREADS', "
        "'OPENBLAS_NUM_THREADS', 'MKL_NUM_THREADS', 'LC_CTYPE'}",
    ]
    assert code_unit_test_reward([_program(source)], [tests], timeout=5.0) == [1.0]


def test_the_program_runs_in_a_fresh_directory_and_leaves_the_trainers_alone(tmp_path, shared_tmp, monkeypatch):
    trainer_dir = tmp_path / "trainer"
    (trainer_dir / "checkpoint-1").mkdir(parents=True)
    (trainer_dir / "checkpoint-1" / "model.safetensors").write_text("weights")
    monkeypatch.chdir(trainer_dir)
    record = shared_tmp / "sandbox_dir.txt"
    source = """
        import os, shutil
        here = os.getcwd()
        found = os.listdir(".")
        shutil.rmtree("checkpoint-1", ignore_errors=True)
        open("scratch.txt", "w").write("x")
        listed = os.listdir(".")
    """
    tests = [
        "assert found == []",
        f"assert here != {str(trainer_dir)!r}",
        "assert listed == ['scratch.txt']",
        f"open({str(record)!r}, 'w').write(here)",  # by the tests: outside its directory the program writes nothing
    ]
    assert code_unit_test_reward([_program(source)], [tests], timeout=5.0) == [1.0]
    assert (trainer_dir / "checkpoint-1" / "model.safetensors").read_text() == "weights"
    assert sorted(path.name for path in trainer_dir.iterdir()) == ["checkpoint-1"]
    sandbox_dir = Path(record.read_text())
    assert sandbox_dir.name.startswith("aspo-unit-test-") and not sandbox_dir.exists()  # removed afterwards


def _survivors(token: str) -> list[int]:
    """The processes whose command line holds `token`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and token.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _assert_none_survive(token: str) -> None:
    """No process of `token` is left (killed ones may take a moment to go), and none is left running either way."""
    deadline = time.monotonic() + 1.0
    while _survivors(token) and time.monotonic() < deadline:
        time.sleep(0.02)
    left = _survivors(token)
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    assert left == []


def _sleeper(detach: bool) -> tuple[list[str], str]:
    """The command of a grandchild that sleeps 30 s (found again by the token in its command line), and the token.
    A shell, not `sys.executable`: without namespaces the program runs as `nobody`, who may not be able to start
    this machine's interpreter again (here it lies under /root/.pyenv), and then no grandchild would exist."""
    token = f"aspo-sleeper-{secrets.token_hex(6)}"
    return [*(["setsid"] if detach else []), "/bin/sh", "-c", f"sleep 30; : {token}"], token


def _spinning_parent_of(child: list[str]) -> str:
    """A program that starts `child` then spins until its timeout."""
    return f"""
        import subprocess
        subprocess.Popen({child!r})
        while True:
            pass
    """


def _reward_while_watching(token: str, *args, **kwargs) -> tuple[list[float], bool]:
    """`code_unit_test_reward(*args, **kwargs)`, and whether a process of `token` existed while it ran: a grandchild
    that never started would pass every check that it was killed."""
    seen, done = threading.Event(), threading.Event()

    def watch():
        while not done.is_set() and not seen.is_set():
            if _survivors(token):
                seen.set()
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        rewards_ = code_unit_test_reward(*args, **kwargs)
    finally:
        done.set()
        watcher.join()
    return rewards_, seen.is_set()


@pytest.mark.parametrize("namespaces", [True, False], ids=["sandbox", "without-namespaces"])
def test_grandchildren_are_killed_on_timeout(monkeypatch, namespaces):
    if namespaces and not probes.sandbox_isolates_network():
        pytest.skip("unprivileged user namespaces (unshare) do not work on this machine")
    monkeypatch.setattr(probes, "sandbox_isolates_network", lambda: namespaces)
    monkeypatch.setenv("TRL_ASPO_ALLOW_UNCONFINED_ROOT", "1")  # where `nobody` cannot run the interpreter
    child, token = _sleeper(detach=False)
    started = time.monotonic()
    rewards_, ran = _reward_while_watching(
        token, [_program(_spinning_parent_of(child))], [["assert True"]], timeout=0.5
    )
    assert rewards_ == [0.0] and ran
    assert time.monotonic() - started < 10  # back at the timeout, not when the grandchild ends (30 s)
    _assert_none_survive(token)  # the grandchild was killed with its parent


def test_a_finished_program_leaves_no_process_behind():
    child, token = _sleeper(detach=False)
    source = f"import subprocess, time\nsubprocess.Popen({child!r})\ntime.sleep(0.2)\n{ADD}"
    rewards_, ran = _reward_while_watching(token, [_program(source)], [ADD_TESTS], timeout=5.0)
    assert rewards_ == [1.0] and ran
    _assert_none_survive(token)


def test_a_detached_grandchild_dies_with_the_sandbox():
    if not probes.sandbox_isolates_network():
        pytest.skip("without a PID namespace a process that calls setsid escapes (documented)")
    child, token = _sleeper(detach=True)
    rewards_, ran = _reward_while_watching(
        token, [_program(_spinning_parent_of(child))], [["assert True"]], timeout=0.5
    )
    assert rewards_ == [0.0] and ran
    _assert_none_survive(token)


def test_the_program_writes_nothing_outside_its_directory(tmp_path, shared_tmp):
    """Namespaces: the program's view is read-only but its directory and its own /dev/shm (issue 31: both private
    tmpfs that end with it), and it holds no capability to change that (issue 25: it could rewrite the
    interpreter's files, or its cgroup's limits, as the trainer's user). Nothing it writes reaches the machine."""
    if not probes.sandbox_isolates_network():
        pytest.skip("without namespaces the program writes what its user may (documented)")
    import sysconfig

    targets = [shared_tmp / "x", Path(sysconfig.get_paths()["purelib"]) / f"aspo-{secrets.token_hex(4)}", "/dev/shm/x"]
    source = f"""
        import os, subprocess
        wrote = []
        for path in {[str(target) for target in targets]!r}:
            try:
                open(path, "w").close()
                wrote.append(path)
            except OSError:
                pass
        remounted = subprocess.run(["mount", "-o", "remount,rw", "/"], capture_output=True).returncode == 0
    """
    try:
        tests = [["assert wrote == ['/dev/shm/x'] and not remounted"]]
        assert code_unit_test_reward([_program(source)], tests) == [1.0]
        assert not any(Path(target).exists() for target in targets)
    finally:
        for target in targets:
            Path(target).unlink(missing_ok=True)


def test_memory_bomb_is_stopped_by_the_address_space_limit():
    bomb = "chunks = []\nwhile True:\n    chunks.append(bytearray(2**26))"
    probe = "import resource\nlimit = resource.getrlimit(resource.RLIMIT_AS)"
    started = time.monotonic()
    rewards_ = code_unit_test_reward(
        [_program(bomb), _program(probe)],
        [["assert True"], ["assert limit == (2**29, 2**29)"]],
        timeout=30.0,
        memory_limit_mb=512,
    )
    assert rewards_ == [0.0, 1.0]
    assert time.monotonic() - started < 15  # MemoryError at 512 MiB, long before the 30 s timeout


def test_resource_limits_are_set():
    probe = "import resource\nlimits = [resource.getrlimit(getattr(resource, name)) for name in ('RLIMIT_CPU', "
    probe += "'RLIMIT_FSIZE', 'RLIMIT_CORE')]"
    checks = ["assert limits == [(4, 4), (2**20, 2**20), (0, 0)]"]  # CPU: ceil(2.5) + 1 s
    assert code_unit_test_reward([_program(probe)], [checks], timeout=2.5, file_size_limit_mb=1) == [1.0]
    too_big = "open('big', 'wb').write(b'x' * 2**21)"  # 2 MiB past a 1 MiB RLIMIT_FSIZE: the write fails
    assert code_unit_test_reward([_program(too_big)], [["assert True"]], timeout=5.0, file_size_limit_mb=1) == [0.0]


def test_no_network_inside_the_sandbox():
    if not probes.sandbox_isolates_network():
        pytest.skip("unprivileged network namespaces (unshare --net) do not work here: the network is not isolated")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    port = server.getsockname()[1]
    source = f"""
        import socket
        try:
            socket.create_connection(("127.0.0.1", {port}), timeout=2).close()
            reached = True
        except OSError:
            reached = False
    """
    try:
        assert code_unit_test_reward([_program(source)], [["assert not reached"]], timeout=10.0) == [1.0]
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing connected to the trainer's loopback
    finally:
        server.close()


def test_the_trainers_processes_are_out_of_reach_in_the_sandbox():
    if not probes.sandbox_isolates_network():
        pytest.skip("without a PID namespace the trainer's processes are reachable (documented)")
    source = "import os\nparent = os.getppid()\npids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())"
    assert code_unit_test_reward([_program(source)], [["assert parent == 0 and pids[0] == 1"]], timeout=5.0) == [1.0]


def test_without_namespaces_the_rest_of_the_sandbox_still_holds(tmp_path, monkeypatch):
    """Machines where `unshare` does not work unprivileged: no failure, and the harness, the fresh directory, the
    minimal environment and the limits still apply."""
    monkeypatch.setattr(probes, "sandbox_isolates_network", lambda: False)
    monkeypatch.setenv("TRL_ASPO_ALLOW_UNCONFINED_ROOT", "1")  # where `nobody` cannot run the interpreter
    monkeypatch.setenv("ASPO_TEST_SECRET_API_KEY", "sk-do-not-leak")
    monkeypatch.chdir(tmp_path)
    probe = "import os, resource\nenv = dict(os.environ)\nhere = os.getcwd()\n"
    probe += "limit = resource.getrlimit(resource.RLIMIT_AS)"
    checks = [
        "assert 'ASPO_TEST_SECRET_API_KEY' not in env",
        f"assert here != {str(tmp_path)!r}",
        "assert limit == (2**29, 2**29)",
    ]
    programs = [_program(probe), _program("import sys\nsys.exit(0)"), _program(ADD)]
    rows = [checks, ADD_TESTS, ADD_TESTS]
    assert code_unit_test_reward(programs, rows, timeout=5.0, memory_limit_mb=512) == [1.0, 0.0, 1.0]
    assert list(tmp_path.iterdir()) == []


def test_long_tests_reach_the_harness():
    """The payload goes through a file, not a pipe the parent would have to feed while the child runs."""
    tests = [f"assert add({i}, 1) == {i + 1}" for i in range(5000)]  # about 130 kB
    assert code_unit_test_reward([_program(ADD)], [tests], timeout=20.0) == [1.0]
