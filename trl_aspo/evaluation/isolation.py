"""What the code reward's sandbox can isolate on this machine, probed once per process: namespaces (`unshare`: user,
mount with a file system of the worker's own, PID, network, IPC and UTS), a user other than the trainer's (`nobody`,
when the trainer is root), a cgroup holding the whole program's process count and memory (v2
`pids.max`/`memory.max`, or the v1 `pids` and `memory` hierarchies) and the worker's seccomp filter (libseccomp:
keyrings and page-cache probes refused, sandbox.py `install_seccomp`). The warning of what is not isolated, the
refusals (`require_isolation`; a root trainer without namespaces or another user unless `allow_unconfined_root`), the
per-run cgroup and the removal of the worker's folder (`remove_tree`) live here too."""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from collections import deque
from dataclasses import dataclass
from pathlib import Path

NOBODY = 65534
# The worker starts as root of its own user namespace, builds a file system of its own (a tmpfs root holding
# read-only binds of the interpreter and the system's libraries, a fresh /proc, its folder) and then drops every
# capability for good (sandbox.py `_confine`): it sees none of the trainer's files, writes only its folder and
# /dev/shm (both private tmpfs that end with it), and cannot unmount, remount or mount.
NAMESPACES = [
    "unshare", "--user", "--map-root-user", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child",
    "--mount-proc",
]  # fmt: skip
PIECES = ("namespaces", "cgroup", "user", "seccomp")
# Read once at import: a program that rewrites the package's files cannot change what later runs execute.
SANDBOX_SOURCE = Path(__file__).with_name("sandbox.py").read_text()
# The opt-in to run model code as root with neither namespaces nor another user (issue 31 item 2), for a run that
# cannot pass the keyword (the train command's reward_funcs are import paths).
ALLOW_UNCONFINED_ROOT_ENV = "TRL_ASPO_ALLOW_UNCONFINED_ROOT"
_CONSEQUENCES = {
    "namespaces": "no user, mount, network, PID and IPC namespace (`unshare` does not work here): the program sees "
    "and reads every file its user can, can connect to the trainer's 127.0.0.1 and Unix sockets, sees every process "
    "on the machine, can signal those of its user, shares SysV IPC objects with the machine, and a child that calls "
    "setsid outlives the reward unless a cgroup holds it",
    "cgroup": "no cgroup ({reason}): max_processes is RLIMIT_NPROC (counted per user, not enforced for root) and "
    "memory_limit_mb is RLIMIT_AS per process, so several processes together can exceed it",
    "user": "the program runs as the trainer's user (uid {uid}){more}",
    "seccomp": "no seccomp filter (libseccomp.so.2 cannot load, or the kernel refuses a filter): the program can "
    "use kernel keyrings (add_key, keyctl, request_key), whose keys outlive the run and are read by a later "
    "completion, and page-cache probes (mincore, preadv2 with RWF_NOWAIT, fadvise64, readahead, io_uring), "
    "through which a later completion reads what an earlier one learned",
}
_USER_IN_NAMESPACES = (
    " outside its user namespace: it has no capability and sees only its own file system (the interpreter, the "
    "system's libraries, its folder), but per-user limits (RLIMIT_NPROC) do not hold it"
)
_USER_WITHOUT_NAMESPACES = (
    ": it can read every file that user can, write them, signal that user's processes, and ptrace or write the "
    "trainer's memory where kernel.yama.ptrace_scope is 0 (then a failing solution can be made to pass)"
)
_warned: list[str] = []


def sandbox_user() -> int | None:
    """`nobody`'s uid when the trainer is root, `setpriv` exists and `nobody` can run this Python the way the worker
    runs (in the namespaces where `sandbox_isolates_network()`; probed once per mode), else None."""
    return NOBODY if _nobody_runs(sandbox_isolates_network()) else None


@functools.cache
def _nobody_runs(namespaces: bool) -> bool:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return False
    if namespaces:
        return _confinement_probe(NOBODY)
    return _runs(launch_command([sys.executable, "-I", "-c", "pass"], [], NOBODY))


@functools.cache
def sandbox_isolates_network() -> bool:
    """Whether `unshare` gives the program a user, mount, network, PID and IPC namespace and the file system of its
    own works (probed once per process): then programs run without network, in their own PID namespace, seeing none
    of the trainer's files."""
    return _namespaces_work(None)


