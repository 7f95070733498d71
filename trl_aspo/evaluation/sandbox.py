"""The programs `code_unit_test_reward` runs (this source, by `python -I -c <source> <role>`), and their data codec.

Roles, one source (started by `code_unit_test_reward`: the worker through `unshare`, the run's cgroup and a change
of user where this machine allows them, `trl_aspo.evaluation.isolation`; docs/code_reward.md):

- `worker` (untrusted once the solution runs): in its namespaces it first makes the file system read-only but its
  directory and drops every capability (`_confine`); in every mode it then joins a fresh session keyring and loads
  a seccomp filter refusing keyrings and page-cache probes (`install_seccomp`); then it runs the solution and
  answers calls. It holds no secret and decides nothing: it only receives requests `{"call": name, "args": ...,
  "kwargs": ...}` on its one socket and answers with data.
- `probe`: whether `_confine` works here and the network is empty (the isolation probe).
- `seccomp`: whether the worker's seccomp filter (`install_seccomp`) installs here and refuses keyctl.
- `judge` (trusted): runs the row's tests, in which every solution name is a proxy that calls the worker across the
  socket. Arguments and results cross as data only (`encode`/`decode`: a tagged encoding of literals, never pickle),
  so no object of the solution ever exists in the judge: nothing the tests compare can be "equal to everything".
  The judge is not dumpable (no other process of the user may read its memory or ptrace it) before the worker
  starts, and its verdict goes on a socket to the trainer that the worker never holds.
"""

import builtins
import collections
import contextlib
import ctypes
import datetime
import decimal
import fractions
import json
import os
import resource
import socket
import struct
import sys
import time

_MAX_MESSAGE = 64 * 2**20  # bytes of one encoded message: a larger one is refused (the judge's memory)
# What `json.loads` of one message may take, estimated from its bytes before it is parsed (`expanded_size`): the
# judge sits outside the run's cgroup, and 60 MB of `[],` would expand to 1.3 GiB of empty lists.
_MAX_EXPANDED = 512 * 2**20
_MAX_DEPTH = 100  # nesting of one encoded value
_HEADER = struct.Struct(">I")
PASS = b"pass\n"
READY = b"ready\n"
# Exceptions that, raised in the judge, end an iteration instead of failing: a solution that raises them must not
# make `all(map(candidate, cases))` true.
_NOT_RERAISED = frozenset({"StopIteration", "StopAsyncIteration", "GeneratorExit", "KeyboardInterrupt", "SystemExit"})
# Standard modules solutions import and MBPP-style tests use by the solution's name (`math.isclose`), imported by
# the judge before the worker exists; a module of the solution reaches the tests only if the judge had it by then.
_COMMON_MODULES = (
    "bisect", "cmath", "collections", "copy", "datetime", "functools", "heapq", "itertools", "math", "operator",
    "random", "re", "statistics", "string", "sys", "typing",
)  # fmt: skip


class CodecError(ValueError):
    """A value that cannot cross the sandbox boundary, or a message that is not a valid encoding."""


def encode(value, depth: int = 0):
    """`value` as JSON-ready tagged data: None, bool, int, float (nan, inf and -0.0 kept), complex, str, bytes,
    Fraction, Decimal, and list, tuple, dict, set, frozenset of those. Subclasses become their base (a namedtuple a
    tuple, an IntEnum an int) and numpy scalars and arrays their Python values; anything else raises CodecError."""
    if depth > _MAX_DEPTH:
        raise CodecError(f"a value nested deeper than {_MAX_DEPTH} levels cannot cross the sandbox boundary")
    if value is None:
        return ["N"]
    if isinstance(value, bool):
        return ["B", int(value)]
    if isinstance(value, int):
        return ["i", format(int(value), "x")]
    if isinstance(value, float):
        return ["f", float(value).hex()]
    if isinstance(value, complex):
        return ["c", value.real.hex(), value.imag.hex()]
    if isinstance(value, str):
        return ["s", str(value)]
    if isinstance(value, (bytes, bytearray)):
        return ["y", bytes(value).hex()]
    if isinstance(value, fractions.Fraction):
        return ["q", format(value.numerator, "x"), format(value.denominator, "x")]
    if isinstance(value, decimal.Decimal):
        return ["D", str(value)]
    if isinstance(value, (list, tuple)) and value and set(map(type, value)) == {int}:
        # a list or tuple of ints as one string of decimal numbers: 10^6 ints cross in a few tenths of a second
        # (ints past Python's 4,300-digit limit of decimal text take the per-item encoding)
        try:
            return ["L" if isinstance(value, list) else "T", ",".join(map(str, value))]
        except ValueError:
            pass
    for kind, tag in ((list, "l"), (tuple, "t"), (set, "S"), (frozenset, "F")):
        if isinstance(value, kind):
            return [tag, [encode(item, depth + 1) for item in value]]
    if isinstance(value, dict):
        items = [[encode(key, depth + 1), encode(item, depth + 1)] for key, item in value.items()]
        if isinstance(value, collections.Counter):
            return ["C", items]  # compares as a Counter (a zero count equals a missing one)
        if isinstance(value, collections.OrderedDict):
            return ["o", items]  # compares with its order
        if isinstance(value, collections.defaultdict) and value.default_factory in _FACTORIES.values():
            return ["e", value.default_factory.__name__, items]
        return ["d", items]
    return _encode_other(value, depth)


