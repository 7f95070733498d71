"""Stable prompt identities for the per-prompt value trackers (SPO, arXiv 2509.13232; SPO++, arXiv 2608.24870).

A tracker keeps one Beta belief per prompt across the whole run and across restarts, so the key must be the same
in every process and every session. The key is either a user-named dataset column (stringified), or a content
hash of the prompt::

    key = blake2b(canonical_json(prompt), digest_size=16).hexdigest()

``canonical_json`` sorts dict keys and uses fixed separators, so a conversational prompt (list of message
dicts) or a plain string hashes identically regardless of dict insertion order. Python's ``hash()`` is never
used: it is salted per process (``PYTHONHASHSEED``).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any


def prompt_key(prompt: Any) -> str:
    """Stable 32-hex-digit content hash of a prompt (string or list of chat messages)."""
    try:
        canonical = json.dumps(prompt, sort_keys=True, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"cannot hash prompt of type {type(prompt).__name__}: it is not plain JSON data ({err}); name a "
            "dataset column holding a prompt id instead."
        ) from err
    return hashlib.blake2b(canonical.encode("utf-8"), digest_size=16).hexdigest()


def prompt_id_key(value: Any, column: str) -> str:
    """The key of a `prompt_id_column` value: its text, for a string, an integer or a finite float.

    None and NaN are refused (as strings 'None' and 'nan' they would merge every prompt lacking an id into one
    tracker entry), and so are containers, whose text is no stable identity."""
    if isinstance(value, float) and not math.isfinite(value) or value is None:
        raise ValueError(
            f"prompt id column {column!r} holds {value!r}: every row needs a prompt id (a string or a number); "
            "rows without one would share a single value-tracker entry."
        )
    if not isinstance(value, str | int | float):
        raise ValueError(
            f"prompt id column {column!r} holds a {type(value).__name__} ({value!r}); a prompt id must be a string "
            "or a number."
        )
    return str(value)


def column_prompt_keys(values: Sequence[Any], column: str) -> list[str]:
    """`prompt_id_key` of every value of a dataset's `column`, in row order; the error names the first bad row, so
    a dataset is checked whole when it is read rather than when that row is first drawn."""
    keys = []
    for row, value in enumerate(values):
        try:
            keys.append(prompt_id_key(value, column))
        except ValueError as error:
            raise ValueError(f"dataset row {row}: {error}") from None
    return keys


def _without_none_fields(prompt: Any) -> Any:
    if isinstance(prompt, Mapping):
        return {key: _without_none_fields(value) for key, value in prompt.items() if value is not None}
    if isinstance(prompt, list | tuple):
        return [_without_none_fields(item) for item in prompt]
    return prompt


def prompt_match_key(prompt: Any) -> str:
    """`prompt_key` of the prompt without None-valued fields, for matching prompts written by hand (a value-init
    file) against dataset prompts to which `datasets` added fields such as `'name': None` to every message."""
    return prompt_key(_without_none_fields(prompt))


def prompt_keys(inputs: Sequence[Mapping[str, Any]], column: str | None = None) -> list[str]:
    """Keys for dataset rows: ``prompt_id_key(row[column], column)`` if ``column`` is given, else
    ``prompt_key(row["prompt"])``."""
    field = "prompt" if column is None else column
    keys = []
    for row in inputs:
        try:
            value = row[field]
        except KeyError:
            what = "prompt id column" if column is not None else "column"
            raise ValueError(f"{what} {field!r} is missing from a dataset row (available: {sorted(row)}).") from None
        keys.append(prompt_key(value) if column is None else prompt_id_key(value, column))
    return keys