@functools.cache
def sandbox_seccomp() -> bool:
    """Whether the worker's seccomp filter (sandbox.py `install_seccomp`: keyrings and page-cache probes refused)
    installs here and refuses keyctl (probed once per process, in a child: a filter cannot be removed)."""
    return _runs([sys.executable, "-I", "-c", SANDBOX_SOURCE, "seccomp"])


@functools.cache
def _namespaces_work(user: int | None) -> bool:
    if shutil.which("unshare") is None:
        return False
    return _confinement_probe(user)


def _confinement_probe(user: int | None) -> bool:
    """Whether the worker's confinement works (sandbox.py `_probe`): run in a fresh folder, it must see that folder
    empty, a file of the trainer's beside it not at all, and no network."""
    folder = tempfile.mkdtemp(prefix="aspo-probe-")
    try:
        work, secret = Path(folder, "work"), Path(folder, "secret")
        work.mkdir()
        secret.write_text("")
        (work / "visible").write_text("")
        if user is not None:
            os.chown(folder, user, user)
            os.chown(work, user, user)
        command = [*NAMESPACES, sys.executable, "-I", "-c", SANDBOX_SOURCE, "probe", str(secret)]
        return _runs(launch_command(command, [], user), cwd=str(work))
    finally:
        remove_tree(folder)


# Joins each cgroup given (its own pid into their cgroup.procs) before anything else runs, then execs the command
# (without the PWD the shell exports: the environment stays the minimal one).
_JOIN_CGROUPS = (
    'unset PWD OLDPWD; n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 126; shift; n=$((n - 1)); done; '
    'exec "$@"'
)


def launch_command(command: list[str], cgroup_procs: list[str], user: int | None) -> list[str]:
    """`command` run as `user` (through setpriv) inside the cgroups whose `cgroup.procs` files are given: a shell
    (as the trainer's user) writes its pid into them and execs setpriv, which execs the command; so both hold
    before the command's first instruction. setpriv rather than os.setresuid: on some machines an interpreter under
    a directory closed to `nobody` (/root/.pyenv) starts after setpriv's change of user but not after Python's."""
    if user is not None:
        command = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *command]
    if cgroup_procs:
        command = ["sh", "-c", _JOIN_CGROUPS, "sh", str(len(cgroup_procs)), *cgroup_procs, *command]
    return command


def _runs(command: list[str], cwd: str | None = None) -> bool:
    try:
        result = subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=30,
            cwd=cwd,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0


# Cgroups ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CgroupParents:
    """Where a run's cgroup is created: one v2 directory, or the v1 `pids` and `memory` directories and, where this
    process may create children there, the v1 `cpuacct` one (the run's CPU time, `RunCgroup.cpu_seconds`)."""

    version: int
    directories: tuple[str, ...]

    @property
    def counts_cpu(self) -> bool:
        """Whether a run's cgroup measures its CPU time (v2 `cpu.stat`, always there; v1 `cpuacct`)."""
        return self.version == 2 or len(self.directories) == 3


@functools.cache
def sandbox_cgroup() -> CgroupParents | str:
    """The cgroup parents this process may create children in (probed once), or why there are none."""
    found_mounts = mounts()
    own = own_cgroups()
    reasons = []
    for mount, kind, _options in found_mounts:
        if kind == "cgroup2" and "" in own:
            parent = mount + own[""]
            found = _v2_parent(parent)
            if isinstance(found, CgroupParents):
                return found
            reasons.append(found)
    v1 = {controller: _v1_directory(found_mounts, own, controller) for controller in ("pids", "memory")}
    if all(v1.values()):
        failure = next(filter(None, (_can_create_child(directory) for directory in v1.values())), None)
        if failure is None:
            accounting = _v1_directory(found_mounts, own, "cpuacct")
            extra = (accounting,) if accounting and _can_create_child(accounting) is None else ()
            return CgroupParents(1, (v1["pids"], v1["memory"], *extra))
        reasons.append(f"cgroup v1: {failure}")
    elif not reasons:
        reasons.append("no cgroup v2 with the pids and memory controllers and no v1 pids and memory hierarchies")
    return "; ".join(reasons)


def _v1_directory(found_mounts, own: dict[str, str], controller: str) -> str | None:
    """This process's v1 cgroup directory of `controller`, or None without that hierarchy."""
    for mount, kind, options in found_mounts:
        if kind == "cgroup" and controller in options.split(",") and controller in own:
            return mount + own[controller]
    return None


