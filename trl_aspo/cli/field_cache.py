"""Where the field table (`trl_aspo.cli.field_table`) is kept between runs, so the checks of a command line answer
before torch loads.

The table is built in a fresh interpreter (so that names a process registered at run time, such as a test's loss,
never enter it) and written atomically into the cache folder: `$TRL_ASPO_CACHE_DIR`, else
`$XDG_CACHE_HOME/trl-aspo`, else `~/.cache/trl-aspo`. Its file is named after what it was built with: the
installed trl, transformers and trl-aspo versions, the Python version and the folder of the trl-aspo package (two
checkouts keep two tables). Inside, it records a hash of every trl-aspo module the build imported, which are the
only sources it can depend on (the field declarations, the loss and estimator registries and the modules that
register into them, the parser, the builder); a table whose modules changed since is built again, as is a missing,
truncated or corrupt one. `make install` builds it (`python -m trl_aspo.cli.field_cache --build`), so the first
command line after installing is checked in a moment too.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

import trl_aspo
from trl_aspo.infra.json_files import write_json_atomic

CACHE_DIR_ENV = "TRL_ASPO_CACHE_DIR"
# Tables kept in the cache folder (the most recently built): one per installation in use.
KEPT_TABLES = 8
PACKAGE_DIR = Path(trl_aspo.__file__).resolve().parent
_LOADED: dict[Path, dict[str, Any]] = {}  # cache file -> its table, read once per process


def cache_dir() -> Path:
    """The folder the tables are kept in (see the module docstring)."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "trl-aspo"


@functools.cache
def installation() -> dict[str, str]:
    """The installed versions the table's fields come from, the Python version, and this package's folder."""
    found = {}
    for name in ("trl", "transformers", "trl-aspo"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return {**found, "python": sys.version.split()[0], "package": str(PACKAGE_DIR)}


def cache_file() -> Path:
    digest = hashlib.sha256(json.dumps(installation(), sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / f"fields-{digest}.json"


def source_hashes(modules: list[str]) -> dict[str, str]:
    """sha256 of each trl-aspo module file (paths relative to the package); '' for one that is gone."""
    hashes = {}
    for name in modules:
        try:
            hashes[name] = hashlib.sha256((PACKAGE_DIR / name).read_bytes()).hexdigest()
        except OSError:
            hashes[name] = ""
    return hashes


def field_table() -> dict[str, Any]:
    """The table for this installation and these sources: from the cache, else built (in a fresh interpreter, a few
    seconds) and cached."""
    path = cache_file()
    if path not in _LOADED:
        table = _read(path, check_sources=True)
        if table is None:
            table = _build_in_fresh_interpreter(path)
        _LOADED[path] = table
    return _LOADED[path]


def _read(path: Path, check_sources: bool) -> dict[str, Any] | None:
    """The table in `path` if it is a whole table of this installation (whose modules are unchanged, when
    `check_sources`); None for a missing, truncated, corrupt or outdated file."""
    try:
        table = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return None
    parts = ("sources", "trainers", "dependencies", "bounds")
    if not isinstance(table, dict) or not all(isinstance(table.get(part), dict) for part in parts):
        return None
    if table.get("installation") != installation():
        return None
    if check_sources and source_hashes(list(table["sources"])) != table["sources"]:
        return None
    return table


def _build_in_fresh_interpreter(path: Path) -> dict[str, Any]:
    """Build the table with `python -m trl_aspo.cli.field_cache --build PATH` and read it back. A cache folder that
    cannot be written gets a temporary file: the check still runs, only not from a cache."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        writable = os.access(path.parent, os.W_OK)
    except OSError:
        writable = False
    with tempfile.TemporaryDirectory() as temporary:
        target = path if writable else Path(temporary) / path.name
        # The child imports this same trl_aspo (the one whose folder names the file), wherever it was imported from.
        search_path = [str(PACKAGE_DIR.parent), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(search_path)}
        command = [sys.executable, "-m", "trl_aspo.cli.field_cache", "--build", str(target)]
        result = subprocess.run(command, capture_output=True, text=True, env=environment)
        if result.returncode != 0:
            raise RuntimeError(
                f"building the field table failed (`{' '.join(command)}`, exit {result.returncode}):\n"
                f"{result.stderr[-4000:]}"
            )
        # Not compared with the sources again: had they changed while the child ran, its table is the newer one.
        table = _read(target, check_sources=False)
    if table is None:
        raise RuntimeError(f"building the field table wrote no whole table to {target}")
    return table


def write_table(path: Path) -> None:
    """Build the table here (imports torch and TRL) and write it to `path` atomically with the hashes of the trl-aspo
    modules the build imported, then keep only the `KEPT_TABLES` newest tables of its folder."""
    from trl_aspo.cli.field_table import build_field_table

    table = build_field_table()
    imported = [getattr(module, "__file__", None) for module in list(sys.modules.values())]
    modules = sorted(
        Path(file).resolve().relative_to(PACKAGE_DIR).as_posix()
        for file in imported
        if file and Path(file).resolve().is_relative_to(PACKAGE_DIR)
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(
        path, {"installation": installation(), "sources": source_hashes(modules), **table}, ensure_ascii=False
    )
    tables = sorted(path.parent.glob("fields-*.json"), key=_modified, reverse=True)
    for stale in tables[KEPT_TABLES:]:
        stale.unlink(missing_ok=True)


def _modified(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # removed meanwhile by another process's pruning
        return 0.0


def main(argv: list[str] | None = None) -> int:
    """`python -m trl_aspo.cli.field_cache --build [PATH]`: build the table into PATH (default: its cache file)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "--build" or len(argv) > 2:
        print("usage: python -m trl_aspo.cli.field_cache --build [PATH]", file=sys.stderr)
        return 2
    path = Path(argv[1]) if len(argv) == 2 else cache_file()
    write_table(path)
    print(f"field table written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
