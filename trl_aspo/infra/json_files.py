"""Bounded, checked reading and atomic writing of the small JSON files a run leaves behind.

`read_json` reads only a regular file (a link to `/dev/zero` or a FIFO is refused before it is opened, so a read
cannot run until memory is exhausted or block), no more than `max_bytes`, refuses a file whose parsed value would take
more than `max_expanded` bytes (estimated from its bytes before parsing, as the code reward's judge bounds its
messages: 120 MB of `[],` was parsed at a 3.2 GB peak), and turns every failure into a `ValueError` that names the
file (and, for bad JSON, the line and column; an integer beyond Python's digit limit too). The `require_*` checks turn
a field of the wrong type or range into a `ValueError` that names the file, the field, the value and what is allowed.
`write_json_atomic` writes a temporary file in the same folder, fsyncs it and renames it onto the target
(`os.replace` is atomic within a file system), so a reader sees the old file or the new one, never half of one.
"""

from __future__ import annotations

import json
import math
import os
import stat
import tempfile
from typing import Any

# The largest JSON file read by default: a `trainer_state.json` of 100k logged steps at ~1 kB a row fits.
MAX_JSON_BYTES = 128 * 2**20
# The most memory the parsed value of one file may take by `expanded_size`'s bound: a `trainer_state.json` of
# MAX_JSON_BYTES with ~20 numeric fields a row is bounded by about 6x its bytes (~770 MiB), which fits.
MAX_JSON_EXPANDED = 2**30


def expanded_size(data: bytes) -> int:
    """An upper bound, in bytes, of what `json.loads(data)` allocates, counted without parsing: the rule of the code
    reward's judge (`trl_aspo.evaluation.sandbox.expanded_size`, measured on CPython 3.11 for lists, dicts, strings,
    ints and floats: at most 29 bytes per byte of `[],`, against this bound's 54)."""
    containers = data.count(b"[") + data.count(b"{")
    return 2 * len(data) + 40 * data.count(b",") + 120 * containers + 32 * data.count(b'"')


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    kinds += ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def read_json(path: str | os.PathLike, max_bytes: int = MAX_JSON_BYTES, max_expanded: int | None = None) -> Any:
    """The JSON value in the regular file `path` (symbolic links are followed to their target, which must be a
    regular file too) of at most `max_bytes` bytes, whose parsed value takes at most `max_expanded` bytes by
    `expanded_size` (None: `MAX_JSON_EXPANDED`, read at the call); `ValueError` naming the file otherwise."""
    path = os.fspath(path)
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"{path} is {_kind(mode)}, not a regular file: refusing to read it as JSON.")
        # O_NONBLOCK: should the file be swapped for a FIFO after the check, opening it does not wait for a writer.
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(descriptor, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                raise ValueError(f"{path} is not a regular file: refusing to read it as JSON.")
            data = handle.read(max_bytes + 1)
    except OSError as error:
        raise ValueError(f"{path} cannot be read: {error.strerror or error}") from None
    if len(data) > max_bytes:
        raise ValueError(f"{path} is larger than {max_bytes} bytes, the most read from a JSON file here.")
    max_expanded = MAX_JSON_EXPANDED if max_expanded is None else max_expanded
    expanded = expanded_size(data)
    if expanded > max_expanded:
        raise ValueError(
            f"{path} would take up to {expanded >> 20} MiB once parsed ({len(data)} bytes, mostly containers and "
            f"separators), more than the {max_expanded >> 20} MiB a JSON file may take here: refusing to read it."
        )
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text (byte {error.start}): not a JSON file.") from None
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{path} is not valid JSON (truncated or corrupt?): {error.msg} at line {error.lineno} column "
            f"{error.colno}."
        ) from None
    except RecursionError:
        raise ValueError(f"{path} nests JSON values too deeply to be read.") from None
    except ValueError as error:  # e.g. an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise ValueError(f"{path} holds a value that cannot be read: {error}.") from None


def require_object(value: Any, path: str, field: str | None = None) -> dict:
    """`value` if it is a JSON object, else `ValueError` naming the file (and the field)."""
    if not isinstance(value, dict):
        where = f"{path}: {field}" if field else f"{path}: the top level"
        raise ValueError(f"{where} must be a JSON object, got {type(value).__name__} {_short(value)}.")
    return value


def require_list(value: Any, path: str, field: str) -> list:
    if not isinstance(value, list):
        raise ValueError(f"{path}: {field} must be a JSON list, got {type(value).__name__} {_short(value)}.")
    return value


def require_int(value: Any, path: str, field: str, low: int | None = 0, high: int | None = None, why: str = "") -> int:
    """`value` if it is an integer (not a bool, not 2.0) in `[low, high]` (None: unbounded), else `ValueError`
    naming the file, the field, the value and the range (and `why` that range, when given)."""
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low):
        raise ValueError(f"{path}: {field} must be {_int_range(low, high)}{why}, got {_short(value)}.")
    if high is not None and value > high:
        raise ValueError(f"{path}: {field} must be {_int_range(low, high)}{why}, got {_short(value)}.")
    return value


def require_number(
    value: Any, path: str, field: str, low: float | None = None, high: float | None = None, what: str = ""
) -> float:
    """`value` as a float if it is a finite JSON number (not a bool) in `[low, high]`, else `ValueError` naming the
    file, the field, the value and what is allowed (`what`, e.g. "a fraction in [0, 1]")."""
    allowed = what or _number_range(low, high)
    ok = not isinstance(value, bool) and isinstance(value, int | float)
    if ok:
        number = float(value) if not isinstance(value, int) or abs(value) < 2**1023 else math.inf
        ok = math.isfinite(number) and (low is None or number >= low) and (high is None or number <= high)
    if not ok:
        raise ValueError(f"{path}: {field} must be {allowed}, got {_short(value)}.")
    return number


def _int_range(low: int | None, high: int | None) -> str:
    return _range("an integer", low, high, str)


def _number_range(low: float | None, high: float | None) -> str:
    return _range("a finite number", low, high, lambda bound: f"{bound:g}")


def _range(kind: str, low, high, show) -> str:
    if low is not None and high is not None:
        return f"{kind} in [{show(low)}, {show(high)}]"
    if low is not None:
        return f"{kind} >= {show(low)}"
    return kind if high is None else f"{kind} <= {show(high)}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def write_json_atomic(path: str | os.PathLike, value: Any, **dump_kwargs: Any) -> None:
    """Write `value` as JSON to `path` atomically: into a temporary file of the same folder, fsynced, then renamed
    onto `path` (and the folder fsynced, so the rename survives a crash). The temporary file is removed on failure."""
    path = os.fspath(path)
    folder = os.path.dirname(path) or "."
    text = json.dumps(value, **dump_kwargs)
    descriptor, temporary = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix="-" + os.path.basename(path))
    try:
        with os.fdopen(descriptor, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
    directory = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
