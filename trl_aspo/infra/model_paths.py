"""Built-in model names as the directories `AsyncGRPOTrainer` loads from (it takes a path, never a model object)."""

from __future__ import annotations

from trl_aspo.builtin import SHIPPED_CHECKPOINTS, is_builtin, smollm2, smollm2_warmstart


def resolve_model_path(model: str) -> str:
    """`builtin:tiny-calculator` / `builtin:tiny-multicall` -> its shipped checkpoint directory;
    `builtin:smollm2-135m-instruct` -> its converted folder in the cache (converted on first use),
    `builtin:smollm2-135m-calculator` -> its warm-started folder there (built on first use); any other path or hub id
    is returned as is."""
    if model in SHIPPED_CHECKPOINTS:
        return str(SHIPPED_CHECKPOINTS[model][0])
    if model == smollm2.NAME:
        return str(smollm2.ensure_converted())
    if model == smollm2_warmstart.NAME:
        return str(smollm2_warmstart.ensure_warm_started())
    if is_builtin(model):
        shipped = ", ".join(repr(name) for name in [*SHIPPED_CHECKPOINTS, smollm2.NAME, smollm2_warmstart.NAME])
        raise ValueError(
            f"model={model!r}: AsyncGRPOTrainer loads its policy from a directory, and only {shipped} ship one. Build "
            "the model, `save_pretrained` it to a directory and pass that path."
        )
    return model
