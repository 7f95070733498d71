"""Stopping and resuming a training run: `resume_from_checkpoint: true`, the Ctrl-C message, tied-weight checkpoints.

- `resolve_resume_checkpoint`: transformers' convention that `true` means the latest `checkpoint-*` of `output_dir`
  (`transformers.trainer_utils.get_last_checkpoint`), for the string a YAML file or command line gives.
- `interrupt_message`: the one line printed when a run is stopped with Ctrl-C, naming the checkpoint to resume from
  and the command that does it.
- `TiedWeightsCheckpointMixin`: a trainer mixin under which resuming a model with tied input and output embeddings
  (the built-in models, Qwen2.5-0.5B/1.5B, ...) loads without a "missing keys ['lm_head.weight']" warning.
"""

from __future__ import annotations

import os
import shlex

TRUE_WORDS = ("true", "yes", "1")
FALSE_WORDS = ("false", "no", "0", "")


def resolve_resume_checkpoint(resume_from_checkpoint, output_dir: str) -> str | None:
    """The checkpoint folder a run resumes from: None for none (`None`, `false`), the latest `checkpoint-*` of
    `output_dir` for `true` (an error naming the folder when it has none), otherwise the path as given."""
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    word = str(resume_from_checkpoint).strip().lower()
    if word in FALSE_WORDS:
        return None
    if resume_from_checkpoint is True or word in TRUE_WORDS:
        latest = latest_checkpoint(output_dir)
        if latest is None:
            raise ValueError(
                f"resume_from_checkpoint=true: there is no checkpoint-* folder in output_dir {output_dir!r} to resume "
                "from. Give a checkpoint path, or start afresh without resume_from_checkpoint."
            )
        return latest
    return str(resume_from_checkpoint)


def latest_checkpoint(output_dir: str) -> str | None:
    """The newest complete `checkpoint-*` folder of `output_dir`, or None."""
    from transformers.trainer_utils import get_last_checkpoint

    return get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None


def resume_command(argv: list[str], checkpoint: str) -> str:
    """`trl-aspo train` with the run's own arguments and `--resume_from_checkpoint checkpoint` (replacing any)."""
    kept, index = [], 0
    while index < len(argv):
        if argv[index] == "--resume_from_checkpoint":
            index += 2
            continue
        if not argv[index].startswith("--resume_from_checkpoint="):
            kept.append(argv[index])
        index += 1
    return shlex.join(["trl-aspo", "train", *kept, "--resume_from_checkpoint", checkpoint])


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
