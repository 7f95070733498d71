"""Stopping and resuming a training run: `resume_from_checkpoint: true`, the Ctrl-C message, tied-weight checkpoints.

- `resolve_resume_checkpoint`: transformers' convention that `true` means the latest `checkpoint-*` of `output_dir`
  (`transformers.trainer_utils.get_last_checkpoint`), for the string a YAML file or command line gives, except that
  only a complete checkpoint counts (`complete_checkpoint`: its `trainer_state.json` is there and reads as a JSON
  object): one a kill or a full disk stopped while it was written is skipped, and named
  (`skipped_checkpoints_note`); a checkpoint already at `max_steps` is refused (`finished_run_problem`).
- `interrupt_message`: the one line printed when a run is stopped with Ctrl-C, naming the checkpoint to resume from
  and the command that does it, spelled so that it runs as printed from any folder (`cli_command`,
  `with_absolute_paths`).
- `TiedWeightsCheckpointMixin`: the trainers' resume hook. `trainer.train(resume_from_checkpoint=...)` follows the
  rule above (the Python API as the CLI), refuses an asynchronous checkpoint whose `rollout_state.json` is gone
  (`missing_rollout_state`), and a model with tied input and output embeddings (the built-in models,
  Qwen2.5-0.5B/1.5B, ...) loads without a "missing keys ['lm_head.weight']" warning.

Nothing here imports torch or transformers at import time: `trl-aspo train` checks `resume_from_checkpoint` before
they load.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
from pathlib import Path

from trl_aspo.infra.checkpoint_files import CHECKPOINT_NAME, ROLLOUT_STATE_FILE, TRAINER_STATE_FILE
from trl_aspo.infra.json_files import read_json, require_object

logger = logging.getLogger(__name__)

TRUE_WORDS = ("true", "yes", "1")
FALSE_WORDS = ("false", "no", "0", "")
# Set by `trl-aspo train` for the processes `accelerate launch` starts: the words that start the run again (the
# executable, `train` and the launcher flags as the user gave them), as a JSON list.
RELAUNCH_ENV = "TRL_ASPO_RELAUNCH"


def resolve_resume_checkpoint(resume_from_checkpoint, output_dir: str, max_steps: int | None = None) -> str | None:
    """The checkpoint folder a run resumes from: None for none (`None`, `false`), the latest complete
    `checkpoint-*` of `output_dir` for `true` (an error naming the folder when it has none), otherwise the path as
    given (an error when it is a folder that is not a complete checkpoint). With `max_steps` > 0, a checkpoint
    already at `max_steps` is refused (`finished_run_problem`)."""
    checkpoint = _resolved_checkpoint(resume_from_checkpoint, output_dir)
    problem = finished_run_problem(checkpoint, max_steps) if checkpoint is not None else None
    if problem is not None:
        raise ValueError(f"resume_from_checkpoint={resume_from_checkpoint!r}: {problem}")
    return checkpoint


def finished_run_problem(checkpoint: str, max_steps: int | None) -> str | None:
    """Why resuming from `checkpoint` would train past `max_steps`, None when it would not: transformers' `Trainer`
    resumed at `global_step >= max_steps` trains one more step before its loop checks the limit (seen here: a run
    of max_steps=2 resumed from its checkpoint-2 saved checkpoint-3)."""
    if not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps <= 0:
        return None
    state_file = Path(checkpoint) / TRAINER_STATE_FILE
    if not state_file.is_file():
        return None
    step = require_object(read_json(state_file), str(state_file)).get("global_step")
    if not isinstance(step, int) or step < max_steps:
        return None
    return (
        f"{checkpoint} is at step {step}, and max_steps={max_steps}: that run is finished (transformers' Trainer "
        "would train one step past max_steps). Raise max_steps to train on from it, or start afresh without "
        "resume_from_checkpoint."
    )


def _resolved_checkpoint(resume_from_checkpoint, output_dir: str) -> str | None:
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    word = str(resume_from_checkpoint).strip().lower()
    if word in FALSE_WORDS:
        return None
    if resume_from_checkpoint is True or word in TRUE_WORDS:
        latest = latest_checkpoint(output_dir)
        if latest is None:
            incomplete = existing_checkpoints(output_dir)
            if incomplete:
                raise ValueError(
                    f"resume_from_checkpoint=true: no checkpoint-* folder in output_dir {output_dir!r} is complete "
                    f"({_why_incomplete(incomplete, verb=True)}: a run stopped while saving, or a full disk). Start "
                    "afresh without resume_from_checkpoint."
                )
            raise ValueError(
                f"resume_from_checkpoint=true: there is no checkpoint-* folder in output_dir {output_dir!r} to resume "
                "from. Give a checkpoint path, or start afresh without resume_from_checkpoint."
            )
        return latest
    path = str(resume_from_checkpoint)
    problem = incomplete_checkpoint_problem(path) if os.path.isdir(path) else None
    if problem is not None:
        latest = latest_checkpoint(os.path.dirname(os.path.abspath(path)))
        instead = f"; the latest complete one beside it is {latest}" if latest else ""
        raise ValueError(
            f"resume_from_checkpoint={path!r}: not a complete checkpoint ({problem}: a run stopped while saving it, "
            f"or a full disk){instead}."
        )
    return path


def existing_checkpoints(output_dir: str) -> list[Path]:
    """The `checkpoint-<step>` folders of `output_dir`, complete or not, by step."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    found = [path for path in folder.iterdir() if CHECKPOINT_NAME.match(path.name) and path.is_dir()]
    return sorted(found, key=lambda path: int(CHECKPOINT_NAME.match(path.name)[1]))