# The default factories a defaultdict may cross with (others cross as a plain dict).
_FACTORIES = {kind.__name__: kind for kind in (list, dict, set, int, float, str, tuple, frozenset, bool)}
_KEYS, _VALUES, _ITEMS = type({}.keys()), type({}.values()), type({}.items())


def _encode_other(value, depth: int):
    """The standard values beyond literals and the four containers: deque, range, dict views, datetime's types and
    numpy values (as their Python values)."""
    if isinstance(value, collections.deque):
        maxlen = "" if value.maxlen is None else format(value.maxlen, "x")
        return ["Q", [encode(item, depth + 1) for item in value], maxlen]
    if isinstance(value, range):
        return ["r", format(value.start, "x"), format(value.stop, "x"), format(value.step, "x")]
    for kind, tag in ((_KEYS, "K"), (_VALUES, "V")):
        if isinstance(value, kind):
            return [tag, [encode(item, depth + 1) for item in value]]
    if isinstance(value, _ITEMS):
        return ["I", [[encode(key, depth + 1), encode(item, depth + 1)] for key, item in value]]
    if isinstance(value, datetime.timedelta):
        return ["td", format(value.days, "x"), format(value.seconds, "x"), format(value.microseconds, "x")]
    if isinstance(value, datetime.datetime):
        naive = datetime.datetime(*value.timetuple()[:6], value.microsecond)
        return ["dt", naive.isoformat(), value.fold, _encode_zone(value.tzinfo, depth)]
    if isinstance(value, datetime.date):
        return ["dd", datetime.date(value.year, value.month, value.day).isoformat()]
    if isinstance(value, datetime.time):
        naive = datetime.time(value.hour, value.minute, value.second, value.microsecond)
        return ["tm", naive.isoformat(), value.fold, _encode_zone(value.tzinfo, depth)]
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):
        return encode(value.tolist(), depth + 1)
    raise CodecError(f"a {type(value).__name__} cannot cross the sandbox boundary (only literals and containers)")


def _encode_zone(zone, depth: int):
    """None, or a fixed-offset `datetime.timezone` (as its offset and name); other time zones are refused (the
    judge would have to read their data from disk)."""
    if zone is None:
        return ["N"]
    if type(zone) is not datetime.timezone:
        raise CodecError(f"a time zone of type {type(zone).__name__} cannot cross the sandbox boundary")
    return ["z", encode(zone.utcoffset(None), depth + 1), zone.tzname(None)]


_LEAVES = {
    "N": (0, lambda: None),
    "B": (1, lambda flag: _checked(flag, (0, 1)) == 1),
    "i": (1, lambda digits: int(_text(digits), 16)),
    "f": (1, lambda digits: float.fromhex(_text(digits))),
    "c": (2, lambda real, imag: complex(float.fromhex(_text(real)), float.fromhex(_text(imag)))),
    "s": (1, lambda text: _text(text)),
    "y": (1, lambda digits: bytes.fromhex(_text(digits))),
    "q": (2, lambda top, bottom: fractions.Fraction(int(_text(top), 16), int(_text(bottom), 16))),
    "D": (1, lambda text: decimal.Decimal(_text(text))),
}
_CONTAINERS = {"l": list, "t": tuple, "S": set, "F": frozenset}


def decode(node, depth: int = 0):
    """The value `encode` made `node` from; CodecError for anything that is not exactly such an encoding."""
    if depth > _MAX_DEPTH:
        raise CodecError(f"an encoded value nested deeper than {_MAX_DEPTH} levels")
    if not (isinstance(node, list) and node and isinstance(node[0], str)):
        raise CodecError(f"not an encoded value: {node!r:.60}")
    tag, fields = node[0], node[1:]
    try:
        if tag in _LEAVES:
            arity, build = _LEAVES[tag]
            if len(fields) != arity:
                raise CodecError(f"tag {tag!r} takes {arity} fields, got {len(fields)}")
            return build(*fields)
        if tag in _CONTAINERS and len(fields) == 1 and isinstance(fields[0], list):
            return _CONTAINERS[tag](decode(item, depth + 1) for item in fields[0])
        if tag in ("L", "T") and len(fields) == 1:
            items = list(map(int, _text(fields[0]).split(",")))
            return items if tag == "L" else tuple(items)
        if tag in _MAPPINGS and len(fields) == 1 and isinstance(fields[0], list):
            return _MAPPINGS[tag](_decode_items(fields[0], depth))
        if tag == "e" and len(fields) == 2 and _text(fields[0]) in _FACTORIES and isinstance(fields[1], list):
            return collections.defaultdict(_FACTORIES[fields[0]], _decode_items(fields[1], depth))
        return _decode_other(tag, fields, depth)
    except CodecError:
        raise
    except (TypeError, ValueError, ArithmeticError) as error:  # a bad hex digit, an unhashable key, a zero den
        raise CodecError(f"invalid encoded {tag!r}: {error}") from None


_MAPPINGS = {"d": dict, "C": lambda pairs: collections.Counter(dict(pairs)), "o": collections.OrderedDict}


def _decode_items(pairs: list, depth: int) -> list:
    return [(decode(key, depth + 1), decode(item, depth + 1)) for key, item in map(_pair, pairs)]


