"""Reward functions for the reference recipes that TRL does not ship, and the asynchronous trainer's reward sum."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import functools
import inspect
import json
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

_PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)
# Read once at import: a program that rewrites the package's files cannot change the harness of later calls.
_HARNESS = (Path(__file__).with_name("sandbox.py")).read_text()
_NAMESPACES = ["unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child", "--mount-proc"]
_PROOF_BYTES = 64


def _last_python_block(completion) -> str | None:
    text = completion[-1]["content"] if isinstance(completion, list) else completion
    blocks = _PYTHON_BLOCK.findall(text or "")
    return blocks[-1] if blocks else None


def code_unit_test_reward(
    completions,
    tests,
    timeout: float = 10.0,
    entry_point=None,
    memory_limit_mb: int = 4096,
    file_size_limit_mb: int = 64,
    max_processes: int = 64,
    **kwargs,
) -> list[float]:
    """1.0 when the completion's last ```python block passes its row's `tests` to the end, else 0.0.

    `tests[i]` is the test code of row i: one string (HumanEval's `test` column) or a list of strings (one assert
    each, MBPP's `test_list`), joined by newlines. With `entry_point` (HumanEval's column, one name per row) the
    harness also calls `check(<entry_point>)`, which the HumanEval tests define but never call; tests that define
    `check` without an `entry_point` are refused (every program would pass them).

    **Passing.** A harness (`sandbox.py`) runs the solution, then the tests, and only then has a random
    nonce, which the parent sent on stdin, written to a pipe of its own; the reward is 1.0 only when that pipe holds
    the nonce. Defended: any exit before the tests end (`sys.exit(0)`, `raise SystemExit`, `os._exit(0)`, a signal,
    killing itself or its parent, `atexit` handlers, an exception) scores 0.0 whatever the exit code; so does
    printing or writing a fake success (to stdout, a patched `print`/`sys.stdout`, or every file descriptor), since
    the nonce is in no program text, argv, environment variable, file or frame: stdin is read and replaced by
    /dev/null before the solution starts, and the nonce lives only in an audit hook that no code can remove or
    reach, which writes it when the harness's own frame announces the end of the tests. The hook also refuses (with
    ValueError) `sys._getframe`, traceback and generator frames, `gc` walks, tracing, ctypes and opening any file on
    /proc. Everything the harness calls after the solution started was bound before (rebinding `builtins.exec`, the
    harness module's names or the builtins changes nothing). The tests are compiled before the solution runs and see
    a pristine copy of the builtins (`builtins.len = ...` does not reach them), and none of the solution's top-level
    names that shadow a builtin except `entry_point`; in an `assert` statement, `a == b` and `a != b` fail when an
    operand, or an element of a list/tuple/set/dict operand, has equality written in Python that the other operand's
    type does not share (an object equal to everything). Not defended: rebinding attributes of modules the tests use
    (`math.isclose = ...`), truthiness of custom objects in a bare `assert x`, `unittest`-style assertion methods,
    legitimate results whose Python-level equality differs in type from the expected value (a `Fraction` result for
    an `int`), races with the solution's own threads, and a child process reading the harness's memory (as the same
    user, or as root in its namespace, the kernel allows it).

    **Isolation.** Each program runs as `python -I` in a fresh temporary directory (its working directory, removed
    afterwards, so it cannot touch the trainer's folder by relative paths) with a minimal environment (PATH, HOME and
    TMPDIR in that directory, LANG, one-thread BLAS: no API keys or tokens of the trainer), in a session of its own,
    under RLIMIT_AS `memory_limit_mb`, RLIMIT_CPU `timeout` + 1 s, RLIMIT_FSIZE `file_size_limit_mb`, RLIMIT_CORE 0
    and RLIMIT_NOFILE 256, set by the harness before the solution. On timeout, and after every run, the whole
    process group is killed. Where unprivileged user namespaces work (probed once, `sandbox_isolates_network()`),
    the program also gets, through `unshare`, no network (an empty network namespace: not even the trainer's
    loopback), its own PID namespace (it is PID 1: it cannot see or signal the trainer's processes, and every
    process it started, a detached `setsid` one included, dies with it) with a fresh /proc (so no
    `/proc/<pid>/environ` of the trainer), and RLIMIT_NPROC `max_processes` (which the kernel does not enforce when
    the trainer runs as root). Without namespaces none of these four holds: the network is open, a process that
    calls `setsid` escapes the group kill, and the trainer's processes and their /proc files are reachable as the
    same user. Not isolated in either mode: the file system (absolute paths are reachable with the trainer's
    permissions), IPC and other kernel interfaces. Run untrusted generations inside a container or VM as well.
    Program output is discarded unread, so a program printing without end costs no memory."""
    rows = _test_rows(tests)
    entry_points = _entry_points(entry_point, len(rows))
    for index, (code, entry) in enumerate(zip(rows, entry_points, strict=True)):
        _check_tests_call_their_check(code, entry, index)
    rewards = []
    for completion, code, entry in zip(completions, rows, entry_points, strict=True):
        solution = _last_python_block(completion)
        if solution is None:
            rewards.append(0.0)
            continue
        limits = {"memory_limit_mb": memory_limit_mb, "file_size_limit_mb": file_size_limit_mb}
        passed = run_unit_tests(solution, code, timeout, entry, max_processes=max_processes, **limits)
        rewards.append(1.0 if passed else 0.0)
    return rewards


def _test_rows(tests) -> list[str]:
    """Each row's test code as one string: a string as it is, a list or tuple of strings joined by newlines."""
    if isinstance(tests, str):
        raise TypeError("`tests` must hold one entry per completion, got a single string (wrap it in a list)")
    rows = []
    for index, row in enumerate(tests):
        if isinstance(row, str):
            rows.append(row)
        elif isinstance(row, (list, tuple)) and all(isinstance(line, str) for line in row):
            rows.append("\n".join(row))
        else:
            raise TypeError(
                f"`tests` row {index}: expected a string of test code or a list of strings (one assert each), "
                f"got {_describe(row)}"
            )
    return rows


def _describe(value) -> str:
    if isinstance(value, (list, tuple)):
        kinds = sorted({type(item).__name__ for item in value})
        return f"a {type(value).__name__} of {', '.join(kinds) or 'nothing'}"
    return f"{type(value).__name__} {value!r:.60}"


def _entry_points(entry_point, count: int) -> list[str | None]:
    if entry_point is None:
        return [None] * count
    if isinstance(entry_point, str) or len(entry_point) != count:
        raise TypeError(f"`entry_point` must hold one function name per completion ({count}), got {entry_point!r:.80}")
    for index, name in enumerate(entry_point):
        if not (isinstance(name, str) and name.isidentifier()):
            raise TypeError(f"`entry_point` row {index}: expected a function name, got {name!r:.60}")
    return list(entry_point)


def _check_tests_call_their_check(code: str, entry_point: str | None, index: int) -> None:
    """Refuse HumanEval-style tests (a `def check(candidate)` nothing calls) without an `entry_point` to call it
    with: every program would pass them."""
    if entry_point is not None:
        return
    try:
        tree = ast.parse(code)
    except SyntaxError as error:
        raise ValueError(f"`tests` row {index} is not valid Python: {error}") from error
    defines_check = any(isinstance(node, ast.FunctionDef) and node.name == "check" for node in tree.body)
    calls_check = any(
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "check"
        for node in ast.walk(tree)
    )
    if defines_check and not calls_check:
        raise ValueError(
            f"`tests` row {index} defines check(candidate) but never calls it (HumanEval's layout): pass the "
            "dataset's `entry_point` column so that check(<entry_point>) runs"
        )


def run_unit_tests(
    solution: str,
    tests: str,
    timeout: float = 10.0,
    entry_point: str | None = None,
    memory_limit_mb: int = 4096,
    file_size_limit_mb: int = 64,
    max_processes: int = 64,
) -> bool:
    """Whether `tests` ran to their end after `solution`, in the sandbox described in `code_unit_test_reward`."""
    nonce = secrets.token_hex(16)
    namespaces = sandbox_isolates_network()
    limits = {
        "RLIMIT_AS": memory_limit_mb * 2**20,
        "RLIMIT_CPU": math.ceil(timeout) + 1,
        "RLIMIT_FSIZE": file_size_limit_mb * 2**20,
        "RLIMIT_CORE": 0,
        "RLIMIT_NOFILE": 256,
    }
    if namespaces:
        limits["RLIMIT_NPROC"] = max_processes
    workdir = tempfile.mkdtemp(prefix="aspo-unit-test-")
    proof_read, proof_write = os.pipe()
    try:
        payload = {
            "nonce": nonce,
            "solution": solution,
            "tests": tests,
            "entry_point": entry_point,
            "limits": limits,
            "proof_fd": proof_write,
        }
        command = [*(_NAMESPACES if namespaces else []), sys.executable, "-I", "-c", _HARNESS]
        with tempfile.TemporaryFile() as stdin:
            stdin.write(json.dumps(payload).encode())
            stdin.seek(0)
            process = subprocess.Popen(
                command,
                stdin=stdin,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                cwd=workdir,
                env=_minimal_environment(workdir),
                pass_fds=(proof_write,),
                start_new_session=True,
            )
        os.close(proof_write)
        proof_write = -1
        _wait_then_kill_group(process, timeout)
        os.set_blocking(proof_read, False)
        try:
            proof = os.read(proof_read, _PROOF_BYTES)
        except BlockingIOError:  # a descendant still holds the pipe open and wrote nothing
            proof = b""
        return secrets.compare_digest(proof, nonce.encode())
    finally:
        os.close(proof_read)
        if proof_write >= 0:
            os.close(proof_write)
        shutil.rmtree(workdir, ignore_errors=True)


def _minimal_environment(workdir: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _wait_then_kill_group(process: subprocess.Popen, timeout: float) -> None:
    """Wait up to `timeout` seconds for `process` to exit, then SIGKILL its whole process group (its session) and
    reap it. The group is killed while the leader is still an unreaped zombie, so its id cannot have been reused."""
    deadline = time.monotonic() + timeout
    pause = 0.002
    while time.monotonic() < deadline:
        if os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            break
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(pause * 2, 0.05)
    with contextlib.suppress(ProcessLookupError):  # the group is empty: nothing left to kill
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


@functools.cache
def sandbox_isolates_network() -> bool:
    """Whether `unshare` gives this machine's unprivileged user a user, network, PID and mount namespace (probed once
    per process): then unit-test programs run without network, in their own PID namespace."""
    if shutil.which("unshare") is None:
        return False
    probe = "import socket; socket.socket().connect_ex(('127.0.0.1', 9)) or exit(1)"
    try:
        result = subprocess.run(
            [*_NAMESPACES, sys.executable, "-I", "-c", probe],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0


def summed_rewards(reward_funcs: list[Callable]) -> Callable[..., list[float]]:
    """One TRL-style reward function returning, per completion, the sum of `reward_funcs` with weight 1 each, as
    TRL's asynchronous rollout worker scores (None counts as NaN and is skipped; NaN when every function abstains).
    Coroutine functions are awaited."""

    def total(**kwargs) -> list[float]:
        columns = []
        for func in reward_funcs:
            values = asyncio.run(func(**kwargs)) if inspect.iscoroutinefunction(func) else func(**kwargs)
            columns.append([math.nan if value is None else float(value) for value in values])
        totals = []
        for values in zip(*columns, strict=True):
            scored = [value for value in values if not math.isnan(value)]
            totals.append(sum(scored) if scored else math.nan)
        return totals

    return total