def mounts() -> list[tuple[str, str, str]]:
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return []
    return [(fields[1], fields[2], fields[3]) for fields in map(str.split, lines) if len(fields) >= 4]


def own_cgroups() -> dict[str, str]:
    """This process's cgroup path per controller ("" for v2), from /proc/self/cgroup."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return {}
    own = {}
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            own[controller] = path.rstrip("/")
    return own


def _v2_parent(parent: str) -> CgroupParents | str:
    try:
        enabled = Path(parent, "cgroup.subtree_control").read_text().split()
        available = Path(parent, "cgroup.controllers").read_text().split()
    except OSError as error:
        return f"cgroup v2 at {parent}: {error.strerror}"
    if not {"pids", "memory"} <= set(available):
        return f"cgroup v2 at {parent} offers {' '.join(available) or 'no controllers'}, not pids and memory"
    if not {"pids", "memory"} <= set(enabled):
        try:
            Path(parent, "cgroup.subtree_control").write_text("+pids +memory")
        except OSError as error:
            return f"cgroup v2 at {parent}: cannot enable pids and memory for children ({error.strerror})"
    failure = _can_create_child(parent)
    return CgroupParents(2, (parent,)) if failure is None else f"cgroup v2: {failure}"


def _can_create_child(parent: str) -> str | None:
    probe = Path(parent, f"aspo-probe-{secrets.token_hex(4)}")
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as error:
        return f"cannot create a cgroup in {parent} ({error.strerror})"
    return None


class RunCgroup:
    """One run's cgroup: created with the limits for the whole program, emptied (every process SIGKILLed) and removed
    by `close`."""

    def __init__(self, parents: CgroupParents, max_processes: int, memory_bytes: int):
        name = f"aspo-run-{os.getpid()}-{secrets.token_hex(6)}"
        self.version = parents.version
        self.directories = [Path(parent, name) for parent in parents.directories]
        for directory in self.directories:
            directory.mkdir()
        try:
            if self.version == 2:
                self._write(self.directories[0], "pids.max", max_processes)
                self._write(self.directories[0], "memory.max", memory_bytes)
                self._write(self.directories[0], "memory.swap.max", 0, optional=True)
                self._write(self.directories[0], "memory.oom.group", 1, optional=True)
            else:
                pids, memory = self.directories[:2]
                self._write(pids, "pids.max", max_processes)
                self._write(memory, "memory.limit_in_bytes", memory_bytes)
                self._write(memory, "memory.memsw.limit_in_bytes", memory_bytes, optional=True)
            if os.geteuid() == 0 and sandbox_user() is None:
                self._hand_files_to_nobody()
        except OSError:
            self.close()
            raise

    def _hand_files_to_nobody(self) -> None:
        """A root trainer's program that is not `nobody` is root outside its user namespace: as the owner of the
        cgroup's files it could raise their limits. Owned by `nobody` (mode 0644), only this root process writes
        them. (Moving itself to the parent cgroup stays possible under v1: the parent's files are the system's.)"""
        for directory in self.directories:
            for path in directory.iterdir():
                os.chown(path, NOBODY, NOBODY)

    def cpu_seconds(self) -> float | None:
        """The CPU time every process of the run used so far (v2 `cpu.stat` usage_usec, v1 `cpuacct.usage`), or None
        where the cgroup does not count it."""
        try:
            if self.version == 2:
                for line in (self.directories[0] / "cpu.stat").read_text().splitlines():
                    if line.startswith("usage_usec "):
                        return int(line.split()[1]) / 1e6
                return None
            if len(self.directories) == 3:
                return int((self.directories[2] / "cpuacct.usage").read_text()) / 1e9
        except (OSError, ValueError):
            return None
        return None

    def pids(self) -> list[int]:
        """The processes in the run's cgroup now."""
        try:
            return [int(pid) for pid in (self.directories[0] / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    @property
    def procs_files(self) -> list[str]:
        return [str(directory / "cgroup.procs") for directory in self.directories]

    @staticmethod
    def _write(directory: Path, name: str, value: int, optional: bool = False) -> None:
        path = directory / name
        if optional and not path.exists():
            return
        path.write_text(str(value))

    def kill(self) -> None:
        """SIGKILL every process in the cgroup, until it is empty (v1 has no cgroup.kill: repeat, since a process
        may fork while it is being killed; pids.max bounds how many there are)."""
        if self.version == 2 and (self.directories[0] / "cgroup.kill").exists():
            with contextlib.suppress(OSError):
                (self.directories[0] / "cgroup.kill").write_text("1")
        for _ in range(200):
            pids = set()
            for directory in self.directories:
                with contextlib.suppress(OSError):
                    pids.update(int(pid) for pid in (directory / "cgroup.procs").read_text().split())
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.005)

    def close(self) -> None:
        self.kill()
        for directory in self.directories:
            for _ in range(200):  # a killed process leaves the cgroup once it is reaped
                try:
                    directory.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.005)