def _decode_other(tag: str, fields: list, depth: int):
    """The values of `_encode_other`, each a fresh value of its standard type."""
    count = len(fields)
    if tag == "Q" and count == 2 and isinstance(fields[0], list):
        maxlen = int(_text(fields[1]), 16) if fields[1] != "" else None
        return collections.deque((decode(item, depth + 1) for item in fields[0]), maxlen)
    if tag == "r" and count == 3:
        return range(*(int(_text(field), 16) for field in fields))
    if tag == "K" and count == 1 and isinstance(fields[0], list):
        return dict.fromkeys(decode(item, depth + 1) for item in fields[0]).keys()
    if tag == "V" and count == 1 and isinstance(fields[0], list):
        return dict(enumerate(decode(item, depth + 1) for item in fields[0])).values()
    if tag == "I" and count == 1 and isinstance(fields[0], list):
        return dict(_decode_items(fields[0], depth)).items()
    if tag == "td" and count == 3:
        return datetime.timedelta(*(int(_text(field), 16) for field in fields))
    if tag == "dd" and count == 1:
        return datetime.date.fromisoformat(_text(fields[0]))
    if tag in ("dt", "tm") and count == 3:
        kind = datetime.datetime if tag == "dt" else datetime.time
        naive = kind.fromisoformat(_text(fields[0]))
        if naive.tzinfo is not None:
            raise CodecError(f"invalid encoded {tag!r}: an offset in the text")
        return naive.replace(fold=_checked(fields[1], (0, 1)), tzinfo=_decode_zone(fields[2], depth))
    raise CodecError(f"unknown tag or layout [{tag!r}, ...]")


def _decode_zone(node, depth: int):
    if node == ["N"]:
        return None
    if isinstance(node, list) and len(node) == 3 and node[0] == "z":
        offset = decode(node[1], depth + 1)
        if type(offset) is not datetime.timedelta:
            raise CodecError("a time zone's offset must be a timedelta")
        return datetime.timezone(offset, _text(node[2]))
    raise CodecError(f"not an encoded time zone: {node!r:.60}")


def _text(field) -> str:
    if not isinstance(field, str):
        raise CodecError(f"expected a string field, got {field!r:.60}")
    return field


def _checked(field, allowed):
    if field not in allowed or isinstance(field, bool):
        raise CodecError(f"expected one of {allowed}, got {field!r:.60}")
    return field


def _pair(item):
    if not (isinstance(item, list) and len(item) == 2):
        raise CodecError(f"a dict item must be a [key, value] pair, got {item!r:.60}")
    return item


def send(channel: socket.socket, message) -> None:
    data = json.dumps(message, separators=(",", ":"), allow_nan=False).encode()
    channel.sendall(_HEADER.pack(len(data)) + data)


def receive(channel: socket.socket, deadline: float | None):
    """One message, or None when the other side closed; CodecError for a message too long or not JSON, TimeoutError
    past `deadline` (monotonic seconds)."""
    header = _read_exactly(channel, _HEADER.size, deadline)
    if header is None:
        return None
    (length,) = _HEADER.unpack(header)
    if length > _MAX_MESSAGE:
        raise CodecError(f"a message of {length} bytes (at most {_MAX_MESSAGE})")
    body = _read_exactly(channel, length, deadline)
    if body is None:
        return None
    expanded = expanded_size(body)
    if expanded > _MAX_EXPANDED:
        limit = _MAX_EXPANDED >> 20
        raise CodecError(f"a message that would take about {expanded >> 20} MiB parsed (at most {limit})")
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as error:
        raise CodecError(f"a message that is not JSON: {error}") from None


def expanded_size(body: bytes) -> int:
    """An upper bound, in bytes, of what `json.loads(body)` allocates (measured on CPython 3.11 for lists, dicts,
    strings, ints and floats: at most 29 bytes per byte of `[],`, against this bound's 54), counted without parsing."""
    containers = body.count(b"[") + body.count(b"{")
    return 2 * len(body) + 40 * body.count(b",") + 120 * containers + 32 * body.count(b'"')


def _read_exactly(channel: socket.socket, count: int, deadline: float | None) -> bytes | None:
    chunks, missing = [], count
    while missing:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the solution did not answer in time")
            channel.settimeout(left)
        chunk = channel.recv(min(missing, 2**20))
        if not chunk:
            return None
        chunks.append(chunk)
        missing -= len(chunk)
    return b"".join(chunks)


def _read_payload():
    payload = json.loads(sys.stdin.buffer.read())
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for name, limit in payload["limits"].items():
        resource.setrlimit(getattr(resource, name), (limit, limit))
    return payload


# The worker (untrusted: everything after the solution started is in its hands) --------------------------------------


_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_BIND, _MS_REC = 1, 2, 4, 8, 32, 4096, 16384
_MS_PRIVATE, _MNT_DETACH = 1 << 18, 2
_MS_NOATIME, _MS_NODIRATIME, _MS_RELATIME = 1024, 2048, 1 << 21
_ST_TO_MS = {1: _MS_RDONLY, 2: _MS_NOSUID, 4: _MS_NODEV, 8: _MS_NOEXEC, 1024: _MS_NOATIME, 2048: _MS_NODIRATIME}
_ST_TO_MS[4096] = _MS_RELATIME
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "ppc64": 203, "s390x": 217}
# What the worker sees besides the interpreter's prefixes: the system's programs and libraries (read-only), the
# dynamic loader's cache and the time zone, a few devices, its own /proc, /dev/shm and folder.
_SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache", "/etc/localtime")
_DEVICES = ("null", "zero", "full", "random", "urandom")
_DEV_LINKS = {
    "fd": "/proc/self/fd",
    **{name: f"/proc/self/fd/{fd}" for fd, name in enumerate(("stdin", "stdout", "stderr"))},
}
_ACCOUNTS = {"passwd": "root:x:0:0:root:/:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/sh\n"}
_ACCOUNTS["group"] = "root:x:0:\nnogroup:x:65534:\n"


