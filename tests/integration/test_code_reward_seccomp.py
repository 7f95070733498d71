"""Issue 45 item 1: nothing a completion does reaches a later completion through kernel objects keyed by uid (keyrings)
or through the page cache. The worker's seccomp filter (sandbox.py `install_seccomp`) refuses the keyring calls and
the page-cache probes with EPERM, system calls of another architecture too (an i386 `int 0x80` on x86_64), after
joining a fresh session keyring.

Real subprocesses throughout: the keys are planted by this process (or by a second trainer process) with a unique
description and invalidated in a `finally`. On the code before issue 45 every call below succeeded in the worker,
and the wrong program of `test_a_wrong_program_cannot_learn_the_answers_through_keyrings` scored 1.0 on its sixth
run of eight."""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import secrets
import subprocess
import sys
import textwrap
import warnings

import pytest

from trl_aspo.evaluation import isolation as probes
from trl_aspo.evaluation.rewards import code_unit_test_reward

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="system call numbers of x86_64")

ADD_KEY, REQUEST_KEY, KEYCTL = 248, 249, 250
KEYCTL_SETPERM, KEYCTL_READ, KEYCTL_INVALIDATE, KEY_SPEC_USER_KEYRING = 5, 11, 21, -4
# mov eax, 288 (i386 keyctl); ebx = 0 (KEYCTL_GET_KEYRING_ID); ecx = -4 (the user keyring); edx = 0; int 0x80
INT80_KEYCTL = bytes.fromhex("53 b8 20 01 00 00 bb 00 00 00 00 b9 fc ff ff ff 31 d2 cd 80 5b c3".replace(" ", ""))
LIBC = ctypes.CDLL(None, use_errno=True)


def _program(source: str) -> str:
    return f"```python\n{textwrap.dedent(source).strip()}\n```"


def _planted_key(description: str, payload: bytes = b"the answers") -> int:
    """A key of this process's user keyring, readable by every uid (what an earlier completion could leave)."""
    serial = LIBC.syscall(ADD_KEY, b"user", description.encode(), payload, len(payload), KEY_SPEC_USER_KEYRING)
    assert serial > 0, os.strerror(ctypes.get_errno())
    assert LIBC.syscall(KEYCTL, KEYCTL_SETPERM, serial, 0x3F3F3F3F) == 0
    return serial


def _invalidate_keys(description: str) -> None:
    """Invalidate every key of that description this process can see (/proc/keys), wherever it was linked."""
    with open("/proc/keys") as keys:
        serials = [int(fields[0], 16) for fields in map(str.split, keys) if fields[-2:-1] == [f"{description}:"]]
    for serial in serials:
        LIBC.syscall(KEYCTL, KEYCTL_INVALIDATE, serial)


@pytest.fixture
def description():
    name = f"aspo-test-{secrets.token_hex(6)}"
    try:
        yield name
    finally:
        _invalidate_keys(name)


@pytest.fixture(params=["namespaces", "without-namespaces"])
def mode(request, monkeypatch):
    if request.param == "namespaces":
        if not probes.sandbox_isolates_network():
            pytest.skip("user namespaces (unshare) do not work on this machine")
    else:
        monkeypatch.setattr(probes, "sandbox_isolates_network", lambda: False)
        monkeypatch.setattr(probes, "_warned", [])
        monkeypatch.setenv("TRL_ASPO_ALLOW_UNCONFINED_ROOT", "1")
    if not probes.sandbox_seccomp():
        pytest.skip("the seccomp filter does not install on this machine (documented: the `seccomp` piece)")
    return request.param


