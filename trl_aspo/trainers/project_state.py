"""The project's checkpoint state, saved and restored the same way by both trainers (docs/resuming.md).

Each checkpoint holds `aspo_state.json` + `aspo_state.safetensors` (trl_aspo.trainers.checkpoint_state): the policy
event counter, the adaptive KL coefficient, the value tracker and what a trainer adds (the synchronous trainer's
stored visits and sampler, the asynchronous one's first-dispatch versions), and the settings a resume is compared
with. `save_project_state` writes it; `restore_project_state` reads it back under one policy: settings that change
what the saved state means are refused, the others applied with a warning, a missing state refused under a tracker
unless `value_reset_on_resume`.
"""

from __future__ import annotations

import logging

from trl_aspo.algorithms.advantage_estimators import get_advantage_estimator
from trl_aspo.config.aspo_config import RESUME_FIELDS
from trl_aspo.trainers.checkpoint_state import (
    STATE_JSON,
    checkpoint_state_file,
    load_checkpoint_state,
    save_checkpoint_state,
)
from trl_aspo.values.event_tracker import EventValueTracker
from trl_aspo.values.event_values import AsyncEventValues
from trl_aspo.values.single_stream import ValueTracker, field_name

logger = logging.getLogger(__name__)

# Of the settings a resume compares with the checkpoint's (`RESUME_FIELDS`, declared with the fields), those refused
# when changed (why), unless marked resettable and `value_reset_on_resume` is set; the others are applied with a
# logged warning.
RESUME_REFUSED = {
    "advantage_estimator": "the saved value tracker belongs to that estimator",
    "prompt_id_column": "the saved tracker's prompt keys come from it",
    "seed": "the saved random states and sampler order come from it",
}
RESUME_RESET = {"advantage_estimator", "prompt_id_column"}


def resume_settings(args, train_rows: int | None) -> dict:
    """The settings a resumed run is compared with (docs/resuming.md)."""
    settings = {name: getattr(args, name) for name in RESUME_FIELDS}
    if settings["value_reward_range"] is not None:
        settings["value_reward_range"] = list(settings["value_reward_range"])
    settings["train_rows"] = train_rows
    return settings


def check_resume_settings(args, saved: dict | None, current: dict, path: str, has_tracker: bool) -> bool:
    """Compare the checkpoint's settings with this run's (docs/resuming.md); returns whether the tracker starts
    fresh. Settings that change what the saved state means are refused, the others applied with a warning. A legacy
    state without recorded settings is only checked for the tracker's presence."""
    reset = args.value_reset_on_resume
    changed = {}
    if saved is not None:
        changed = {name: (saved.get(name), value) for name, value in current.items() if saved.get(name) != value}
    for name in RESUME_REFUSED:
        if name in changed and not (reset and name in RESUME_RESET):
            before, after = changed[name]
            allowed = f" or set {field_name(args, 'value_reset_on_resume')}=True" if name in RESUME_RESET else ""
            raise ValueError(
                f"Resuming from {path} with {name}={after!r}, but the checkpoint was trained with {name}={before!r}: "
                f"{RESUME_REFUSED[name]}. Use {name}={before!r}{allowed}."
            )
    if "train_rows" in changed and args.prioritized_sampling:
        before, after = changed["train_rows"]
        raise ValueError(
            f"Resuming from {path} with a training dataset of {after} rows, but the checkpoint was trained on "
            f"{before} rows: the prioritized sampler's weights and order are per row; use the same dataset."
        )
    for name, (before, after) in changed.items():
        if name not in RESUME_REFUSED:
            logger.warning(f"Resuming from {path}: {name} changes from {before!r} to {after!r}; the new value applies")
    tracked = get_advantage_estimator(args.advantage_estimator).tracks_values
    fresh = tracked and (not has_tracker or "advantage_estimator" in changed)
    if fresh and not reset:
        raise ValueError(
            f"{path} holds no value tracker for advantage_estimator={args.advantage_estimator!r}. Resume with the "
            f"checkpoint's estimator, or set {field_name(args, 'value_reset_on_resume')}=True to start a fresh "
            "tracker on purpose."
        )
    if reset and (fresh or changed.keys() & RESUME_RESET):
        logger.warning(f"Resuming from {path}: value_reset_on_resume=True, the checkpoint's value tracker is not used")
        return True
    return fresh