def _confine(size_mb: int) -> None:
    """In the worker's own user and mount namespace, where it is root with every capability until this returns: give
    it a file system of its own, then give up every capability for good.

    The new root is a tmpfs (mounted over the working directory's path, in this mount namespace only) holding
    read-only bind mounts of the interpreter's prefixes and of the system's programs and libraries (`_SYSTEM_PATHS`),
    /dev/null and the other plain devices, a passwd naming root and nobody, a fresh /proc of its PID namespace
    (read-only), and two writable tmpfs of at most `size_mb` MiB: its folder (at the working directory's path) and
    /dev/shm. pivot_root to it and the old root detached: nothing else of the machine's files exists for the program
    (the trainer's files, /etc/shadow, /tmp, /run and its sockets). Then an empty bounding set, no_new_privs,
    securebits that keep uid 0 from regaining a capability, and none left: it cannot mount, unmount or remount."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    work = os.getcwd()
    if work == "/":
        raise OSError("the worker's folder cannot be /")
    _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing of what follows reaches the trainer's namespace
    root = work
    _mount(libc, "tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=4m,nr_inodes=4096")
    for path in _SYSTEM_PATHS + _prefixes():
        _expose(libc, root, path)
    for name in _DEVICES:
        _bind(libc, f"/dev/{name}", f"{root}/dev/{name}")
    for name, target in _DEV_LINKS.items():
        os.symlink(target, f"{root}/dev/{name}")
    for name, text in _ACCOUNTS.items():
        if not os.path.lexists(f"{root}/etc/{name}"):
            _write_new(f"{root}/etc/{name}", text)
    for path in (f"{root}/proc", f"{root}/dev/shm", f"{root}{work}"):
        os.makedirs(path, exist_ok=True)
    _read_only_below(libc, root)
    _mount_proc(libc, f"{root}/proc")
    limits = f"size={size_mb}m,nr_inodes=65536"
    _mount(libc, "tmpfs", f"{root}/dev/shm", "tmpfs", _MS_NOSUID | _MS_NODEV, f"mode=1777,{limits}")
    _mount(libc, "tmpfs", f"{root}{work}", "tmpfs", _MS_NOSUID | _MS_NODEV, f"mode=0755,{limits}")
    _mount(libc, None, root, None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    os.chdir(root)
    number = _PIVOT_ROOT.get(os.uname().machine)
    if number is not None and libc.syscall(number, b".", b".") == 0:  # the old root now lies on top of the new one
        if libc.umount2(b".", _MNT_DETACH) != 0:
            raise OSError(ctypes.get_errno(), "detaching the old root")
    else:  # no pivot_root (a root file system that is not a mount, or an unknown machine): chroot, without the
        os.chroot(".")  # capability to leave it once every capability is dropped
    os.chdir(work)
    _drop_capabilities(libc)


def _mount(libc, source, target: str, kind, flags: int, data: str | None = None) -> None:
    import ctypes

    encoded = [None if part is None else part.encode() for part in (source, target, kind, data)]
    if libc.mount(encoded[0], encoded[1], encoded[2], flags, encoded[3]) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"mount {source} on {target}: {os.strerror(error)}")


def _prefixes() -> tuple[str, ...]:
    """The interpreter's own directories (its prefixes: the standard library, the venv's site-packages) and the
    directory of the executable it runs, where they are not under /usr already."""
    paths = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix, os.path.dirname(sys.executable)}
    paths.add(os.path.dirname(os.path.realpath(sys.executable)))
    return tuple(sorted(path for path in paths if path and path != "/" and not path.startswith("/usr/")))


def _expose(libc, root: str, path: str, hops: int = 0) -> None:
    """Make `path` reach, inside `root`, the same file as outside: its symbolic links recreated as links, then a
    bind mount of what it resolves to (made read-only later by `_read_only_below`). Paths that do not exist are
    skipped."""
    parts = [part for part in path.split("/") if part]
    for index in range(len(parts)):
        current = "/" + "/".join(parts[: index + 1])
        if os.path.islink(current):
            if not os.path.lexists(root + current):
                os.makedirs(os.path.dirname(root + current), exist_ok=True)
                os.symlink(os.readlink(current), root + current)
            if hops < 8:
                resolved = os.path.realpath(current)
                rest = "/".join(parts[index + 1 :])
                _expose(libc, root, f"{resolved}/{rest}" if rest else resolved, hops + 1)
            return
    if os.path.exists(path) and not os.path.exists(root + path):
        _bind(libc, path, root + path)


def _bind(libc, source: str, target: str) -> None:
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        _write_new(target, "")
    _mount(libc, source, target, None, _MS_BIND | _MS_REC)


def _write_new(path: str, text: str) -> None:
    with open(path, "x") as file:
        file.write(text)


def _read_only_below(libc, root: str) -> None:
    """Remount every mount under `root` read-only, keeping the flags the kernel locks (nosuid, nodev, noexec and
    the access-time ones of a mount inherited from the trainer's namespace)."""
    with open("/proc/self/mountinfo") as mounts:
        targets = [_unescape(line.split()[4]) for line in mounts]
    for target in dict.fromkeys(targets):
        if not target.startswith(root + "/"):
            continue
        flags = os.statvfs(target).f_flag
        kept = sum(ms for st, ms in _ST_TO_MS.items() if flags & st)
        _mount(libc, None, target, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | kept)


def _mount_proc(libc, target: str) -> None:
    """A fresh /proc of the worker's PID namespace, read-only (where the kernel refuses a new one: /proc, bound)."""
    flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC | _MS_RDONLY
    try:
        _mount(libc, "proc", target, "proc", flags)
    except OSError:
        _mount(libc, "/proc", target, None, _MS_BIND | _MS_REC)
        _read_only_below(libc, os.path.dirname(target))


def _drop_capabilities(libc) -> None:
    import ctypes

    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
    for capability in range(64):
        libc.prctl(24, capability, 0, 0, 0)  # PR_CAPBSET_DROP (EINVAL past the last one)
    if libc.prctl(28, 0x2F, 0, 0, 0) != 0:  # PR_SET_SECUREBITS: NOROOT, NO_SETUID_FIXUP, KEEP_CAPS, all locked
        raise OSError(ctypes.get_errno(), "setting securebits")
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    if libc.capset(header, (ctypes.c_uint32 * 6)()) != 0:
        raise OSError(ctypes.get_errno(), "dropping capabilities")


def _unescape(field: str) -> str:
    import re

    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match[1], 8)), field)


