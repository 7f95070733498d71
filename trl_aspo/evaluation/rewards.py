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
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import trl_aspo.evaluation.concurrency as concurrency
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
    allow_unconfined_root: bool = False,
    max_concurrency: int | None = None,
    allow_shared_neighbours: bool = False,
    prompts=None,
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
    does not answer in time fails; each run returns within its wall-clock bound (below) + 3 s whatever it does.
    Not supported (these score 0.0): tests that use objects of solution-defined classes (other than as tuples,
    dicts or numbers they subclass), that pass functions or other non-data arguments, that expect an argument
    mutated in place, or that read solution globals changed by calls.

    **Isolation.** The worker runs as `python -I` in a fresh folder with a minimal environment (PATH, HOME and TMPDIR
    in that folder, LANG, one-thread BLAS), its only descriptor beyond /dev/null being its socket to the judge, in a
    session of its own, under RLIMIT_AS `memory_limit_mb`, RLIMIT_CPU `timeout` + 1 s, RLIMIT_FSIZE
    `file_size_limit_mb`, RLIMIT_CORE 0 and RLIMIT_NOFILE 256. Where this machine gives them (probed once;
    `trl_aspo.evaluation.isolation`): a user, mount, network, PID, IPC and UTS namespace, in which the worker sees a
    file system of its own (the interpreter's prefixes and the system's /usr read-only, a fresh read-only /proc,
    its folder and /dev/shm as private tmpfs of at most `memory_limit_mb`; none of the trainer's files or Unix
    sockets), has no network, is PID 1 with every process it starts dying with it, shares no SysV IPC object with
    the machine, and keeps no capability; a cgroup created per run holding the whole program to `max_processes`
    processes and `memory_limit_mb` of memory, whose processes are all killed after the run; when the trainer
    is root, the user `nobody`; and, in every mode, a fresh session keyring and a seccomp filter refusing the
    keyring calls and the page-cache probes (`seccomp`), so that nothing a completion leaves in the kernel reaches
    a later one. Each missing piece is named in one RuntimeWarning per process.
    `require_isolation=True` refuses to run (RuntimeError) without namespaces; a list of "namespaces", "cgroup",
    "user", "seccomp" requires those. A root trainer whose program would run as root with neither namespaces nor
    `nobody` is refused unless `allow_unconfined_root=True` (or the environment variable
    TRL_ASPO_ALLOW_UNCONFINED_ROOT=1): such a program can ptrace the judge. Run untrusted generations inside a
    container or VM as well. Program output is discarded unread.

    **Concurrency** (docs/code_reward.md). A batch's completions are judged at once, verdicts in order, under one
    limit for the whole process (every call shares it): `max_concurrency` for the node, divided by
    `LOCAL_WORLD_SIZE`; by default `max(2, 4 x usable CPUs)` where a run's cgroup counts CPU time (else the usable
    CPUs), capped by memory (each run charged 2 x `memory_limit_mb`); 1 judges one after another. There `timeout`
    is the CPU time of the run's own processes (its cgroup and the judge), so spinning neighbours cannot fail a
    correct completion, and a run also ends once the wall time passed `timeout` + 0.5 s + the time it waited for a
    CPU, and at the latest at `timeout x ceil(concurrency / usable CPUs)` + 0.5 s. Without namespaces runs share
    the machine's PID space and user: the limit is 1, and more is refused unless `allow_shared_neighbours=True`.

    **Never stops the run.** Whatever a completion does, its reward is a number: an exception of its run (a folder
    it left that cannot be removed, a resource it exhausted) scores 0.0 with a RuntimeWarning naming it, and its
    folder is removed without recursion (any depth). Only arguments that are wrong for every row (the tests'
    layout, the isolation refusals) raise.

    **Fidelity** (docs/code_reward.md). The solution runs as a module named `solution` (so an
    `if __name__ == "__main__":` block does not run); a result that is not data (a generator, a map, an instance)
    reaches the tests as an object whose iteration and truth value happen in the worker; deque, range, dict views,
    datetime values, OrderedDict, Counter and defaultdict cross as themselves. With `prompts` (TRL passes them),
    the functions a row's prompt defines in full (HumanEval's `encode_cyclic`) are the prompt's in the tests, not
    the solution's redefinition; the function under test never is (`prompt_helpers`)."""
    rows = _test_rows(tests)
    entry_points = _entry_points(entry_point, len(rows))
    for index, (code, entry) in enumerate(zip(rows, entry_points, strict=True)):
        _check_tests_call_their_check(code, entry, index)
    prompt_rows = [None] * len(rows) if prompts is None else list(prompts)
    isolation.check_isolation(require_isolation, allow_unconfined_root)
    cpu_budgets = _counts_cpu()
    limit = concurrency.process_limit(
        max_concurrency, memory_limit_mb, cpu_budgets, isolation.sandbox_isolates_network(), allow_shared_neighbours
    )
    options = {
        "wall_timeout": concurrency.wall_cap(timeout, limit, cpu_budgets),
        "memory_limit_mb": memory_limit_mb,
        "file_size_limit_mb": file_size_limit_mb,
        "max_processes": max_processes,
    }
    jobs = list(enumerate(zip(completions, rows, entry_points, prompt_rows, strict=True)))

    def judged(job) -> float:
        index, (completion, code, entry, prompt) = job
        with concurrency.SLOTS.slot(limit):
            return _one_reward(index, completion, code, entry, prompt, timeout, options)

    if limit == 1 or len(jobs) <= 1:
        return [judged(job) for job in jobs]
    pool = ThreadPoolExecutor(max_workers=min(limit, len(jobs)), thread_name_prefix="aspo-judge")
    try:
        return list(pool.map(judged, jobs))
    finally:  # on an interrupt (Ctrl-C), the runs not started are dropped and the running ones end in their time
        pool.shutdown(wait=True, cancel_futures=True)