# Each receiver of issue 45, run in a completion after the key was planted: its errno (0 when it worked).
RECEIVERS = """
    import ctypes, mmap, os
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    def errno_of(result):
        return ctypes.get_errno() if result < 0 else 0
    def serial_of(description):
        for line in open("/proc/keys"):
            if line.split()[-2] == description + ":":
                return int(line.split()[0], 16)
        return 0
    found = serial_of(DESCRIPTION)  # the key is listed: the kernel shows it, reading it is what is refused
    buffer = ctypes.create_string_buffer(64)
    results = {
        "keyctl_read": errno_of(libc.syscall(250, 11, found, buffer, 64)),
        "request_key": errno_of(libc.syscall(249, b"user", DESCRIPTION.encode(), None, 0)),
        "add_key": errno_of(libc.syscall(248, b"user", b"aspo-never", b"x", 1, -4)),
    }
    code = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    code.write(INT80)
    int80 = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(code)))()
    results["int80_keyctl"] = -int80 if int80 < 0 else 0
    with open("page", "wb") as file:
        file.write(b"x" * 4096)
    fd = os.open("page", os.O_RDWR)
    mapped = mmap.mmap(fd, 4096)
    vector = (ctypes.c_ubyte * 1)()
    results["mincore"] = errno_of(libc.mincore(ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(mapped))),
                                               4096, vector))
    for name, call in [
        ("preadv2_nowait", lambda: os.preadv(fd, [bytearray(8)], 0, os.RWF_NOWAIT)),
        ("pwritev2_nowait", lambda: os.pwritev(fd, [b"y"], 0, os.RWF_NOWAIT)),
        ("fadvise64", lambda: os.posix_fadvise(fd, 0, 4096, os.POSIX_FADV_DONTNEED)),
    ]:
        try:
            call()
            results[name] = 0
        except OSError as error:
            results[name] = error.errno
    results["readahead"] = errno_of(libc.readahead(fd, ctypes.c_long(0), ctypes.c_size_t(4096)))
    results["io_uring_setup"] = errno_of(libc.syscall(425, 4, ctypes.create_string_buffer(120)))
    results["cachestat"] = errno_of(libc.syscall(451, fd, ctypes.create_string_buffer(16),
                                                 ctypes.create_string_buffer(40), 0))
    results["plain_preadv"] = 0 if os.preadv(fd, [bytearray(8)], 0) == 8 else -1
    def probed():
        return results
"""
REFUSED = {
    name: errno.EPERM
    for name in (
        "keyctl_read", "request_key", "add_key", "int80_keyctl", "mincore", "preadv2_nowait", "pwritev2_nowait",
        "fadvise64", "readahead", "io_uring_setup", "cachestat",
    )
}  # fmt: skip


def _receivers(description: str) -> str:
    return f"DESCRIPTION = {description!r}\nINT80 = {INT80_KEYCTL!r}\n{textwrap.dedent(RECEIVERS)}"


def test_the_kernel_runs_an_int_0x80_keyctl_outside_the_sandbox():
    """The control of the `int 0x80` receiver: without the filter this kernel answers the i386 call (a serial, or
    an error other than EPERM), so EPERM in the worker is the filter's."""
    source = textwrap.dedent(f"""
        import ctypes, mmap
        code = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        code.write({INT80_KEYCTL!r})
        print(ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(code)))())
    """)
    answer = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=30)
    assert answer.returncode == 0 and int(answer.stdout) not in (-errno.EPERM, -errno.ENOSYS), answer