def incomplete_checkpoint_problem(path: str | Path) -> str | None:
    """Why a checkpoint folder was not saved to the end, None when it was: `trainer_state.json`, written last, is
    missing, or does not read as a JSON object (transformers writes it in place, so a kill or a full disk during
    that write leaves it cut short; the error names the file and where its JSON breaks off)."""
    state = Path(path) / TRAINER_STATE_FILE
    if not os.path.lexists(state):
        return f"no {TRAINER_STATE_FILE}"
    try:
        require_object(read_json(state), str(state))
    except ValueError as error:
        # Without the reader's closing period: the caller's message goes on after it.
        return f"an unreadable {TRAINER_STATE_FILE}: {str(error).rstrip('.')}"
    return None


def complete_checkpoint(path: str | Path) -> bool:
    """Whether a checkpoint folder was saved to the end (`incomplete_checkpoint_problem` finds nothing)."""
    return incomplete_checkpoint_problem(path) is None


def latest_checkpoint(output_dir: str) -> str | None:
    """The newest complete `checkpoint-*` folder of `output_dir`, or None."""
    # Newest first: each check reads a trainer_state.json, which grows with the run's log history.
    return next((str(path) for path in reversed(existing_checkpoints(output_dir)) if complete_checkpoint(path)), None)


def skipped_checkpoints_note(output_dir: str, resumed: str) -> str | None:
    """The line saying which incomplete checkpoints newer than `resumed` (the latest complete one) were passed
    over; None when there are none."""
    step = int(CHECKPOINT_NAME.match(Path(resumed).name)[1]) if CHECKPOINT_NAME.match(Path(resumed).name) else -1
    skipped = [
        path
        for path in existing_checkpoints(output_dir)
        if int(CHECKPOINT_NAME.match(path.name)[1]) > step and not complete_checkpoint(path)
    ]
    if not skipped:
        return None
    it_was = "it was" if len(skipped) == 1 else "they were"
    return (
        f"Skipped {_listed([path.name for path in skipped])} in {output_dir}: {_why_incomplete(skipped)}, so "
        f"{it_was} not saved to the end (a run stopped while saving, or a full disk); resuming from the latest "
        f"complete one, {resumed}."
    )


def _why_incomplete(paths: list[Path], verb: bool = False) -> str:
    """What the incomplete checkpoints `paths` lack, grouped: 'no trainer_state.json' (with `verb`: 'checkpoint-3
    has no trainer_state.json'); where some have one that cannot be read, each group names its folders."""
    groups: dict[str, list[str]] = {}
    for path in paths:
        problem = incomplete_checkpoint_problem(path) or ""
        # The reader's error repeats the path; the group's folder names say which checkpoints it is.
        kind = f"no {TRAINER_STATE_FILE}" if problem.startswith("no ") else f"an unreadable {TRAINER_STATE_FILE}"
        groups.setdefault(kind, []).append(path.name)
    if verb:
        return "; ".join(
            f"{_listed(names)} {'has' if len(names) == 1 else 'have'} {kind}" for kind, names in groups.items()
        )
    if len(groups) == 1:
        return next(iter(groups))
    return "; ".join(f"{kind} ({_listed(names)})" for kind, names in groups.items())