def _counts_cpu() -> bool:
    """Whether a run's timeout is its CPU time: a run's cgroup here measures it (`CgroupParents.counts_cpu`)."""
    parents = isolation.sandbox_cgroup()
    return isinstance(parents, isolation.CgroupParents) and parents.counts_cpu


def _one_reward(index: int, completion, code: str, entry: str | None, prompt, timeout: float, options: dict) -> float:
    """One completion's reward. Nothing a completion causes raises out of here: any exception (a folder it made
    that cannot be removed, a resource it exhausted) scores 0.0 with a RuntimeWarning naming it, so one completion
    never stops the run."""
    try:
        solution = _last_python_block(completion)
        if solution is None:
            return 0.0
        helpers = prompt_helpers(prompt, entry, code)
        return 1.0 if _run(solution, code, timeout, entry, helpers, **options) else 0.0
    except Exception as error:  # noqa: BLE001 -- one completion must not stop the run
        warnings.warn(
            f"code_unit_test_reward: completion {index} scored 0.0 because its run failed: "
            f"{type(error).__name__}: {error!s:.300}",
            RuntimeWarning,
            stacklevel=3,
        )
        return 0.0


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


_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
_CODE_BLOCK = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL)


def prompt_helpers(prompt, entry_point: str | None = None, tests: str = "") -> str:
    """The functions a row's prompt defines in full that are helpers of the function under test (HumanEval/38's
    `encode_cyclic`, /32's `poly`), with the prompt's imports, as source the judge runs before the tests: the tests
    then call the prompt's helper, not a redefinition in the solution (a wrong `encode_cyclic`/`decode_cyclic` pair
    passed otherwise). The function under test is never taken from the prompt:

    - a stub (a function whose body is only a docstring, `pass`, `...` or `raise NotImplementedError`) is the one to
      write, and so is `entry_point`: neither is taken;
    - without `entry_point` (the MBPP layout) and without any stub in the prompt, the prompt shows the function to
      change ("fix the bug in this function", "rewrite it without +"): no function whose name `tests` reads is
      taken (issue 45 item 2: a correct fix scored 0.0 and `return 42` 1.0 when the prompt's version was).

    The prompt is a string or chat messages; its code is the whole text where it parses as Python, else its code
    blocks."""
    trees = [tree for text in _prompt_texts(prompt) for tree in _prompt_trees(text)]
    functions = [node for tree in trees for node in tree.body if isinstance(node, _FUNCTIONS)]
    stubs = {node.name for node in functions if _is_stub(node)}
    never = stubs | {entry_point}
    if entry_point is None and not stubs:
        never |= _names_read(tests)
    kept = [
        node
        for tree in trees
        for node in tree.body
        if _is_import(node) or (isinstance(node, _FUNCTIONS) and node.name not in never)
    ]
    return "\n".join(ast.unparse(node) for node in kept)


def _prompt_trees(text: str) -> list:
    """The prompt text's code: the whole text where it parses as Python, else each code block that parses."""
    whole = _parsed(text)
    if whole is not None:
        return [whole]
    return [tree for tree in map(_parsed, _CODE_BLOCK.findall(text)) if tree is not None]


def _names_read(tests: str) -> set[str]:
    """Every name the tests read (a call, an argument, `check(candidate)`'s use of a global)."""
    tree = _parsed(tests)
    if tree is None:
        return set()
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}