# The seccomp filter (every mode, after `_confine` and before the solution runs) --------------------------------------

# Kernel objects keyed by uid outlive a run (the worker is root, or `nobody`, to the kernel): a key one completion
# links into a user keyring is read by a later one. Refused as Docker's default seccomp profile refuses them.
_KEYRING_CALLS = ("add_key", "keyctl", "request_key")
# What tells whether a page of a shared file is in the page cache, or evicts or loads it: a completion evicts a file's
# pages and touches some, a later one reads them back (issue 45 measured 64 bits, 3 of 3, with mincore).
_PAGE_CACHE_CALLS = ("mincore", "cachestat", "io_uring_setup", "fadvise64", "readahead")
# Per-user kernel counters a program would exhaust for every process of its uid, the trainer and the runs beside it
# included (issue 44: one worker took all 128 of root's inotify instances).
_COUNTER_CALLS = ("inotify_init", "inotify_init1")
_RWF_NOWAIT, _CLONE_NEWUSER = 0x8, 0x10000000
# (call, argument, bit): refused when the argument has the bit. preadv2(fd, iov, iovcnt, pos_l, pos_h, flags) with
# RWF_NOWAIT (a read that fails unless the page is cached); a new user namespace (counted per user; clone's flags are
# its first argument on x86_64 and aarch64, its second on s390x, where this rule would not hold).
_MASKED_CALLS = (
    ("preadv2", 5, _RWF_NOWAIT), ("pwritev2", 5, _RWF_NOWAIT), ("clone", 0, _CLONE_NEWUSER),
    ("unshare", 0, _CLONE_NEWUSER),
)  # fmt: skip
# Newer than some libseccomp builds; one number on every architecture.
_SYSCALL_NUMBERS = {"cachestat": 451, "clone3": 435}
_SCMP_ACT_ALLOW, _SCMP_ACT_ERRNO, _SCMP_CMP_MASKED_EQ, _SCMP_FLTATR_ACT_BADARCH = 0x7FFF0000, 0x00050000, 7, 2
_EPERM, _ENOSYS, _KEYCTL_JOIN_SESSION_KEYRING = 1, 38, 1


_LOADED: list = []  # libseccomp, once loaded


def _libseccomp():
    """libseccomp.so.2 through ctypes (installed with the OS; no maintained PyPI binding exists), loaded once: the
    worker loads it before `_confine`, while the machine's libraries are all in view."""
    if _LOADED:
        return _LOADED[0]
    library = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    library.seccomp_init.restype = ctypes.c_void_p
    library.seccomp_init.argtypes = [ctypes.c_uint32]
    library.seccomp_release.argtypes = [ctypes.c_void_p]
    library.seccomp_load.argtypes = [ctypes.c_void_p]
    library.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    library.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    library.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p
    ]  # fmt: skip
    _LOADED.append(library)
    return library


class _ArgumentTest(ctypes.Structure):
    """libseccomp's `struct scmp_arg_cmp`: argument `arg` compared by `op` with `datum_a` (and `datum_b`)."""

    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


def _syscall_number(library, name: str) -> int:
    number = library.seccomp_syscall_resolve_name(name.encode())
    if number == -1:  # __NR_SCMP_ERROR: a call this libseccomp does not know by name
        number = _SYSCALL_NUMBERS.get(name, -1)
    if number == -1:
        raise OSError(f"seccomp: libseccomp does not know the system call {name}")
    return number


