"""Built-in model names as the directories `AsyncGRPOTrainer` loads from (it takes a path, never a model object)."""

from __future__ import annotations

from ..builtin import CHECKPOINT_DIR, TINY_CALCULATOR, is_builtin


def resolve_model_path(model: str) -> str:
    """`builtin:tiny-calculator` -> its shipped checkpoint directory; any other path or hub id is returned as is."""
    if model == TINY_CALCULATOR:
        return str(CHECKPOINT_DIR)
    if is_builtin(model):
        raise ValueError(
            f"model={model!r}: AsyncGRPOTrainer loads its policy from a directory, and only {TINY_CALCULATOR!r} "
            "ships one. Build the model, `save_pretrained` it to a directory and pass that path."
        )
    return model