def _prompt_texts(prompt) -> list[str]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list):
        return [
            message["content"]
            for message in prompt
            if isinstance(message, dict) and isinstance(message.get("content"), str)
        ]
    return []


def _parsed(text: str):
    try:
        return ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _is_import(node) -> bool:
    return isinstance(node, ast.Import) or (isinstance(node, ast.ImportFrom) and not node.level)


def _is_stub(node) -> bool:
    """A function to write: its body (after a docstring) is only `pass`, `...` or `raise NotImplementedError`."""
    body = node.body[1:] if node.body and _is_docstring(node.body[0]) else node.body
    return all(_is_stub_statement(statement) for statement in body)


def _is_docstring(statement) -> bool:
    return (
        isinstance(statement, ast.Expr)
        and isinstance(statement.value, ast.Constant)
        and isinstance(statement.value.value, str)
    )


def _is_stub_statement(statement) -> bool:
    if isinstance(statement, ast.Pass):
        return True
    if (
        isinstance(statement, ast.Expr)
        and isinstance(statement.value, ast.Constant)
        and statement.value.value is Ellipsis
    ):
        return True
    if isinstance(statement, ast.Raise) and statement.exc is not None:
        raised = statement.exc.func if isinstance(statement.exc, ast.Call) else statement.exc
        return isinstance(raised, ast.Name) and raised.id == "NotImplementedError"
    return False


def run_unit_tests(
    solution: str,
    tests: str,
    timeout: float = 10.0,
    entry_point: str | None = None,
    memory_limit_mb: int = 4096,
    file_size_limit_mb: int = 64,
    max_processes: int = 64,
    require_isolation=False,
    allow_unconfined_root: bool = False,
    helpers: str = "",
) -> bool:
    """Whether `tests` ran to their end against `solution`, judged as described in `code_unit_test_reward` (one
    run, in a slot of the process-wide limit at its default; `helpers`: source the judge runs before the tests,
    `prompt_helpers`)."""
    isolation.check_isolation(require_isolation, allow_unconfined_root)
    cpu_budgets = _counts_cpu()
    namespaces = isolation.sandbox_isolates_network()
    limit = concurrency.process_limit(None, memory_limit_mb, cpu_budgets, namespaces, False)
    wall_timeout = concurrency.wall_cap(timeout, limit, cpu_budgets)
    with concurrency.SLOTS.slot(limit):
        return _run(
            solution, tests, timeout, entry_point, helpers, wall_timeout, memory_limit_mb, file_size_limit_mb,
            max_processes,
        )  # fmt: skip


