"""Issue 31 items 1-5: what the worker of the code reward can reach on a machine like the development one (a root
trainer, an interpreter under /root, user namespaces that work), and that no completion stops the run.

Real subprocesses and real namespaces throughout: only the probes' answers are replaced where a test needs another
machine's (no namespaces, no `nobody`). Each test fails on the code before issue 31 (the worker read the trainer's
files and sockets as root, shared SysV IPC with the machine, ran as root without namespaces after a warning only,
and a deep directory tree raised RecursionError out of the reward)."""

from __future__ import annotations

import ctypes
import os
import secrets
import socket
import stat
import tempfile
import textwrap
import warnings
from pathlib import Path

import pytest

from trl_aspo.evaluation import isolation as probes
from trl_aspo.evaluation.rewards import code_unit_test_reward

ADD = "def add(a, b):\n    return a + b"
ADD_TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(7, 8) == 15"]
ALLOW_ENV = "TRL_ASPO_ALLOW_UNCONFINED_ROOT"


def _program(source: str) -> str:
    return f"```python\n{textwrap.dedent(source).strip()}\n```"


def _skip_without_namespaces():
    if not probes.sandbox_isolates_network():
        pytest.skip("user namespaces (unshare) do not work on this machine")


@pytest.fixture
def private_folder():
    """A 0700 folder of the trainer's (root's, when the tests run as root) outside the worker's folder."""
    folder = Path(tempfile.mkdtemp(prefix="aspo-trainer-"))
    yield folder
    probes.remove_tree(str(folder))


@pytest.fixture
def without_namespaces(monkeypatch):
    """Another machine's probe answer: no namespaces (the opt-in set, for a machine where `nobody` does not run)."""
    monkeypatch.setattr(probes, "sandbox_isolates_network", lambda: False)
    monkeypatch.setattr(probes, "_warned", [])
    monkeypatch.setenv(ALLOW_ENV, "1")


# Item 1: the answer key ----------------------------------------------------------------------------------------------


def test_a_wrong_solution_cannot_answer_from_the_trainers_files(private_folder):
    """The row's tests in a 0600 file of a 0700 folder of the trainer (a dataset cache): a solution that never
    computes answers from its asserts. It scored 1.0 before issue 31, in the default mode."""
    _skip_without_namespaces()
    answers = private_folder / "dataset.arrow"
    answers.write_text("\n".join(ADD_TESTS))
    answers.chmod(0o600)
    cheat = f"""
        import re
        def add(a, b):
            text = open({str(answers)!r}).read()
            for x, y, z in re.findall(r"add\\((-?\\d+), (-?\\d+)\\) == (-?\\d+)", text):
                if (int(x), int(y)) == (a, b):
                    return int(z)
    """
    assert code_unit_test_reward([_program(cheat)], [ADD_TESTS], timeout=10.0) == [0.0]


def test_the_worker_sees_only_the_interpreter_its_libraries_and_its_folder():
    _skip_without_namespaces()
    import sysconfig

    trainer_files = [__file__, str(Path(__file__).parents[2] / "pyproject.toml"), os.path.expanduser("~/.bashrc")]
    source = f"""
        import os, sys
        def readable(path):
            try:
                open(path, "rb").close()
                return True
            except OSError:
                return False
        shadow = readable("/etc/shadow")
        trainer = [path for path in {trainer_files!r} if os.path.lexists(path)]
        top = sorted(os.listdir("/"))
        stdlib = os.path.exists(os.path.join({sysconfig.get_paths()["stdlib"]!r}, "json"))
        here = os.listdir(".")
        open("mine.txt", "w").write("x")
        import json, numpy  # the standard library and the venv's packages are there
    """
    tests = [
        "assert not shadow and trainer == [] and stdlib and here == []",
        "assert not set(top) & {'home', 'run', 'var', 'srv', 'mnt', 'opt', 'boot'}",
    ]
    assert code_unit_test_reward([_program(source)], [tests], timeout=20.0) == [1.0]


