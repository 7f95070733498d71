"""Stopping and resuming a training run: `resume_from_checkpoint: true`, the Ctrl-C message, tied-weight checkpoints.

- `resolve_resume_checkpoint`: transformers' convention that `true` means the latest `checkpoint-*` of `output_dir`
  (`transformers.trainer_utils.get_last_checkpoint`), for the string a YAML file or command line gives, except that
  only a complete checkpoint counts (`complete_checkpoint`): one a kill or a full disk stopped while it was written
  is skipped, and named (`skipped_checkpoints_note`).
- `interrupt_message`: the one line printed when a run is stopped with Ctrl-C, naming the checkpoint to resume from
  and the command that does it, spelled so that it runs as printed (`cli_command`).
- `TiedWeightsCheckpointMixin`: a trainer mixin under which resuming a model with tied input and output embeddings
  (the built-in models, Qwen2.5-0.5B/1.5B, ...) loads without a "missing keys ['lm_head.weight']" warning.

Nothing here imports torch or transformers: `trl-aspo train` checks `resume_from_checkpoint` before they load.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from pathlib import Path

TRUE_WORDS = ("true", "yes", "1")
FALSE_WORDS = ("false", "no", "0", "")
# transformers.trainer_utils' PREFIX_CHECKPOINT_DIR and _re_checkpoint, and TRAINER_STATE_NAME: `Trainer` writes the
# state file last into a new checkpoint (after the weights, optimizer, scheduler and every rank's random states,
# where trl-aspo's trainers add their own state), so a folder without it was not finished.
CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")
TRAINER_STATE_NAME = "trainer_state.json"
# Set by `trl-aspo train` for the processes `accelerate launch` starts: the words that start the run again (the
# executable, `train` and the launcher flags as the user gave them), as a JSON list.
RELAUNCH_ENV = "TRL_ASPO_RELAUNCH"


def resolve_resume_checkpoint(resume_from_checkpoint, output_dir: str) -> str | None:
    """The checkpoint folder a run resumes from: None for none (`None`, `false`), the latest complete
    `checkpoint-*` of `output_dir` for `true` (an error naming the folder when it has none), otherwise the path as
    given (an error when it is a folder that is not a complete checkpoint)."""
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    word = str(resume_from_checkpoint).strip().lower()
    if word in FALSE_WORDS:
        return None
    if resume_from_checkpoint is True or word in TRUE_WORDS:
        latest = latest_checkpoint(output_dir)
        if latest is None:
            incomplete = [path.name for path in existing_checkpoints(output_dir)]
            if incomplete:
                raise ValueError(
                    f"resume_from_checkpoint=true: no checkpoint-* folder in output_dir {output_dir!r} is complete "
                    f"({_listed(incomplete)} {'has' if len(incomplete) == 1 else 'have'} no {TRAINER_STATE_NAME}: a "
                    "run stopped while saving, or a full disk). Start afresh without resume_from_checkpoint."
                )
            raise ValueError(
                f"resume_from_checkpoint=true: there is no checkpoint-* folder in output_dir {output_dir!r} to resume "
                "from. Give a checkpoint path, or start afresh without resume_from_checkpoint."
            )
        return latest
    path = str(resume_from_checkpoint)
    if os.path.isdir(path) and not complete_checkpoint(path):
        latest = latest_checkpoint(os.path.dirname(os.path.abspath(path)))
        instead = f"; the latest complete one beside it is {latest}" if latest else ""
        raise ValueError(
            f"resume_from_checkpoint={path!r}: not a complete checkpoint (no {TRAINER_STATE_NAME}: a run stopped "
            f"while saving it, or a full disk){instead}."
        )
    return path


def existing_checkpoints(output_dir: str) -> list[Path]:
    """The `checkpoint-<step>` folders of `output_dir`, complete or not, by step."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    found = [path for path in folder.iterdir() if CHECKPOINT_NAME.match(path.name) and path.is_dir()]
    return sorted(found, key=lambda path: int(CHECKPOINT_NAME.match(path.name)[1]))


def complete_checkpoint(path: str | Path) -> bool:
    """Whether a checkpoint folder was saved to the end (it holds `trainer_state.json`, written last)."""
    return (Path(path) / TRAINER_STATE_NAME).is_file()


def latest_checkpoint(output_dir: str) -> str | None:
    """The newest complete `checkpoint-*` folder of `output_dir`, or None."""
    complete = [path for path in existing_checkpoints(output_dir) if complete_checkpoint(path)]
    return str(complete[-1]) if complete else None


