"""Whether one value fits its field of the field table (`trl_aspo.cli.field_cache`), checked as argparse and the
dataclasses would take it but before torch loads, and the value with its field's type.

Text (a flag's words, or YAML text) is converted as argparse converts it. Other YAML values are mostly left to the
dataclasses, except those that could only end in a raw error deep inside TRL or transformers, or in a run that never
ends: a list or mapping for one number, a boolean or a choice; a date (YAML reads `2020-01-01` as one) or binary
data (`!!binary`) anywhere; a float, a boolean or an integer beyond 64 bits for an integer field; a seed outside
numpy's range; a NUL character in text; a path longer than the file system allows.
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path
from typing import Any

from trl_aspo.cli.config_errors import shown, suggestion

TRUE_WORDS, FALSE_WORDS = ("yes", "true", "t", "y", "1"), ("no", "false", "f", "n", "0")
# The words TRL's converter of an optional number reads as None.
NONE_WORDS = ("none", "null")
KIND_WORDS = {
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "choice": "one of its choices",
    "str": "text",
    "other": "a value of its type",
}
# The integers every int field accepts: torch, numpy and the C code below them hold integers in 64 bits.
INT64_RANGE = (-(2**63), 2**63 - 1)
# transformers' set_seed seeds numpy, which takes seeds in [0, 2^32 - 1] only.
SEED_RANGES = {"seed": (0, 2**32 - 1), "data_seed": (0, 2**32 - 1)}
# Field names that hold a path: these must fit the file system's limits on a path and on one name in it.
PATH_FIELD_ENDINGS = ("_dir", "_file", "_path", "resume_from_checkpoint")
# File suffixes that make a name a path rather than a hub id.
PATH_SUFFIXES = (".yaml", ".yml", ".json", ".jsonl", ".bin", ".pt", ".safetensors", ".txt")
# The built-in names of trl_aspo.builtin.registry, spelled out: importing `trl_aspo.builtin` loads the built-in
# models (torch), which these checks must not (tests/unit/test_cli_first_hour.py compares them with the registry).
BUILTIN_REWARD_NAMES = ("builtin:correctness",)
BUILTIN_TOOL_NAMES = ("builtin:calculator", "builtin:one-op-calculator")
BUILTIN_DATASET_NAMES = ("builtin:calculator", "builtin:multicall", "builtin:calculator-chat")
# List fields whose entries name functions: the built-in names each accepts.
NAME_LISTS = {"reward_funcs": BUILTIN_REWARD_NAMES, "tools": BUILTIN_TOOL_NAMES}


def field_choices(field: dict[str, Any]) -> list:
    """The values a choice field allows: the table's; for a field whose choices a registry holds (`registry`), the
    registry's names now where this process has loaded the config declaring it, so a name registered in this process
    before its config is built passes here as it passes the config."""
    module = sys.modules.get(field.get("registry") or "")
    if module is None:
        return field["choices"]
    from trl_aspo.config.fields import field_spec

    config_class = getattr(module, field["owner"])
    choices = field_spec(config_class.__dataclass_fields__[field["name"]]).allowed_choices(config_class._trainer)
    return [*choices, *([None] if None in field["choices"] else [])]


def value_problem(field: dict[str, Any], value: Any, where: str) -> str | None:
    """Why `value` (a YAML value or a flag's words) does not fit `field`, as the module docstring lists; None if it
    fits."""
    name = field["name"]
    if field["list"]:
        if not isinstance(value, list):
            example = f"[{value}]" if isinstance(value, str) else "[...]"
            return f"{name} ({where}): a list, e.g. {example}; got the {type(value).__name__} {shown(value)}"
        items = value
    else:
        items = [value]
        if isinstance(value, list | dict) and field["kind"] in ("int", "float", "bool", "choice"):
            return f"{name} ({where}): one value ({KIND_WORDS[field['kind']]}), not the {type(value).__name__} " + (
                shown(value)
            )
    if name in NAME_LISTS:
        for item in items:
            if not isinstance(item, str):
                return (
                    f"{name} ({where}): entry {shown(item)} ({type(item).__name__}) is not a name; each entry is a "
                    f"built-in name {sorted(NAME_LISTS[name])} or a dotted import path 'module.function'"
                )
    for item in items:
        problem = _text_problem(field, item) if isinstance(item, str) else _yaml_value_problem(field, item)
        if problem:
            return f"{name} ({where}): {problem}"
    return None


def _text_problem(field: dict[str, Any], text: str) -> str | None:
    kind = field["kind"]
    if "\0" in text:
        return f"{shown(text)} holds a NUL character, which no option's text may hold"
    if field["name"].endswith(PATH_FIELD_ENDINGS) or field["name"] == "model_name_or_path":
        problem = _path_length_problem(text)
        if problem:
            return problem
    if kind == "choice":
        allowed = [str(choice) for choice in field_choices(field)]
        if text not in allowed:
            own = " (or a name that a module listed in plugins registers)" if field.get("registry") else ""
            return f"{shown(text)} is not one of {allowed}{own}{suggestion(text, allowed)}"
    elif kind == "bool" and text.lower() not in TRUE_WORDS + FALSE_WORDS:
        return f"{shown(text)} is not true or false"
    elif kind in ("int", "float") and not (field.get("none_words") and text.lower() in NONE_WORDS):
        try:
            number = (int if kind == "int" else float)(text)
        except ValueError:
            return f"{shown(text)} is not {KIND_WORDS[kind]}"
        if kind == "int":
            return _int_range_problem(field["name"], number)
    return None


def _yaml_value_problem(field: dict[str, Any], value: Any) -> str | None:
    kind = field["kind"]
    expected = KIND_WORDS[kind] + (" (or null)" if field.get("none_words") else "")
    if isinstance(value, bytes):
        return f"binary data (a !!binary value), not {expected}"
    if isinstance(value, datetime.date):
        quote = f"; write '{value.isoformat()}' in quotes for text" if kind == "str" else ""
        return f"{value.isoformat()} is a date (YAML reads it as one), not {expected}{quote}"
    if kind == "int" and value is not None:
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{shown(value)} is not an integer"
        return _int_range_problem(field["name"], value)
    if kind == "float" and isinstance(value, bool):
        return f"{shown(value)} is not a number"
    return None


def _int_range_problem(name: str, number: int) -> str | None:
    low, high = SEED_RANGES.get(name, INT64_RANGE)
    if low <= number <= high:
        return None
    why = "numpy's seed range, which transformers' set_seed uses" if name in SEED_RANGES else "a 64-bit integer"
    return f"{shown(number)} is out of range; allowed: an integer in [{low}, {high}] ({why})"


def _path_length_problem(text: str) -> str | None:
    """Why `text` cannot be a path on this system (too long, or a name in it too long); None if it can be."""
    encoded = os.fsencode(text)
    longest_path, longest_name = _path_limits()
    if len(encoded) >= longest_path:
        return f"a path of {len(encoded):,} bytes; a path may have at most {longest_path - 1:,} on this system"
    name = max(encoded.split(b"/"), key=len)
    if len(name) > longest_name:
        return f"a path with a {len(name):,}-byte name in it; a name may have at most {longest_name} on this system"
    return None


def _path_limits() -> tuple[int, int]:
    """(PATH_MAX, NAME_MAX) of the file system of the working directory (Linux's values where it does not say)."""
    try:
        return os.pathconf(".", "PC_PATH_MAX"), os.pathconf(".", "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        return 4096, 255


def typed_value(field: dict[str, Any], value: Any) -> Any:
    """`value` with the type its field gives it, as argparse converts a flag's text (and TrlParser a YAML default
    that is text: YAML 1.1 reads `2e-4` as a string): numbers, booleans and choices; anything else unchanged."""
    if field["list"] and isinstance(value, list):
        return [typed_value({**field, "list": False}, item) for item in value]
    if not isinstance(value, str):
        return value
    kind = field["kind"]
    if kind in ("int", "float") and field.get("none_words") and value.lower() in NONE_WORDS:
        return None
    try:
        if kind == "int":
            return int(value)
        if kind == "float":
            return float(value)
    except ValueError:
        return value
    if kind == "bool" and value.lower() in TRUE_WORDS + FALSE_WORDS:
        return value.lower() in TRUE_WORDS
    if kind == "choice":
        return next((choice for choice in field_choices(field) if str(choice) == value), value)
    return value


def looks_local(name: str) -> bool:
    """Whether `name` means a local path rather than a hub id ('org/name'): it is absolute, starts with '.' or '~',
    has a backslash or several '/', ends with a file suffix, or its first component is a local folder."""
    if name.startswith(("/", ".", "~")) or "\\" in name or name.count("/") > 1 or name.endswith(PATH_SUFFIXES):
        return True
    return "/" in name and Path(name.split("/", 1)[0]).is_dir()


def missing_path_problem(what: str, name: str, kind: str = "directory") -> str | None:
    """The message for a local-looking `name` that does not exist (None when it exists or is no local path)."""
    if not isinstance(name, str) or name.startswith("builtin:") or not looks_local(name):
        return None
    if Path(name).expanduser().exists():
        return None
    return f"{what} {name!r}: no such {kind}"