def test_the_worker_s_view_is_read_only_but_its_folder_and_dev_shm():
    _skip_without_namespaces()
    import sysconfig

    planted = Path(sysconfig.get_paths()["purelib"]) / f"aspo-{secrets.token_hex(4)}"
    source = f"""
        import os
        wrote = []
        for path in ["/x", "/etc/x", "/usr/x", {str(planted)!r}, "/proc/sys/kernel/hostname", "/dev/shm/x", "y"]:
            try:
                open(path, "w").write("1")
                wrote.append(path)
            except OSError:
                pass
    """
    try:
        rewards_ = code_unit_test_reward([_program(source)], [["assert wrote == ['/dev/shm/x', 'y']"]], timeout=10.0)
        assert rewards_ == [1.0]
        assert not planted.exists() and not Path("/dev/shm/x").exists()  # the program's /dev/shm is its own
    finally:
        planted.unlink(missing_ok=True)


# Item 2: no confinement as root is refused unless asked for ----------------------------------------------------------


def test_root_without_namespaces_or_another_user_is_refused_unless_asked_for(monkeypatch):
    """Where neither namespaces nor `nobody` work (the probes' answers of such a machine), a root trainer's program
    would run as root with CAP_SYS_PTRACE: refused, naming the option; with the option (or its environment
    variable) it runs, really as root."""
    if os.geteuid() != 0:
        pytest.skip("the refusal is for a root trainer")
    monkeypatch.setattr(probes, "sandbox_isolates_network", lambda: False)
    monkeypatch.setattr(probes, "sandbox_user", lambda: None)
    monkeypatch.setattr(probes, "_warned", [])
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    program = _program(ADD + "\nimport os\nuid = os.geteuid()")
    tests = [[*ADD_TESTS, "assert uid == 0"]]
    with pytest.raises(RuntimeError, match=r"as root with no confinement.*allow_unconfined_root=True"):
        code_unit_test_reward([program], tests, timeout=10.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert code_unit_test_reward([program], tests, timeout=10.0, allow_unconfined_root=True) == [1.0]
    assert any("namespaces: no user, mount" in str(warning.message) for warning in caught)  # still said
    monkeypatch.setenv(ALLOW_ENV, "1")
    assert code_unit_test_reward([program], tests, timeout=10.0) == [1.0]


# Item 3: nothing a completion does stops the run ---------------------------------------------------------------------

DEEP_TREE = """
    import os
    for _ in range(2000):
        os.mkdir("d")
        os.chdir("d")
"""


@pytest.mark.parametrize("namespaces", [True, False], ids=["sandbox", "without-namespaces"])
def test_a_deep_directory_tree_neither_raises_nor_stays(namespaces, monkeypatch, tmp_path):
    """2,000 levels in the program's folder broke shutil.rmtree (recursive) with RecursionError out of the reward,
    and the folder stayed. Without namespaces the folder is the trainer's to remove (as `nobody` here, or root)."""
    if namespaces:
        _skip_without_namespaces()
    else:
        monkeypatch.setattr(probes, "sandbox_isolates_network", lambda: False)
        monkeypatch.setattr(probes, "_warned", [])
        monkeypatch.setenv(ALLOW_ENV, "1")
    runs = tmp_path / "tmp"
    runs.mkdir()
    runs.chmod(0o755)  # `nobody` must reach its folder inside
    monkeypatch.setattr(tempfile, "tempdir", str(runs))
    programs = [_program(textwrap.dedent(DEEP_TREE) + ADD), _program(ADD)]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            assert code_unit_test_reward(programs, [ADD_TESTS] * 2, timeout=20.0) == [1.0, 1.0]
        assert list(runs.iterdir()) == []
    finally:  # a tree left here would break pytest's own (recursive) removal of old temporary folders
        probes.remove_tree(str(runs))


def test_remove_tree_takes_any_depth_long_names_closed_folders_and_links(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("kept")
    tree = tmp_path / "tree"
    tree.mkdir()
    name = "n" * 200  # 3,000 levels of 201 bytes: paths far past PATH_MAX
    fd = os.open(tree, os.O_RDONLY | os.O_DIRECTORY)
    for level in range(3000):
        os.mkdir(name, dir_fd=fd)
        child = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = child
        if level == 10:
            os.symlink(str(outside), "link", dir_fd=fd)
            os.symlink(str(outside / "keep"), "file-link", dir_fd=fd)
        if level == 20:
            os.mkdir("closed", dir_fd=fd)
            os.close(os.open("closed/f", os.O_CREAT | os.O_WRONLY, dir_fd=fd))
            os.chmod("closed", 0, dir_fd=fd)
    os.close(fd)
    for width in range(300):  # and wide
        (tree / f"w{width}").mkdir()
        (tree / f"w{width}" / "f").write_text("x")
    assert probes.remove_tree(str(tree)) is True
    assert not tree.exists()
    assert (outside / "keep").read_text() == "kept"
    assert probes.remove_tree(str(tree)) is True  # already gone


def test_an_unremovable_file_is_said_not_raised(monkeypatch, tmp_path):
    """As root without namespaces (opted in) the program may make a file immutable (chattr +i): the folder cannot be
    removed; the reward says so in a warning, scores the completion by its tests, and goes on."""
    if os.geteuid() != 0 or not Path("/usr/bin/chattr").exists():
        pytest.skip("needs root and chattr")
    monkeypatch.setattr(probes, "sandbox_isolates_network", lambda: False)
    monkeypatch.setattr(probes, "sandbox_user", lambda: None)
    monkeypatch.setattr(probes, "_warned", [])
    monkeypatch.setenv(ALLOW_ENV, "1")
    runs = tmp_path / "tmp"
    runs.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(runs))
    source = ADD + "\nimport subprocess\nopen('stuck', 'w').close()\n"
    source += "made = subprocess.run(['chattr', '+i', 'stuck']).returncode == 0"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rewards_ = code_unit_test_reward([_program(source), _program(ADD)], [ADD_TESTS] * 2, timeout=10.0)
        left = list(runs.glob("aspo-unit-test-*/stuck"))
        if not left:
            pytest.skip("this file system does not keep chattr +i")
        assert rewards_ == [1.0, 1.0]
        assert any("could not remove" in str(warning.message) for warning in caught)
    finally:
        for stuck in runs.glob("aspo-unit-test-*/stuck"):
            os.system(f"chattr -i '{stuck}'")  # noqa: S605 -- the test's own file
        probes.remove_tree(str(runs))


# Item 4: SysV IPC ----------------------------------------------------------------------------------------------------


def test_sysv_shared_memory_neither_outlives_the_program_nor_reaches_the_next(monkeypatch):
    _skip_without_namespaces()
    key = 0x41500000 + secrets.randbelow(0xFFFF)
    libc = ctypes.CDLL(None, use_errno=True)
    create = f"""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        made = libc.shmget({key}, 1 << 20, 0o1666) >= 0  # IPC_CREAT | 0666
    """
    look = f"import ctypes\nfound = ctypes.CDLL(None).shmget({key}, 0, 0o666) >= 0"
    try:
        rewards_ = code_unit_test_reward(
            [_program(create), _program(look)], [["assert made"], ["assert not found"]], timeout=10.0
        )
        assert rewards_ == [1.0, 1.0]
        assert libc.shmget(key, 0, 0o666) < 0  # not in the machine's IPC namespace either
    finally:
        left = libc.shmget(key, 0, 0o666)
        if left >= 0:
            libc.shmctl(left, 0, None)  # IPC_RMID


# Item 5: Unix sockets bound to a path --------------------------------------------------------------------------------


def test_a_root_only_unix_socket_of_the_trainer_is_unreachable(private_folder):
    """A 0600 socket in a 0700 folder (a docker.sock): the worker, root outside its namespace, reached it before
    issue 31."""
    _skip_without_namespaces()
    path = private_folder / "docker.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    path.chmod(0o600)
    server.listen(1)
    server.setblocking(False)
    source = f"""
        import socket
        client = socket.socket(socket.AF_UNIX)
        try:
            client.connect({str(path)!r})
            reached = True
        except OSError:
            reached = False
    """
    try:
        assert stat.S_ISSOCK(path.stat().st_mode)
        assert code_unit_test_reward([_program(source)], [["assert not reached"]], timeout=10.0) == [1.0]
        with pytest.raises(BlockingIOError):
            server.accept()
    finally:
        server.close()
