"""`rollout_state.json`, the asynchronous trainer's resume file: the first untrained prompt group and the model
version.

TRL's `AsyncGRPOTrainer` writes it into every checkpoint for its own worker, and `LocalWorkerResumeMixin`
(trl_aspo.trainers.local_worker_resume) for the local one. `read_rollout_state` checks a file against what the
checkpoint's steps can hold (`rollout_state_bounds`), naming the file, the field and the allowed range.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from trl_aspo.infra.checkpoint_files import TRAINER_STATE_FILE
from trl_aspo.infra.json_files import read_json, require_int, require_object

# rollout_state.json holds two integers; anything near this size is not one.
ROLLOUT_STATE_MAX_BYTES = 4096


def checkpoint_global_step(checkpoint: str) -> int | None:
    """`global_step` of the checkpoint's `trainer_state.json` (checked: an integer >= 0), None without the file."""
    path = os.path.join(checkpoint, TRAINER_STATE_FILE)
    if not os.path.exists(path):
        return None
    state = require_object(read_json(path), path)
    return require_int(state.get("global_step"), path, "global_step", low=0)


class RolloutStateBounds(NamedTuple):
    """The largest `prompt_index` and `model_version` a `rollout_state.json` can hold (None: no bound), and why."""

    max_prompt_index: int | None
    max_model_version: int | None
    prompt_reason: str = ""
    version_reason: str = ""


def rollout_state_bounds(
    global_step: int | None, samples_per_step: int, drops_groups: bool, republishes: bool
) -> RolloutStateBounds:
    """What a `rollout_state.json` saved at `global_step` can hold (where the step is unknown, nothing is bounded).

    - `prompt_index` counts the prompt groups before the first untrained one, over all epochs (the worker starts at
      `prompt_index % rows`, so it may exceed the rows). A group counts once one of its completions is trained, and
      a step trains at most `samples_per_step` completions, so it is at most `global_step * samples_per_step`, unless
      groups are consumed untrained (`drops_groups`: `filter_zero_variance_groups` drops whole groups, any number a
      step), which leaves it unbounded.
    - `model_version` counts weight syncs: at most one a step, plus the cold sync at each (re)start; a resume that
      republishes the checkpoint's version (`republishes`: always for the local worker) mints none, and a checkpoint
      after a restart follows at least one more step, so it is at most `1 + global_step` (`1 + 2 * global_step`)."""
    if global_step is None:
        return RolloutStateBounds(None, None)
    prompt_reason = (
        f" (global_step {global_step} x at most {samples_per_step} trained completions a step with this run's batch "
        "settings, each completion of one group: resume with the checkpoint's batch settings if they differ)"
    )
    restarts = "" if republishes else ", plus one cold sync per restart"
    version_reason = f" (one cold sync, then at most one weight sync per optimizer step{restarts})"
    return RolloutStateBounds(
        None if drops_groups else global_step * samples_per_step,
        1 + global_step * (1 if republishes else 2),
        "" if drops_groups else prompt_reason,
        version_reason,
    )


def read_rollout_state(path: str, bounds: RolloutStateBounds) -> dict[str, int]:
    """`{"prompt_index": int, "model_version": int}` (the version optional: older files lack it) of a checkpoint's
    `rollout_state.json`, each in `[0, bounds.max_*]` (`rollout_state_bounds`); `ValueError` naming the file, the
    field, the value and the allowed range otherwise. Other fields are left to whoever wrote them (TRL reads the
    same file for its own worker)."""
    state = require_object(read_json(path, max_bytes=ROLLOUT_STATE_MAX_BYTES), path)
    if "prompt_index" not in state:
        raise ValueError(f"{path}: prompt_index is missing (the first untrained prompt group, an integer >= 0).")
    checked = {
        "prompt_index": require_int(
            state["prompt_index"], path, "prompt_index", 0, bounds.max_prompt_index, bounds.prompt_reason
        )
    }
    if "model_version" in state:
        checked["model_version"] = require_int(
            state["model_version"], path, "model_version", 0, bounds.max_model_version, bounds.version_reason
        )
    return checked