# What is missing, warned once, refused on request --------------------------------------------------------------------


def missing_isolation() -> dict[str, str]:
    """Each piece of isolation this machine does not give (of `PIECES`), with what follows from its absence."""
    missing = {}
    if not sandbox_isolates_network():
        missing["namespaces"] = _CONSEQUENCES["namespaces"]
    cgroup = sandbox_cgroup()
    if not isinstance(cgroup, CgroupParents):
        missing["cgroup"] = _CONSEQUENCES["cgroup"].format(reason=cgroup)
    if sandbox_user() is None:
        more = _USER_IN_NAMESPACES if sandbox_isolates_network() else _USER_WITHOUT_NAMESPACES
        missing["user"] = _CONSEQUENCES["user"].format(uid=os.geteuid(), more=more)
    if not sandbox_seccomp():
        missing["seccomp"] = _CONSEQUENCES["seccomp"]
    return missing


def required_pieces(require_isolation) -> set[str]:
    """`require_isolation` as a set of `PIECES`: False none, True the namespaces, or an iterable of piece names."""
    if require_isolation is False or require_isolation is None:
        return set()
    if require_isolation is True:
        return {"namespaces"}
    if isinstance(require_isolation, str):
        require_isolation = [require_isolation]
    pieces = set(require_isolation)
    unknown = pieces - set(PIECES)
    if unknown:
        raise ValueError(
            f"`require_isolation`: unknown piece(s) {sorted(unknown)}; expected True, False or a list of {PIECES}"
        )
    return pieces


def unconfined_root_allowed(allow_unconfined_root: bool = False) -> bool:
    """Whether running model code as root without namespaces or another user was asked for: the keyword, or the
    environment variable `ALLOW_UNCONFINED_ROOT_ENV` set to 1."""
    return allow_unconfined_root is True or os.environ.get(ALLOW_UNCONFINED_ROOT_ENV) == "1"


def check_isolation(require_isolation, allow_unconfined_root: bool = False) -> None:
    """Refuse (RuntimeError naming the missing pieces) when a required piece is missing, and when the program would
    run as root with neither namespaces nor another user unless `allow_unconfined_root` (or the environment
    variable) asks for it; else warn once per process about every missing piece."""
    missing = missing_isolation()
    refused = {piece: why for piece, why in missing.items() if piece in required_pieces(require_isolation)}
    if refused:
        details = "; ".join(f"{piece}: {why}" for piece, why in refused.items())
        raise RuntimeError(
            f"code_unit_test_reward: require_isolation={require_isolation!r} but this machine does not isolate the "
            f"program: {details}. Run where these work or pass require_isolation=False to accept it."
        )
    if (
        os.geteuid() == 0
        and {"namespaces", "user"} <= set(missing)
        and not unconfined_root_allowed(allow_unconfined_root)
    ):
        raise RuntimeError(
            "code_unit_test_reward would run model code as root with no confinement: "
            f"namespaces: {missing['namespaces']}; and no other user (`nobody` cannot run this interpreter, or "
            "setpriv is missing). As root the program holds CAP_SYS_PTRACE: it can take the judge's descriptors "
            "(pidfd_getfd) and ptrace it, so a failing solution can be made to pass, and it can read and write "
            "every file. Run where `unshare --user` works, or pass allow_unconfined_root=True to "
            f"code_unit_test_reward (or set {ALLOW_UNCONFINED_ROOT_ENV}=1 for a run that cannot pass it) to accept it."
        )
    unseen = [piece for piece in missing if piece not in _warned]
    if unseen:
        _warned.extend(unseen)
        details = "; ".join(f"{piece}: {missing[piece]}" for piece in unseen)
        warnings.warn(
            f"code_unit_test_reward runs model code without full isolation: {details}. "
            "Pass require_isolation=True (or a list of pieces) to refuse instead.",
            RuntimeWarning,
            stacklevel=3,
        )