def _join_fresh_session_keyring(library) -> None:
    """keyctl(KEYCTL_JOIN_SESSION_KEYRING, NULL): a new anonymous session keyring, so that the trainer's session
    keyring (a login's, systemd's) is not the worker's. A kernel without keys, or an outer seccomp profile that
    already refuses keyctl (Docker's), answers ENOSYS or EPERM: then nothing can reach a keyring anyway."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_syscall_number(library, "keyctl"), _KEYCTL_JOIN_SESSION_KEYRING, None) < 0:
        error = ctypes.get_errno()
        if error not in (_EPERM, _ENOSYS):
            raise OSError(error, f"joining a fresh session keyring: {os.strerror(error)}")


def install_seccomp() -> None:
    """Join a fresh session keyring, then load a seccomp filter for this process and every process it starts:
    `_KEYRING_CALLS`, `_PAGE_CACHE_CALLS`, `_COUNTER_CALLS` and the `_MASKED_CALLS` with their bits fail with EPERM,
    and so does every system call of another architecture (an i386 `int 0x80` on x86_64, which the filter's rules
    would not see); clone3 fails with ENOSYS, so that the C library falls back to clone, whose flags a filter can
    read (clone3's are in memory), as Docker's default profile does; everything else is allowed. Raises OSError
    when libseccomp is missing or the kernel refuses the filter."""
    library = _libseccomp()
    _join_fresh_session_keyring(library)
    refused = _SCMP_ACT_ERRNO | _EPERM
    context = library.seccomp_init(_SCMP_ACT_ALLOW)
    if not context:
        raise OSError("seccomp_init failed")
    try:
        steps = [library.seccomp_attr_set(context, _SCMP_FLTATR_ACT_BADARCH, refused)]
        for name in _KEYRING_CALLS + _PAGE_CACHE_CALLS + _COUNTER_CALLS:
            steps.append(library.seccomp_rule_add_array(context, refused, _syscall_number(library, name), 0, None))
        for name, argument, bits in _MASKED_CALLS:
            test = _ArgumentTest(argument, _SCMP_CMP_MASKED_EQ, bits, bits)
            number = _syscall_number(library, name)
            steps.append(library.seccomp_rule_add_array(context, refused, number, 1, ctypes.byref(test)))
        clone3 = _syscall_number(library, "clone3")
        steps.append(library.seccomp_rule_add_array(context, _SCMP_ACT_ERRNO | _ENOSYS, clone3, 0, None))
        steps.append(library.seccomp_load(context))
        failed = next((step for step in steps if step != 0), None)
        if failed is not None:
            raise OSError(-failed, f"seccomp filter: {os.strerror(-failed)}")
    finally:
        library.seccomp_release(context)


def _seccomp_probe() -> None:
    """Exit 0 only when the filter installs here and refuses keyctl with EPERM (the isolation probe of `seccomp`)."""
    install_seccomp()
    libc = ctypes.CDLL(None, use_errno=True)
    refused = libc.syscall(_syscall_number(_libseccomp(), "keyctl"), 0, -4, 0) == -1 and ctypes.get_errno() == _EPERM
    os._exit(0 if refused else 1)


def _probe() -> None:
    """Exit 0 only when `_confine` works here, the trainer's files are out of sight and 127.0.0.1 is unreachable (an
    empty network namespace)."""
    here = os.getcwd()
    _confine(1)
    hidden = not os.path.exists(sys.argv[2]) and os.listdir(here) == []
    os._exit(0 if hidden and socket.socket().connect_ex(("127.0.0.1", 9)) else 1)


def _worker() -> None:
    if sys.argv[2:3] == ["confine"]:
        with contextlib.suppress(OSError):  # missing: `install_seccomp` raises it where the payload asks for it
            _libseccomp()
        _confine(int(sys.argv[3]))
    payload = _read_payload()
    if payload["seccomp"]:
        install_seccomp()
    channel = socket.socket(fileno=payload["channel_fd"])
    # A module of its own, not __main__: a correct function followed by `if __name__ == "__main__":` (input(),
    # unittest.main(), argparse) is a correct solution; registered, so that pickle (multiprocessing) finds its names.
    module = type(sys)("solution")
    module.__dict__["__builtins__"] = builtins
    sys.modules["solution"] = module
    try:
        exec(compile(payload["solution"], "<solution>", "exec", dont_inherit=True), module.__dict__)
    except BaseException as error:  # noqa: BLE001 -- any failure of the solution, SystemExit included, is a failure
        send(channel, {"failed": type(error).__name__})
        os._exit(1)
    send(channel, {"names": _names(module.__dict__)})
    objects: list = []  # what the solution returned that is not data, by the number the judge knows it by
    while True:
        request = receive(channel, None)
        if request is None:
            os._exit(0)
        send(channel, _answer(module.__dict__, objects, request))


def _names(namespace: dict) -> dict:
    """The solution's top-level names: a function (anything callable), a module (by its name) or a value."""
    described = {}
    for name, value in list(namespace.items()):
        if name.startswith("__"):
            continue
        if callable(value):
            described[name] = ["function"]
        elif type(value).__name__ == "module":
            described[name] = ["module", getattr(value, "__name__", "")]
        else:
            try:
                described[name] = ["value", encode(value)]
            except (CodecError, RecursionError):
                continue  # not data: the tests cannot use it
    return described


_BATCH = 256  # the most items of an iterator one "next" request returns


def _answer(namespace: dict, objects: list, request) -> dict:
    """The answer to one request of the judge: a call of a solution's function, or an operation the tests apply to
    something a call returned that is not data (an "object": a generator, a map, an instance): its truth value,
    iter() of it, or up to `count` items of next()."""
    try:
        if "call" in request:
            args, kwargs = decode(request["args"]), decode(request["kwargs"])
            return _result(namespace[request["call"]](*args, **kwargs), objects)
        target = objects[request["object"]]
        if request["op"] == "bool":
            return {"value": encode(bool(target))}
        if request["op"] == "iter":
            iterator = iter(target)
            return {"object": request["object"]} if iterator is target else _result(iterator, objects, True)
        if request["op"] == "next":
            return _next_items(target, min(int(request["count"]), _BATCH), objects)
        return {"raised": ["TypeError", "unknown operation"]}
    except BaseException as error:  # noqa: BLE001 -- reported to the judge, which raises it in the tests
        return _raised(error)


