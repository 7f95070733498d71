"""Reward functions for the reference recipes that TRL does not ship, and the asynchronous trainer's reward sum."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import inspect
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import trl_aspo.evaluation.isolation as isolation  # as a module: not through the package, which imports this one
import trl_aspo.evaluation.sandbox as sandbox
from trl_aspo.evaluation.isolation import sandbox_isolates_network

__all__ = ["code_unit_test_reward", "run_unit_tests", "sandbox_isolates_network", "summed_rewards"]

_PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)
_JUDGE_START_S = 60.0  # the judge's start (an interpreter, the tests' imports) is not the solution's time


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
    require_isolation=False,
    **kwargs,
) -> list[float]:
    """1.0 when the completion's last ```python block passes its row's `tests` to the end, else 0.0.

    `tests[i]` is the test code of row i: one string (HumanEval's `test` column) or a list of strings (one assert
    each, MBPP's `test_list`), joined by newlines. With `entry_point` (HumanEval's column, one name per row) the
    judge also calls `check(<entry_point>)`, which the HumanEval tests define but never call; tests that define
    `check` without an `entry_point` are refused (every program would pass them).

    **Passing** (docs/code_reward.md has the whole design). Two processes: a *worker* runs the solution and then
    only answers calls; a *judge* runs the tests, in which each of the solution's top-level functions is a proxy
    that sends its arguments to the worker and returns the decoded result. Arguments, results and exceptions cross
    as data only (a tagged encoding of None, bool, int, float with nan/inf/-0.0, complex, str, bytes, Fraction,
    Decimal and list/tuple/dict/set/frozenset of those; numpy values become their Python values), so no object of
    the solution exists in the judge: nothing it returns can be equal to everything, rebind the judge's builtins or
    modules, or stop the tests early. Top-level data of the solution is passed by value, its modules as the judge's
    own standard module of that name; names that shadow a builtin (except `entry_point`) are not passed. The judge
    is not dumpable before the worker starts (its memory, ptrace and descriptors are closed to the worker), and it
    reports the verdict to this process on a socket the worker never holds; this process scores 1.0 only when the
    judge exited 0 after writing it. The worker holds no secret: nothing it reads, writes or kills can make a
    failing solution pass. A solution that fails at import, exits, crashes, answers something that is not data or
    does not answer by `timeout` fails. Not supported (these score 0.0): tests that use objects of
    solution-defined classes (other than as tuples, dicts or numbers they subclass), that pass functions or other
    non-data arguments, that expect an argument mutated in place, or that read solution globals changed by calls.

    **Isolation.** The worker runs as `python -I` in a fresh temporary directory (removed afterwards) with a minimal
    environment (PATH, HOME and TMPDIR in that directory, LANG, one-thread BLAS), its only descriptor beyond
    /dev/null being its socket to the judge, in a session of its own, under RLIMIT_AS `memory_limit_mb`, RLIMIT_CPU
    `timeout` + 1 s, RLIMIT_FSIZE `file_size_limit_mb`, RLIMIT_CORE 0 and RLIMIT_NOFILE 256. Where this machine
    gives them (probed once; `trl_aspo.evaluation.isolation`): a user, network, PID and mount namespace (no
    network, not even the trainer's loopback; PID 1 of its own namespace with a fresh /proc, every process it
    started dying with it; every mount read-only but its directory, and no capability left to unmount or remount);
    a cgroup created per run holding the whole program to `max_processes` processes and `memory_limit_mb` of memory
    (v2 `pids.max`/`memory.max`, or the v1 pids and memory hierarchies), whose processes are all killed after the
    run; and, when the trainer is root, the user `nobody`. Each missing piece is named in one RuntimeWarning per
    process: without namespaces the program can reach the trainer's 127.0.0.1 sockets and see its processes, a
    `setsid` child outlives the reward unless a cgroup holds it, and it writes what its user may; without a cgroup
    the limits are per process (RLIMIT_NPROC per user and not enforced for root, RLIMIT_AS per process); as the
    trainer's own user and without namespaces, it may ptrace or write the trainer's memory where the kernel allows
    (yama ptrace_scope 0), against which nothing above holds. `require_isolation=True` refuses to run
    (RuntimeError) without namespaces; a list of "namespaces", "cgroup", "user" requires those. Never isolated:
    reading the files its user may read, IPC and other kernel interfaces. Run untrusted generations inside a
    container or VM as well. Program output is discarded unread."""
    rows = _test_rows(tests)
    entry_points = _entry_points(entry_point, len(rows))
    for index, (code, entry) in enumerate(zip(rows, entry_points, strict=True)):
        _check_tests_call_their_check(code, entry, index)
    isolation.check_isolation(require_isolation)
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
    require_isolation=False,
) -> bool:
    """Whether `tests` ran to their end against `solution`, judged as described in `code_unit_test_reward`."""
    isolation.check_isolation(require_isolation)
    namespaces, user = isolation.sandbox_isolates_network(), isolation.sandbox_user()
    parents = isolation.sandbox_cgroup()
    limits = {
        "RLIMIT_AS": memory_limit_mb * 2**20,
        "RLIMIT_CPU": math.ceil(timeout) + 1,
        "RLIMIT_FSIZE": file_size_limit_mb * 2**20,
        "RLIMIT_CORE": 0,
        "RLIMIT_NOFILE": 256,
    }
    worker_limits = dict(limits)
    if namespaces or user is not None:  # counted per user: the trainer's own threads would count otherwise
        worker_limits["RLIMIT_NPROC"] = max_processes
    judge_limits = {name: limits[name] for name in ("RLIMIT_AS", "RLIMIT_CORE")}
    with contextlib.ExitStack() as stack:
        workdir = tempfile.mkdtemp(prefix="aspo-unit-test-")
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        judge_dir = tempfile.mkdtemp(prefix="aspo-unit-judge-")
        stack.callback(shutil.rmtree, judge_dir, ignore_errors=True)
        if user is not None:
            os.chown(workdir, user, user)
        cgroup = None
        if isinstance(parents, isolation.CgroupParents):
            cgroup = isolation.RunCgroup(parents, max_processes, memory_limit_mb * 2**20)
            stack.callback(cgroup.close)
        channel_judge, channel_worker = _socket_pair(stack)
        channel_worker_fd = channel_worker.fileno()  # its number in the worker too (pass_fds keeps numbers)
        verdict_trainer, verdict_judge = _socket_pair(stack)
        judge_payload = {
            "tests": tests,
            "entry_point": entry_point,
            "timeout": timeout,
            "limits": judge_limits,
            "channel_fd": channel_judge.fileno(),
            "verdict_fd": verdict_judge.fileno(),
        }
        judge_command = [sys.executable, "-I", "-c", isolation.SANDBOX_SOURCE, "judge"]
        with _payload_file(judge_payload) as stdin:
            judge = _spawn(stack, judge_command, stdin, judge_dir, (channel_judge, verdict_judge))
        verdict_judge.close()
        # The worker's interpreter starts while the judge's does; the solution reaches it only once the judge is
        # ready (not dumpable): until then the worker runs nothing but this source, blocked on its stdin.
        feed, worker_stdin = _socket_pair(stack)
        command = [*(isolation.NAMESPACES if namespaces else []), sys.executable, "-I", "-c", isolation.SANDBOX_SOURCE]
        role = ["worker", "confine"] if namespaces else ["worker"]
        command = isolation.launch_command([*command, *role], cgroup.procs_files if cgroup else [], user)
        worker = _spawn(stack, command, worker_stdin, workdir, (channel_worker,))
        for end in (worker_stdin, channel_worker, channel_judge):
            end.close()
        if not _judge_is_ready(verdict_trainer):
            return False
        worker_payload = {"solution": solution, "limits": worker_limits, "channel_fd": channel_worker_fd}
        if not _send_all(feed, json.dumps(worker_payload).encode(), timeout):
            return False
        _wait_then_kill_group(judge, timeout)
        _kill_group(worker, cgroup)
        return judge.returncode == 0 and _read_verdict(verdict_trainer) == sandbox.PASS


def _socket_pair(stack: contextlib.ExitStack) -> tuple[socket.socket, socket.socket]:
    """A connected pair of Unix sockets, closed with `stack`. Sockets, not pipes: a process that may open
    /proc/<pid>/fd/<n> of a pipe gets a new end of it, of a socket nothing."""
    pair = socket.socketpair()
    for end in pair:
        stack.callback(end.close)
    return pair


@contextlib.contextmanager
def _payload_file(payload: dict):
    """`payload` as JSON in an unlinked file: a child reads it as its stdin, with nothing to feed while it runs."""
    with tempfile.TemporaryFile() as stdin:
        stdin.write(json.dumps(payload).encode())
        stdin.seek(0)
        yield stdin


def _spawn(stack, command, stdin, workdir, keep: tuple[socket.socket, ...]) -> subprocess.Popen:
    """`command` in a session of its own with `stdin`, only `keep` inherited besides, output discarded unread; its
    whole group is killed with `stack`."""
    process = subprocess.Popen(
        command,
        stdin=stdin,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=workdir,
        env=_minimal_environment(workdir),
        pass_fds=tuple(end.fileno() for end in keep),
        start_new_session=True,
    )
    stack.callback(_kill_group, process, None)
    return process


def _send_all(feed: socket.socket, data: bytes, timeout: float) -> bool:
    """Write `data` to the worker's stdin and close it, within `timeout`; False if the worker is gone or stuck."""
    feed.settimeout(timeout)
    try:
        feed.sendall(data)
        feed.shutdown(socket.SHUT_WR)
    except OSError:
        return False
    return True


def _judge_is_ready(verdict: socket.socket) -> bool:
    """Whether the judge said it is ready (not dumpable, the tests compiled and their imports done)."""
    verdict.settimeout(_JUDGE_START_S)
    try:
        return verdict.recv(len(sandbox.READY)) == sandbox.READY
    except OSError:
        return False


def _read_verdict(verdict: socket.socket) -> bytes:
    verdict.setblocking(False)
    try:
        return verdict.recv(64)
    except OSError:  # nothing written
        return b""


def _kill_group(process: subprocess.Popen, cgroup) -> None:
    """SIGKILL `process`'s group (its session) and every process of `cgroup`, then reap `process`."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
    if cgroup is not None:
        cgroup.kill()
    process.wait()


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