# What a program without namespaces leaves in the machine's shared folders --------------------------------------------

# Writable by every user: without namespaces a program (as `nobody`) can leave files there that outlive its run.
SHARED_FOLDERS = ("/dev/shm", "/tmp", "/var/tmp")


def entries_owned_by(uid: int) -> set[tuple[str, int]]:
    """The (path, inode) of every entry directly in `SHARED_FOLDERS` that `uid` owns."""
    found = set()
    for folder in SHARED_FOLDERS:
        with contextlib.suppress(OSError), os.scandir(folder) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    status = entry.stat(follow_symlinks=False)
                    if status.st_uid == uid:
                        found.add((entry.path, status.st_ino))
    return found


def remove_new_entries(uid: int, before: set[tuple[str, int]]) -> list[str]:
    """Remove what `uid` owns in `SHARED_FOLDERS` that was not there in `before` (taken before the run started);
    the paths that could not be removed. Only for a program run as a user of its own (`nobody`): entries of the
    trainer's user cannot be told from the trainer's own."""
    left = []
    for path, _inode in sorted(entries_owned_by(uid) - before):
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                removed = remove_tree(path)
            else:
                os.unlink(path)
                removed = True
        except FileNotFoundError:
            removed = True
        except OSError:
            removed = False
        if not removed:
            left.append(path)
    return left


# Removing the worker's folder -----------------------------------------------------------------------------------

_DESCEND_AT_MOST = 64  # directory levels held open at once; deeper ones are moved up first
_OPEN_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def remove_tree(path: str) -> bool:
    """Remove the directory `path` and everything in it; True when it is gone. Never raises and never recurses: a
    tree of any depth (2,000 levels broke `shutil.rmtree`, recursive in Python 3.11, with RecursionError), names
    past PATH_MAX, directories without permissions (made writable first) and symbolic links (removed, never
    followed). Every step is relative to a directory descriptor held open (at most `_DESCEND_AT_MOST` at once: a
    deeper directory is first moved up to `path` under a fresh name), so a process still running cannot redirect it
    outside `path`."""
    try:
        top = os.open(path, _OPEN_DIRECTORY)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        _empty(top)
    except Exception:  # noqa: BLE001 -- whatever is left is reported by the rmdir below
        pass
    finally:
        os.close(top)
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def _empty(top: int) -> None:
    """Remove everything inside the directory open as `top`, iteratively: a stack of (descriptor, names left), where
    a name marked ("rmdir", name) is a subdirectory already emptied (or as far as it would go)."""
    stack: list[tuple[int, deque]] = [(top, deque(os.listdir(top)))]
    moved = 0
    while stack:
        directory, names = stack[-1]
        if not names:
            stack.pop()
            if directory != top:
                os.close(directory)
            continue
        name = names.popleft()
        if isinstance(name, tuple):
            with contextlib.suppress(OSError):
                os.rmdir(name[1], dir_fd=directory)
            continue
        try:
            mode = os.lstat(name, dir_fd=directory).st_mode
        except OSError:
            continue
        if not stat.S_ISDIR(mode):
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=directory)
            continue
        if len(stack) >= _DESCEND_AT_MOST:  # moved up, and emptied later from `top`
            moved += 1
            fresh = f".aspo-deep-{moved}-{secrets.token_hex(4)}"
            with contextlib.suppress(OSError):
                os.rename(name, fresh, src_dir_fd=directory, dst_dir_fd=top)
                stack[0][1].append(fresh)
            continue
        child = _open_child(directory, name)
        if child is None:
            continue
        try:
            inside = deque(os.listdir(child))
        except OSError:
            os.close(child)
            continue
        names.appendleft(("rmdir", name))
        stack.append((child, inside))


def _open_child(directory: int, name: str) -> int | None:
    """The subdirectory `name` of `directory` opened (not followed if it is a link), or, when it is already empty,
    removed (then None); made searchable first when its permissions refuse."""
    with contextlib.suppress(OSError):
        os.rmdir(name, dir_fd=directory)
        return None
    for attempt in range(2):
        try:
            return os.open(name, _OPEN_DIRECTORY, dir_fd=directory)
        except PermissionError:
            if attempt:
                return None
            with contextlib.suppress(OSError):
                os.chmod(name, 0o700, dir_fd=directory, follow_symlinks=False)
        except OSError:
            return None
    return None
