"""The checks a tracker's saved state passes before it is restored (a checkpoint's `tracker`), shared by every
tracker kind: each rule is the one the tracker's own methods apply on the way in, and every error names the field and
the prompt key. Each tracker's module holds its own whole-state check (`check_event_tracker_state`,
`check_visit_tracker_state`, `check_async_event_values_state`)."""

from __future__ import annotations

import math
from typing import Any

# A bound on any stored count or event: integers above 2**53 are not exact in float64, and no run gets near it.
MAX_COUNT = 2**53


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT


def state_mapping(state_dict: dict[str, Any], field: str, where: str, required: bool = True) -> dict[str, Any]:
    """`state_dict[field]` as a dict with string keys (an empty one when an optional field is absent)."""
    if field not in state_dict:
        if required:
            raise ValueError(f"{where}.{field} is missing.")
        return {}
    value = state_dict[field]
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        raise ValueError(f"{where}.{field} must map prompt keys (strings) to entries, got {type(value).__name__}.")
    return value


def check_entry(entry: Any, field: str, key: str, names: tuple[str, ...]) -> list:
    """`entry` as a list of len(names) items, or ValueError naming the field and the prompt key."""
    if not isinstance(entry, list | tuple) or len(entry) != len(names):
        raise ValueError(f"{field} of prompt key {key!r} must be [{', '.join(names)}], got {entry!r:.80}.")
    return list(entry)


def check_pseudo_counts(alpha: Any, beta: Any, field: str, key: str) -> None:
    """The rule of `set_pseudo_counts`: finite, >= 0 and not both 0 (one may underflow to 0 after long forgetting,
    never both: the prior or the newest outcome keeps the sum positive), so the value lies in [0, 1]."""
    if not (is_number(alpha) and is_number(beta)) or not (
        math.isfinite(alpha) and math.isfinite(beta) and alpha >= 0 and beta >= 0 and alpha + beta > 0
    ):
        raise ValueError(
            f"{field} of prompt key {key!r}: pseudo-counts alpha={alpha!r}, beta={beta!r} must be finite numbers, "
            ">= 0 and not both 0."
        )


def check_event(value: Any, field: str, key: str, name: str = "event", maximum: int = MAX_COUNT) -> None:
    if not is_count(value) or value > maximum:
        raise ValueError(f"{field} of prompt key {key!r}: {name} must be an integer in [0, {maximum}], got {value!r}.")


def check_reward(value: Any, field: str, key: str) -> None:
    """The rule of `observe`: a reward is a number in [0, 1]."""
    if not is_number(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{field} of prompt key {key!r}: reward {value!r} must be a number in [0, 1].")


def check_visits(state_dict: dict[str, Any], where: str, required: bool) -> None:
    for key, count in state_mapping(state_dict, "visits", where, required).items():
        if not is_count(count):
            raise ValueError(
                f"{where}.visits of prompt key {key!r} must be an integer in [0, {MAX_COUNT}], got {count!r}."
            )


def check_rho(state_dict: dict[str, Any], where: str) -> None:
    rho = state_dict.get("rho")
    if not is_number(rho) or not 0.0 < rho <= 1.0:
        raise ValueError(f"{where}.rho must be a number in (0, 1], got {rho!r}.")
