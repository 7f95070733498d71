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


def prompt_keys(inputs: Sequence[Mapping[str, Any]], column: str | None = None) -> list[str]:
    """Keys for dataset rows: ``str(row[column])`` if ``column`` is given, else ``prompt_key(row["prompt"])``."""
    field = "prompt" if column is None else column
    keys = []
    for row in inputs:
        try:
            value = row[field]
        except KeyError:
            what = "prompt id column" if column is not None else "column"
            raise ValueError(f"{what} {field!r} is missing from a dataset row (available: {sorted(row)}).") from None
        keys.append(prompt_key(value) if column is None else str(value))
    return keys
