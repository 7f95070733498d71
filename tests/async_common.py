"""Shared pieces of the asynchronous-trainer tests: the built-in checkpoint, its tool-calling tokenizer, and the
fields of a few fast CPU steps of TRL's AsyncGRPOTrainer."""

from __future__ import annotations

from tiny_fields import tiny_run_fields

from trl_aspo.builtin import CHECKPOINT_DIR, load_tokenizer

MODEL = str(CHECKPOINT_DIR)


def calculator_tokenizer():
    """The built-in tokenizer with TRL's response schema, so TRL's worker parses its tool calls."""
    from trl.chat_template_utils import add_response_schema

    return add_response_schema(load_tokenizer(CHECKPOINT_DIR))


def async_fields(tmp_path, **overrides) -> dict:
    """Config fields for a few fast CPU steps (fixed-count batches); keyword overrides replace any field."""
    defaults = dict(
        output_dir=tmp_path / "out", max_steps=3, token_budget=0, max_staleness=2, max_tool_calling_iterations=1
    )
    return tiny_run_fields(**{**defaults, **overrides})


def trainer_with_local_worker(trainer_class, args, tokenizer, dataset, reward_funcs, **worker_options):
    """`trainer_class` on the built-in checkpoint with the calculator tool, generating with a `LocalRolloutWorker`
    (`worker_options`: its seed, jitter, ...) that `LocalWeightTransfer` keeps in sync."""
    from trl_aspo.builtin.task import calculator
    from trl_aspo.infra import LocalRolloutWorker, LocalWeightTransfer, install_cpu_fallbacks

    install_cpu_fallbacks()
    worker = LocalRolloutWorker(MODEL, tokenizer, dataset, reward_funcs, args, tools=[calculator], **worker_options)
    return trainer_class(
        MODEL,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        tools=[calculator],
        rollout_worker=worker,
        weight_transfer=LocalWeightTransfer(worker),
    )