def skipped_checkpoints_note(output_dir: str, resumed: str) -> str | None:
    """The line saying which incomplete checkpoints newer than `resumed` (the latest complete one) were passed
    over; None when there are none."""
    step = int(CHECKPOINT_NAME.match(Path(resumed).name)[1]) if CHECKPOINT_NAME.match(Path(resumed).name) else -1
    skipped = [
        path.name
        for path in existing_checkpoints(output_dir)
        if int(CHECKPOINT_NAME.match(path.name)[1]) > step and not complete_checkpoint(path)
    ]
    if not skipped:
        return None
    it_was = "it was" if len(skipped) == 1 else "they were"
    return (
        f"Skipped {_listed(skipped)} in {output_dir}: no {TRAINER_STATE_NAME}, so {it_was} not saved to the end "
        f"(a run stopped while saving, or a full disk); resuming from the latest complete one, {resumed}."
    )


def _listed(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def cli_command() -> list[str]:
    """The words that run `trl-aspo` as this process was run, from any directory: the absolute path of the
    `trl-aspo` executable when the process was started through it (it need not be on PATH: `make quickstart` leaves
    it in .venv/bin), else this interpreter with `-m trl_aspo.cli.main` (`python -m`, or under `accelerate
    launch`)."""
    program = sys.argv[0] if sys.argv else ""
    if os.path.basename(program) == "trl-aspo" and os.path.isfile(program) and os.access(program, os.X_OK):
        return [os.path.abspath(program)]
    return [sys.executable, "-m", "trl_aspo.cli.main"]


def resume_command(argv: list[str], checkpoint: str) -> str:
    """`trl-aspo train` (as `cli_command` spells it, with the launcher flags of a multi-process run) with the run's
    own arguments and `--resume_from_checkpoint checkpoint` (replacing any)."""
    kept, index = [], 0
    while index < len(argv):
        if argv[index] == "--resume_from_checkpoint":
            index += 2
            continue
        if not argv[index].startswith("--resume_from_checkpoint="):
            kept.append(argv[index])
        index += 1
    start = json.loads(os.environ[RELAUNCH_ENV]) if os.environ.get(RELAUNCH_ENV) else [*cli_command(), "train"]
    return shlex.join([*start, *kept, "--resume_from_checkpoint", checkpoint])


def interrupt_message(argv: list[str], output_dir: str, step: int | None) -> str:
    """The one line a Ctrl-C'd run prints: where it stopped (`step`, None before training), the checkpoint it can
    resume from and the command that does."""
    stopped = "Interrupted" if step is None else f"Interrupted at step {step}"
    checkpoint = latest_checkpoint(output_dir)
    if checkpoint is None:
        return (
            f"{stopped}, with no checkpoint in {output_dir} to resume from (save_strategy: steps and save_steps "
            "keep some)."
        )
    return f"{stopped}; latest checkpoint {checkpoint}. Resume with: {resume_command(argv, checkpoint)}"


class TiedWeightsCheckpointMixin:
    """Recognize tied weights when `Trainer` loads a checkpoint's model weights on resume.

    A model with tied embeddings is saved without its output head (safetensors keeps one copy of shared storage), so
    `model.load_state_dict(..., strict=False)` reports `lm_head.weight` missing, and transformers warns unless the key
    is in `_keys_to_ignore_on_save`, which transformers 5 no longer sets for tied weights. A missing key is not
    missing when the model ties it to a parameter the checkpoint did load (`get_expanded_tied_weights_keys`, the
    mapping transformers' own `from_pretrained` uses): that parameter is the same tensor. Any other missing or
    unexpected key is still reported."""

    def _issue_warnings_after_load(self, load_result) -> None:
        model = self.accelerator.unwrap_model(self.model)
        expand = getattr(model, "get_expanded_tied_weights_keys", None)
        tied = expand(all_submodels=True) if expand is not None else {}
        missing = set(load_result.missing_keys)
        loaded_through_tie = {
            target
            for target, source in tied.items()
            if target in missing and source not in missing and _same_tensor(model, target, source)
        }
        remaining = [key for key in load_result.missing_keys if key not in loaded_through_tie]
        super()._issue_warnings_after_load(load_result._replace(missing_keys=remaining))


def _same_tensor(model, first: str, second: str) -> bool:
    try:
        return model.get_parameter(first) is model.get_parameter(second)
    except AttributeError:
        return False
