"""The programs `code_unit_test_reward` runs (this source, by `python -I -c <source> <role>`), and their data codec.

Roles, one source (started by `code_unit_test_reward`: the worker through `unshare`, the run's cgroup and a change
of user where this machine allows them, `trl_aspo.evaluation.isolation`; docs/code_reward.md):

- `worker` (untrusted once the solution runs): in its namespaces it first makes the file system read-only but its
  directory and drops every capability (`_confine`); then it runs the solution and answers calls. It holds no
  secret and decides nothing: it only receives requests `{"call": name, "args": ..., "kwargs": ...}` on its one
  socket and answers with data.
- `probe`: whether `_confine` works here and the network is empty (the isolation probe).
- `judge` (trusted): runs the row's tests, in which every solution name is a proxy that calls the worker across the
  socket. Arguments and results cross as data only (`encode`/`decode`: a tagged encoding of literals, never pickle),
  so no object of the solution ever exists in the judge: nothing the tests compare can be "equal to everything".
  The judge is not dumpable (no other process of the user may read its memory or ptrace it) before the worker
  starts, and its verdict goes on a socket to the trainer that the worker never holds.
"""

import builtins
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
    for kind, tag in ((list, "l"), (tuple, "t"), (set, "S"), (frozenset, "F")):
        if isinstance(value, kind):
            return [tag, [encode(item, depth + 1) for item in value]]
    if isinstance(value, dict):
        return ["d", [[encode(key, depth + 1), encode(item, depth + 1)] for key, item in value.items()]]
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):
        return encode(value.tolist(), depth + 1)
    raise CodecError(f"a {type(value).__name__} cannot cross the sandbox boundary (only literals and containers)")


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
        if tag == "d" and len(fields) == 1 and isinstance(fields[0], list):
            return {decode(key, depth + 1): decode(item, depth + 1) for key, item in map(_pair, fields[0])}
    except CodecError:
        raise
    except (TypeError, ValueError, ArithmeticError) as error:  # a bad hex digit, an unhashable key, a zero den
        raise CodecError(f"invalid encoded {tag!r}: {error}") from None
    raise CodecError(f"unknown tag or layout {node!r:.60}")


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
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as error:
        raise CodecError(f"a message that is not JSON: {error}") from None


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


_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_BIND = 1, 2, 4, 8, 32, 4096
_MS_NOATIME, _MS_NODIRATIME, _MS_RELATIME = 1024, 2048, 1 << 21
_ST_TO_MS = {1: _MS_RDONLY, 2: _MS_NOSUID, 4: _MS_NODEV, 8: _MS_NOEXEC, 1024: _MS_NOATIME, 2048: _MS_NODIRATIME}
_ST_TO_MS[4096] = _MS_RELATIME


def _confine() -> list[str]:
    """In the worker's own user and mount namespace, where it is root with every capability until this returns:
    make every mount read-only except its working directory (a bind mount of its own), then give up every
    capability for good (empty bounding set, no_new_privs, securebits that keep uid 0 from regaining any). The
    solution then cannot write the interpreter's or the trainer's files, unmount the fresh /proc, or remount. Returns
    the mount points it could not make read-only."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    work = os.getcwd().encode()
    if libc.mount(work, work, None, _MS_BIND, None) != 0:
        raise OSError(ctypes.get_errno(), "bind-mounting the working directory")
    os.chdir(work)  # the old working directory is the one under the mount about to be read-only
    left = []
    with open("/proc/self/mounts") as mounts:
        targets = [_unescape(line.split()[1]) for line in mounts]
    for target in dict.fromkeys(targets):
        if target == work.decode():
            continue
        try:
            flags = os.statvfs(target).f_flag
        except OSError:
            continue
        kept = sum(ms for st, ms in _ST_TO_MS.items() if flags & st)
        if libc.mount(None, target.encode(), None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | kept, None) != 0:
            left.append(target)
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
    for capability in range(64):
        libc.prctl(24, capability, 0, 0, 0)  # PR_CAPBSET_DROP (EINVAL past the last one)
    if libc.prctl(28, 0x2F, 0, 0, 0) != 0:  # PR_SET_SECUREBITS: NOROOT, NO_SETUID_FIXUP, KEEP_CAPS, all locked
        raise OSError(ctypes.get_errno(), "setting securebits")
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    if libc.capset(header, (ctypes.c_uint32 * 6)()) != 0:
        raise OSError(ctypes.get_errno(), "dropping capabilities")
    return left


def _unescape(field: str) -> str:
    import re

    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match[1], 8)), field)


def _probe() -> None:
    """Exit 0 only when `_confine` works here and 127.0.0.1 is unreachable (an empty network namespace)."""
    if _confine():
        os._exit(1)
    os._exit(0 if socket.socket().connect_ex(("127.0.0.1", 9)) else 1)


def _worker() -> None:
    if sys.argv[2:] == ["confine"]:
        _confine()
    payload = _read_payload()
    channel = socket.socket(fileno=payload["channel_fd"])
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(payload["solution"], "<solution>", "exec", dont_inherit=True), namespace)
    except BaseException as error:  # noqa: BLE001 -- any failure of the solution, SystemExit included, is a failure
        send(channel, {"failed": type(error).__name__})
        os._exit(1)
    send(channel, {"names": _names(namespace)})
    while True:
        request = receive(channel, None)
        if request is None:
            os._exit(0)
        send(channel, _answer(namespace, request))


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


def _answer(namespace: dict, request) -> dict:
    try:
        args, kwargs = decode(request["args"]), decode(request["kwargs"])
        result = namespace[request["call"]](*args, **kwargs)
        return {"value": encode(result)}
    except BaseException as error:  # noqa: BLE001 -- reported to the judge, which raises it in the tests
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
    the decoded result (a fresh value of a standard type) or raises what the solution raised."""

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
        send(self._channel, request)
        reply = receive(self._channel, self._deadline)
        if reply is None:
            raise SolutionError(f"{self._name}: the solution's process ended")
        if isinstance(reply, dict) and set(reply) == {"value"}:
            return decode(reply["value"])
        if isinstance(reply, dict) and set(reply) == {"raised"} and _is_raised(reply["raised"]):
            raise _exception(*reply["raised"])
        raise SolutionError(f"{self._name}: not an answer: {reply!r:.80}")


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


def _preimport(tree) -> None:
    """Import the modules the tests import (at any depth) and `_COMMON_MODULES`, then refuse every later import: the
    worker may be able to write files the judge would read (a program that runs as the trainer's user), so nothing
    is read from disk once it exists."""
    import ast
    import importlib

    names = list(_COMMON_MODULES)
    for node in ast.walk(tree):
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
    _preimport(tree)
    verdict.sendall(READY)
    deadline = time.monotonic() + payload["timeout"]
    hello = receive(channel, deadline)
    if not (isinstance(hello, dict) and set(hello) == {"names"} and isinstance(hello["names"], dict)):
        os._exit(1)  # the solution failed, exited, or answered something else
    namespace = _test_namespace(hello["names"], payload["entry_point"], channel, deadline)
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
    elif role == "judge":
        try:
            _judge()
        except BaseException:  # noqa: BLE001 -- any failure of the tests is a failing verdict
            os._exit(1)
    else:
        raise SystemExit(f"unknown sandbox role {role!r}: expected worker, judge or probe")


if __name__ == "__main__":
    _main(sys.argv[1])