def _result(value, objects: list, opaque: bool = False) -> dict:
    """`value` as data, or else as a new object number."""
    if not opaque:
        try:
            return {"value": encode(value)}
        except (CodecError, RecursionError):
            pass
    objects.append(value)
    return {"object": len(objects) - 1}


def _next_items(iterator, count: int, objects: list) -> dict:
    """Up to `count` items of next(iterator), each as data or an object; "end" when it stopped, "raised" what it
    raised after those items."""
    items, answer = [], {}
    for _ in range(max(count, 1)):
        try:
            item = next(iterator)
        except StopIteration:
            answer["end"] = True
            break
        except BaseException as error:  # noqa: BLE001 -- raised in the tests once the items before it are used
            answer["raised"] = _raised(error)["raised"]
            break
        items.append(_result(item, objects))
    answer["items"] = items
    return answer


def _raised(error) -> dict:
    return {"raised": [_builtin_name(type(error)), _message(error)]}


def _builtin_name(kind) -> str:
    for klass in kind.__mro__:
        if klass.__module__ == "builtins":
            return klass.__name__
    return "Exception"


def _message(error) -> str:
    try:
        return str(error)[:1000]
    except BaseException:  # noqa: BLE001 -- a solution's __str__ may raise anything
        return ""


# The judge (trusted: runs the tests, decides the verdict) ------------------------------------------------------------


class SolutionError(Exception):
    """Raised in the tests for a solution call that failed: an exception of no standard kind, an answer that is not
    data, a worker that exited or did not answer in time."""


class SolutionFunction:
    """A solution's function, seen from the tests: calling it sends the arguments to the worker as data and returns
    the decoded result (a fresh value of a standard type), a `SolutionObject` for a result that is not data, or
    raises what the solution raised."""

    __slots__ = ("_channel", "_deadline", "_name")

    def __init__(self, name: str, channel: socket.socket, deadline: float):
        self._name, self._channel, self._deadline = name, channel, deadline

    def __repr__(self) -> str:
        return f"<solution function {self._name}>"

    def __call__(self, *args, **kwargs):
        try:
            request = {"call": self._name, "args": encode(list(args)), "kwargs": encode(kwargs)}
        except CodecError as error:
            raise SolutionError(f"{self._name}: an argument cannot cross the sandbox boundary: {error}") from None
        return _returned(_exchange(self._channel, request, self._deadline, self._name), self._channel, self._deadline)


def _exchange(channel: socket.socket, request: dict, deadline: float, name: str) -> dict:
    data = json.dumps(request, separators=(",", ":"), allow_nan=False).encode()
    if len(data) > _MAX_MESSAGE:
        raise SolutionError(f"{name}: {len(data)} bytes of arguments (at most {_MAX_MESSAGE})")
    channel.sendall(_HEADER.pack(len(data)) + data)
    reply = receive(channel, deadline)
    if reply is None:
        raise SolutionError(f"{name}: the solution's process ended")
    if not isinstance(reply, dict):
        raise SolutionError(f"{name}: not an answer: {reply!r:.80}")
    return reply


def _returned(reply: dict, channel: socket.socket, deadline: float):
    """The value a one-key answer stands for, or the exception it names."""
    if set(reply) == {"value"}:
        return decode(reply["value"])
    if set(reply) == {"object"} and type(reply["object"]) is int:
        return SolutionObject(reply["object"], channel, deadline)
    if set(reply) == {"raised"} and _is_raised(reply["raised"]):
        raise _exception(*reply["raised"])
    raise SolutionError(f"not an answer: {reply!r:.80}")


class SolutionObject:
    """What a solution's function returned that is not data (a generator, a map, an instance), seen from the tests.
    What the tests do to it happens in the worker, and only data comes back: iteration (`list(...)`, `sorted(...)`,
    `for`, `in`, `next(...)`, items fetched in batches) and its truth value. It is equal only to itself, like an
    object whose class does not define equality; anything else (attributes, arithmetic) raises here."""

    __slots__ = ("_buffer", "_channel", "_deadline", "_ended", "_error", "_fetch", "_number")

    def __init__(self, number: int, channel: socket.socket, deadline: float):
        self._number, self._channel, self._deadline = number, channel, deadline
        self._buffer, self._ended, self._error, self._fetch = [], False, None, 1

    def __repr__(self) -> str:
        return f"<solution object {self._number}>"

    def _request(self, op: str, **fields) -> dict:
        request = {"object": self._number, "op": op, **fields}
        return _exchange(self._channel, request, self._deadline, repr(self))

    def __bool__(self) -> bool:
        value = _returned(self._request("bool"), self._channel, self._deadline)
        if type(value) is not bool:
            raise SolutionError(f"{self!r}: a truth value that is not a bool")
        return value

    def __iter__(self):
        iterator = _returned(self._request("iter"), self._channel, self._deadline)
        if not isinstance(iterator, SolutionObject):
            raise SolutionError(f"{self!r}: iter() gave data")
        return self if iterator._number == self._number else iterator

    def __next__(self):
        while not self._buffer:
            if self._error is not None:
                error, self._error = self._error, None
                raise _exception(*error)
            if self._ended:
                raise StopIteration
            self._take(self._request("next", count=self._fetch))
            self._fetch = min(self._fetch * 2, _BATCH)
        return self._buffer.pop(0)

    def _take(self, reply: dict) -> None:
        if not (set(reply) <= {"items", "end", "raised"} and isinstance(reply.get("items"), list)):
            raise SolutionError(f"{self!r}: not an answer: {reply!r:.80}")
        if "raised" in reply and not _is_raised(reply["raised"]):
            raise SolutionError(f"{self!r}: not an answer: {reply!r:.80}")
        items = [_returned(item, self._channel, self._deadline) for item in reply["items"] if isinstance(item, dict)]
        if len(items) != len(reply["items"]):
            raise SolutionError(f"{self!r}: not an answer: {reply!r:.80}")
        self._buffer.extend(items)
        self._ended = reply.get("end") is True
        self._error = reply.get("raised")
        if not items and not self._ended and self._error is None:
            raise SolutionError(f"{self!r}: an empty batch")