def _run(
    solution: str,
    tests: str,
    timeout: float,
    entry_point: str | None,
    helpers: str,
    wall_timeout: float,
    memory_limit_mb: int,
    file_size_limit_mb: int,
    max_processes: int,
) -> bool:
    """One run: `timeout` is the CPU time of the run's processes (its cgroup and the judge) where the cgroup counts
    it, else wall time; `wall_timeout` ends it in any case (a sleeping program)."""
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
        stack.callback(_remove_folder, workdir)
        _RUN_FOLDERS.add(workdir)
        stack.callback(_RUN_FOLDERS.discard, workdir)
        judge_dir = tempfile.mkdtemp(prefix="aspo-unit-judge-")
        stack.callback(_remove_folder, judge_dir)
        if user is not None:
            os.chown(workdir, user, user)
        if user is not None and not namespaces:  # after the cgroup's processes are gone (the stack unwinds in order)
            stack.callback(_remove_shared_leftovers, user, isolation.entries_owned_by(user))
        cgroup = None
        if isinstance(parents, isolation.CgroupParents):
            cgroup = isolation.RunCgroup(parents, max_processes, memory_limit_mb * 2**20)
            stack.callback(cgroup.close)
        channel_judge, channel_worker = _socket_pair(stack)
        channel_worker_fd = channel_worker.fileno()  # its number in the worker too (pass_fds keeps numbers)
        verdict_trainer, verdict_judge = _socket_pair(stack)
        judge_payload = {
            "tests": tests,
            "helpers": helpers,
            "entry_point": entry_point,
            "timeout": wall_timeout,
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
        role = ["worker", "confine", str(memory_limit_mb)] if namespaces else ["worker"]
        command = isolation.launch_command([*command, *role], cgroup.procs_files if cgroup else [], user)
        worker = _spawn(stack, command, worker_stdin, workdir, (channel_worker,))
        for end in (worker_stdin, channel_worker, channel_judge):
            end.close()
        if not _judge_is_ready(verdict_trainer):
            return False
        clock = concurrency.RunClock(timeout, wall_timeout, cgroup, judge.pid)
        worker_payload = {
            "solution": solution,
            "limits": worker_limits,
            "channel_fd": channel_worker_fd,
            "seccomp": isolation.sandbox_seccomp(),
        }
        if not _send_all(feed, json.dumps(worker_payload).encode(), wall_timeout):
            return False
        _wait_for_exit(judge, clock)
        return _end_run(judge, worker, cgroup) and _read_verdict(verdict_trainer) == sandbox.PASS


def _remove_folder(path: str) -> None:
    """Remove a run's folder (`isolation.remove_tree`, which never raises); a RuntimeWarning names what is left."""
    if not isolation.remove_tree(path):
        warnings.warn(f"code_unit_test_reward: could not remove {path} entirely", RuntimeWarning, stacklevel=2)


_RUN_FOLDERS: set[str] = set()  # the folders of the runs in progress in this process (each removed by its own run)


def _remove_shared_leftovers(user: int, before: set) -> None:
    """Remove what the program (as `user`, without namespaces) left in the machine's /dev/shm, /tmp and /var/tmp
    (`isolation.remove_new_entries`), but the folders of runs still in progress; a RuntimeWarning names what is
    left."""
    running = {entry for entry in isolation.entries_owned_by(user) if entry[0] in _RUN_FOLDERS}
    left = isolation.remove_new_entries(user, before | running)
    if left:
        warnings.warn(f"code_unit_test_reward: could not remove {', '.join(left)}", RuntimeWarning, stacklevel=2)


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
    """SIGKILL `process`'s group (its session) and every process of `cgroup`, then reap `process` (`_reap`)."""
    _signal_group(process)
    if cgroup is not None:
        cgroup.kill()
    _reap(process, time.monotonic() + _REAP_WAIT_S)


def _signal_group(process: subprocess.Popen) -> None:
    """SIGKILL `process`'s group (its session) while `process` is unreaped, so that the group's id cannot have been
    reused; nothing when it was reaped already."""
    if process.returncode is None and process not in _REAPERS:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)


_REAP_WAIT_S = 2.0  # what a killed process is given to be reaped before a reaper thread takes it over
_REAPERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # processes a reaper thread waits for


def _reap(process: subprocess.Popen, until: float) -> bool:
    """Wait for a killed `process` until `until` (monotonic seconds) at most; True once reaped. A process stopped
    under a ptrace tracer that the kill did not reach (a detached grandchild, where no cgroup holds it) cannot be
    reaped until that tracer lets go: it is handed to a daemon thread that waits for it, and False comes back, so
    the reward still returns."""
    if process in _REAPERS:
        return False
    try:
        process.wait(max(0.0, until - time.monotonic()))
    except subprocess.TimeoutExpired:
        reaper = threading.Thread(target=process.wait, name=f"aspo-reaper-{process.pid}", daemon=True)
        _REAPERS[process] = reaper
        reaper.start()
        return False
    return True


def _end_run(judge: subprocess.Popen, worker: subprocess.Popen, cgroup) -> bool:
    """Kill the worker's group and cgroup first (a tracer of the judge among them lets it go), then the judge's
    group, and reap both (`_reap`: 2 s at most for the two); whether the judge exited 0. A judge that cannot be reaped
    scores 0.0 with a RuntimeWarning: a run returns within its time (`concurrency.RunClock`) + 3 s in every mode
    (issue 45 item 3: a completion that ptrace-attached to its judge and slept held a 3 s reward for 40 s)."""
    _signal_group(worker)
    if cgroup is not None:
        cgroup.kill()
    _signal_group(judge)
    until = time.monotonic() + _REAP_WAIT_S
    judge_reaped = _reap(judge, until)
    _reap(worker, until)
    if not judge_reaped:
        warnings.warn(
            f"code_unit_test_reward: the judge (pid {judge.pid}) could not be reaped {_REAP_WAIT_S:g} s after it was "
            "killed (a process of the program holds it under ptrace); the completion scores 0.0 and a thread reaps "
            "the judge once it is released",
            RuntimeWarning,
            stacklevel=4,
        )
        return False
    return judge.returncode == 0


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


def _wait_for_exit(process: subprocess.Popen, clock: concurrency.RunClock) -> None:
    """Wait until `process` exited (without reaping it: its group is killed afterwards, under an id that cannot have
    been reused) or the run's time is up (`clock`)."""
    pause = 0.002
    while not clock.expired():
        if os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


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