def _listed(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def missing_rollout_state(trainer, checkpoint: str) -> str | None:
    """The refusal for resuming `trainer` (an asynchronous one) from a complete `checkpoint` without
    `rollout_state.json`, None when nothing is missing.

    TRL's worker and the local one write the file into every checkpoint before `trainer_state.json`, and read it on
    resume only for a map-style dataset; when it is gone, TRL (and the local worker, as TRL) logs a warning and
    starts the prompt stream again at prompt 0, so the resumed run trains the prompts it already trained. Another
    worker writes no such file, and an iterable dataset cannot be repositioned: nothing is missing then."""
    worker = getattr(trainer, "rollout_worker", None)
    if worker is None:
        return None
    import datasets
    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

    from trl_aspo.infra.local_worker import LocalRolloutWorker

    if not isinstance(worker, AsyncRolloutWorker | LocalRolloutWorker):
        return None
    if not isinstance(trainer.train_dataset, datasets.Dataset):
        return None
    path = os.path.join(checkpoint, ROLLOUT_STATE_FILE)
    if os.path.lexists(path):
        return None
    return (
        f"resume_from_checkpoint={checkpoint!r}: {path} is missing. The asynchronous trainer writes it into every "
        "checkpoint before trainer_state.json (the first untrained prompt group and the model version), so it was "
        "deleted, or the checkpoint is not the asynchronous trainer's; without it the prompt stream would restart "
        "at prompt 0 and train those prompts again. Resume from another checkpoint, or, to restart the stream on "
        f'purpose, write {{"prompt_index": 0, "model_version": 0}} into {path}.'
    )


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


def with_absolute_paths(argv: list[str], output_dir: str) -> list[str]:
    """`argv` (a `trl-aspo train` command line) with the `--config` file made absolute and `--output_dir` set to
    the absolute `output_dir` the run writes (added when the YAML gave it), so that the command reads the same
    file and continues in the same folder from any directory."""
    words, index, has_output_dir = [], 0, False
    while index < len(argv):
        word = argv[index]
        name, equals, value = word.partition("=")
        if name in ("--config", "--output_dir") and (equals or index + 1 < len(argv)):
            has_output_dir = has_output_dir or name == "--output_dir"
            if not equals:
                index += 1
                value = argv[index]
            given = os.path.abspath(output_dir if name == "--output_dir" else value)
            words += [f"{name}={given}"] if equals else [name, given]
        else:
            words.append(word)
        index += 1
    return words if has_output_dir else [*words, "--output_dir", os.path.abspath(output_dir)]


def interrupt_message(argv: list[str], output_dir: str, step: int | None, stopped: str | None = None) -> str:
    """The one line a stopped run prints: where it stopped (`stopped`, else "Interrupted at step `step`", `step` None
    before training), the checkpoint it can resume from and the command that does, with absolute paths
    (`with_absolute_paths`) so that it runs from any folder."""
    if stopped is None:
        stopped = "Interrupted" if step is None else f"Interrupted at step {step}"
    checkpoint = latest_checkpoint(output_dir)
    if checkpoint is None:
        return (
            f"{stopped}, with no checkpoint in {output_dir} to resume from (save_strategy: steps and save_steps "
            "keep some)."
        )
    checkpoint = os.path.abspath(checkpoint)
    command = resume_command(with_absolute_paths(argv, output_dir), checkpoint)
    return f"{stopped}; latest checkpoint {checkpoint}. Resume with: {command}"


class TiedWeightsCheckpointMixin:
    """The trainers' resume hook (listed first among their bases).

    `train(resume_from_checkpoint=...)` resolves the checkpoint as `trl-aspo train` does (`resolve_resume_checkpoint`:
    `True` takes the latest complete checkpoint of `output_dir` and logs the incomplete ones it passed over; a path to
    an incomplete one is refused, naming what it lacks), where `Trainer` would take the newest folder by name and
    fail later on its missing or cut-short `trainer_state.json` with an error naming no file; a checkpoint already at
    `max_steps` is refused where `Trainer` would train one step past it. An asynchronous
    checkpoint without its `rollout_state.json` is refused (`missing_rollout_state`).

    Tied weights are recognized when `Trainer` loads a checkpoint's model weights on resume. A model with tied
    embeddings is saved without its output head (safetensors keeps one copy of shared storage), so
    `model.load_state_dict(..., strict=False)` reports `lm_head.weight` missing, and transformers warns unless the key
    is in `_keys_to_ignore_on_save`, which transformers 5 no longer sets for tied weights. A missing key is not
    missing when the model ties it to a parameter the checkpoint did load (`get_expanded_tied_weights_keys`, the
    mapping transformers' own `from_pretrained` uses): that parameter is the same tensor. Any other missing or
    unexpected key is still reported."""

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        checkpoint = resolve_resume_checkpoint(resume_from_checkpoint, self.args.output_dir, self.args.max_steps)
        if checkpoint is not None and checkpoint != resume_from_checkpoint:
            skipped = skipped_checkpoints_note(self.args.output_dir, checkpoint)
            if skipped:
                logger.warning(skipped)
        if checkpoint is not None:
            refusal = missing_rollout_state(self, checkpoint)
            if refusal:
                raise ValueError(refusal)
        return super().train(checkpoint, *args, **kwargs)

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