def _is_raised(raised) -> bool:
    return isinstance(raised, list) and len(raised) == 2 and all(isinstance(part, str) for part in raised)


def _exception(name: str, message: str) -> BaseException:
    kind = getattr(builtins, name, None) if name.isidentifier() else None
    if isinstance(kind, type) and issubclass(kind, Exception) and name not in _NOT_RERAISED:
        try:
            return kind(message)
        except Exception:  # noqa: BLE001 -- kinds that take other arguments (UnicodeDecodeError)
            pass
    return SolutionError(f"{name}: {message}")


def _not_dumpable() -> None:
    """prctl(PR_SET_DUMPABLE, 0): /proc/<judge>/mem, ptrace and pidfd_getfd refused to every process without
    CAP_SYS_PTRACE in the judge's user namespace (the worker never has it). Linux only: elsewhere there is no
    /proc/<pid>/mem, and ptrace is the system's to restrict."""
    import ctypes

    if not sys.platform.startswith("linux"):
        return

    if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def _preimport(*trees) -> None:
    """Import the modules the tests and the prompt's helpers import (at any depth) and `_COMMON_MODULES`, then refuse
    every later import: the worker may be able to write files the judge would read (a program that runs as the
    trainer's user), so nothing is read from disk once it exists."""
    import ast
    import importlib

    names = list(_COMMON_MODULES)
    for node in (node for tree in trees for node in ast.walk(tree)):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
            names.extend(f"{node.module}.{alias.name}" for alias in node.names)  # submodules (`from os import path`)
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001, S112 -- not a module (a name in one), or missing: the tests fail as they would
            continue
    sys.meta_path.insert(0, _NoImports())


class _NoImports:
    """A finder that refuses every module not imported yet (ImportError naming it)."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        raise ImportError(
            f"{name}: the judge imports nothing once the solution's process exists (docs/code_reward.md)"
        )


def _judge() -> None:
    import ast

    _not_dumpable()
    payload = _read_payload()
    verdict = socket.socket(fileno=payload["verdict_fd"])
    channel = socket.socket(fileno=payload["channel_fd"])
    tree = ast.parse(payload["tests"], "<tests>")
    tests = compile(tree, "<tests>", "exec", dont_inherit=True)
    helpers_tree = ast.parse(payload["helpers"], "<prompt>")
    helpers = compile(helpers_tree, "<prompt>", "exec", dont_inherit=True)
    _preimport(tree, helpers_tree)
    verdict.sendall(READY)
    deadline = time.monotonic() + payload["timeout"]
    hello = receive(channel, deadline)
    if not (isinstance(hello, dict) and set(hello) == {"names"} and isinstance(hello["names"], dict)):
        os._exit(1)  # the solution failed, exited, or answered something else
    namespace = _test_namespace(hello["names"], payload["entry_point"], channel, deadline)
    exec(helpers, namespace)  # the prompt's own helpers, not the solution's redefinitions of them
    exec(tests, namespace)
    if payload["entry_point"] is not None:
        namespace["check"](namespace[payload["entry_point"]])
    verdict.sendall(PASS)
    os._exit(0)


def _test_namespace(names: dict, entry_point, channel: socket.socket, deadline: float) -> dict:
    """The globals the tests run in: the judge's own builtins, and each of the solution's top-level names that does
    not shadow a builtin (except `entry_point`) as a proxy, a standard module the judge imported already, or a
    decoded value."""
    namespace = {}
    for name, described in names.items():
        if not (isinstance(name, str) and name.isidentifier() and not name.startswith("__")):
            continue
        if hasattr(builtins, name) and name != entry_point:
            continue
        if described == ["function"]:
            namespace[name] = SolutionFunction(name, channel, deadline)
        elif isinstance(described, list) and len(described) == 2 and described[0] == "module":
            module = sys.modules.get(described[1]) if isinstance(described[1], str) else None
            if module is not None and described[1].split(".")[0] in sys.stdlib_module_names:
                namespace[name] = module
        elif isinstance(described, list) and len(described) == 2 and described[0] == "value":
            namespace[name] = decode(described[1])
    namespace.update({"__name__": "__main__", "__builtins__": builtins})
    return namespace


def _main(role: str) -> None:
    if role == "worker":
        _worker()
    elif role == "probe":
        _probe()
    elif role == "seccomp":
        _seccomp_probe()
    elif role == "judge":
        try:
            _judge()
        except BaseException:  # noqa: BLE001 -- any failure of the tests is a failing verdict
            os._exit(1)
    else:
        raise SystemExit(f"unknown sandbox role {role!r}: expected worker, judge, probe or seccomp")


if __name__ == "__main__":
    _main(sys.argv[1])