def test_every_keyring_and_page_cache_receiver_gets_eperm_in_a_later_completion(mode, description):
    _planted_key(description)
    program = _program(_receivers(description))
    tests = [[f"assert probed() == {{**{REFUSED!r}, 'plain_preadv': 0}}"]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert code_unit_test_reward([program], tests, timeout=10.0) == [1.0]


def test_a_second_trainer_process_holding_a_session_keyring_is_out_of_reach(description):
    """A second trainer process joins a session keyring holding a key (a trainer started from a login or systemd
    has one): a completion it scores can neither find that key by description nor read it by serial."""
    if not probes.sandbox_seccomp():
        pytest.skip("the seccomp filter does not install on this machine")
    program = _program(_receivers(description))
    refused = ["keyctl_read", "request_key", "add_key"]
    trainer = textwrap.dedent(f"""
        import ctypes, warnings
        warnings.simplefilter("ignore")
        from trl_aspo.evaluation.rewards import code_unit_test_reward
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.syscall(250, 1, None) > 0  # KEYCTL_JOIN_SESSION_KEYRING: a fresh session keyring
        serial = libc.syscall(248, b"user", {description.encode()!r}, b"the answers", 11, -3)  # into it
        assert serial > 0 and libc.syscall(250, 5, serial, 0x3F3F3F3F) == 0
        tests = [["found = probed()", "assert [found[name] for name in {refused!r}] == [1, 1, 1]"]]
        print(code_unit_test_reward([{program!r}], tests, timeout=10.0))
    """)
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    answer = subprocess.run(
        [sys.executable, "-c", trainer], capture_output=True, text=True, timeout=120, env=environment
    )
    assert answer.returncode == 0, answer.stderr[-2000:]
    assert answer.stdout.split() == ["[1.0]"]


ODD_TESTS = [["assert is_odd(3) == True", "assert is_odd(4) == False", "assert is_odd(5) == True"]]


def test_a_wrong_program_cannot_learn_the_answers_through_keyrings(mode, description):
    """A wrong program submitted as a group's eight completions keeps a run counter in a key and answers the bits of
    that counter: before issue 45 the sixth run (counter 5 = 0b101, the answers True, False, True) scored 1.0."""
    program = _program(f"""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        def learned():
            best = 0
            for line in open("/proc/keys"):
                fields = line.split()
                if fields[-2] == "{description}:":
                    buffer = ctypes.create_string_buffer(32)
                    size = libc.syscall(250, 11, int(fields[0], 16), buffer, 32)
                    if size > 0:
                        best = max(best, int(buffer.raw[:size]))
            return best
        n = learned()
        text = str(n + 1).encode()
        serial = libc.syscall(248, b"user", b"{description}", text, len(text), -4)
        libc.syscall(250, 5, serial, 0x3F3F3F3F)
        def is_odd(x):
            return bool(n >> [3, 4, 5].index(x) & 1)
    """)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert code_unit_test_reward([program] * 8, ODD_TESTS * 8, timeout=10.0, max_concurrency=1) == [0.0] * 8


def test_a_wrong_program_cannot_learn_the_answers_through_the_page_cache(mode):
    """The same learner keeping its counter in the page cache of a standard-library file (3 of its first 64 pages):
    it reads the bits with preadv2(RWF_NOWAIT), evicts the pages with fadvise and touches the 1-bits. Both are
    refused now, and it scores 0.0 every time. (Before issue 45 this learner did not learn reliably on the
    development machine, whose disk cache reloaded pages: the EPERM of each receiver, above, is what fails there.)"""
    import sysconfig

    shared = os.path.join(sysconfig.get_paths()["stdlib"], "pydoc_data", "topics.py")
    if os.path.getsize(shared) < 64 * 4096:
        pytest.skip("no standard-library file of 64 pages here")
    program = _program(f"""
        import os
        PAGES = (0, 16, 32)
        fd = os.open({shared!r}, os.O_RDONLY)
        def cached(page):
            try:
                os.preadv(fd, [bytearray(1)], page * 4096, os.RWF_NOWAIT)
                return 1
            except OSError:
                return 0
        n = sum(cached(page) << bit for bit, page in enumerate(PAGES))
        try:
            os.posix_fadvise(fd, 0, 64 * 4096, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        for bit, page in enumerate(PAGES):
            if (n + 1) >> bit & 1:
                os.pread(fd, 1, page * 4096)
        def is_odd(x):
            return bool(n >> [3, 4, 5].index(x) & 1)
    """)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert code_unit_test_reward([program] * 8, ODD_TESTS * 8, timeout=10.0, max_concurrency=1) == [0.0] * 8


def test_without_seccomp_the_piece_is_warned_and_refused_on_request(monkeypatch):
    """Another machine's probe answer (libseccomp missing): named in the warning, refused under
    `require_isolation=["seccomp"]`, and the program still runs (unfiltered) otherwise."""
    monkeypatch.setattr(probes, "sandbox_seccomp", lambda: False)
    monkeypatch.setattr(probes, "_warned", [])
    add = _program("def add(a, b):\n    return a + b")
    with pytest.raises(RuntimeError, match=r"seccomp: no seccomp filter \(libseccomp.so.2 cannot load"):
        code_unit_test_reward([add], [["assert add(2, 3) == 5"]], timeout=10.0, require_isolation=["seccomp"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert code_unit_test_reward([add], [["assert add(2, 3) == 5"]], timeout=10.0) == [1.0]
    messages = [str(warning.message) for warning in caught if warning.category is RuntimeWarning]
    assert len(messages) == 1 and "seccomp: no seccomp filter" in messages[0] and "keyrings" in messages[0]