def require_state_or_reset(args, checkpoint: str, state_name: str) -> None:
    """A checkpoint without trl-aspo state: refused under a value tracker unless `value_reset_on_resume` says to
    start a fresh one on purpose."""
    if not get_advantage_estimator(args.advantage_estimator).tracks_values:
        return
    if not args.value_reset_on_resume:
        raise ValueError(
            f"{checkpoint} holds no trl-aspo state ({state_name}): it was written by an interrupted save, by another "
            f"trainer, or with save_only_model, so the value tracker of advantage_estimator="
            f"{args.advantage_estimator!r} cannot be restored. Resume from an earlier checkpoint, or set "
            f"{field_name(args, 'value_reset_on_resume')}=True to start a fresh tracker on purpose."
        )
    logger.warning(
        f"Resuming from {checkpoint} without trl-aspo state: value_reset_on_resume=True starts a fresh value tracker "
        "(value_init_file applies; no pre-pass)."
    )


def restore_tracker(tracker: ValueTracker, state: dict, path: str, args) -> None:
    """Load the checkpoint's tracker, naming the file when it does not fit; a changed `value_rho` applies from the
    resume on (SPO++; SPO reads rho at each update)."""
    try:
        tracker.load_state_dict(state["tracker"])
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ValueError(
            f"checkpoint state {path} holds a value tracker that advantage_estimator={args.advantage_estimator!r} "
            f"cannot resume: {type(error).__name__}: {error}"
        ) from None
    if isinstance(tracker, EventValueTracker | AsyncEventValues):
        tracker.rho = args.value_rho


def save_project_state(
    checkpoint: str, args, train_rows: int | None, value_event: int, aspo_kl_coef: float, tracker_state, **extra
) -> None:
    """Write the state into `checkpoint` (call on the process that saves). `tracker_state`: the tracker's state dict
    (None without a tracker); `extra`: the trainer's own entries, left out when None or empty."""
    state = {
        "value_event": int(value_event),
        "aspo_kl_coef": float(aspo_kl_coef),
        "config": resume_settings(args, train_rows),
    }
    if tracker_state is not None:
        state["tracker"] = tracker_state
    state.update({name: value for name, value in extra.items() if value})
    save_checkpoint_state(checkpoint, state)


def restore_project_state(
    checkpoint: str, args, train_rows: int | None, tracker: ValueTracker | None, global_step: int | None = None
) -> tuple[dict | None, bool]:
    """Read `checkpoint`'s state, check it against this run, and load its tracker into `tracker` unless the tracker
    starts fresh. Returns the state (None when the checkpoint has none, which only `value_reset_on_resume` allows
    under a tracker) and whether the tracker starts fresh. With `global_step` (the synchronous trainer, one event
    per generation round), the saved event counter may not exceed the checkpoint's micro-steps: a file claiming
    more rounds belongs to another checkpoint."""
    path = checkpoint_state_file(checkpoint)
    if path is None:
        require_state_or_reset(args, checkpoint, STATE_JSON)
        return None, True
    state = load_checkpoint_state(checkpoint)
    # A generation round happens at some micro-step, so a run has had at most as many rounds as micro-steps.
    max_rounds = None if global_step is None else global_step * args.gradient_accumulation_steps
    if max_rounds is not None and state["value_event"] > max_rounds:
        raise ValueError(
            f"checkpoint state {path}: value_event={state['value_event']} exceeds the {max_rounds} micro-steps of "
            f"its global_step={global_step}; the file does not belong to this checkpoint."
        )
    fresh = check_resume_settings(
        args, state.get("config"), resume_settings(args, train_rows), path, has_tracker="tracker" in state
    )
    if tracker is not None and not fresh:
        restore_tracker(tracker, state, path, args)
    return state, fresh
