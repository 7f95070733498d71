"""Shared pieces of the asynchronous-trainer tests: the built-in checkpoint, its tool-calling tokenizer, and the
fields of a few fast CPU steps of TRL's AsyncGRPOTrainer."""

from __future__ import annotations

from trl_aspo.builtin import CHECKPOINT_DIR, load_tokenizer

MODEL = str(CHECKPOINT_DIR)


def calculator_tokenizer():
    """The built-in tokenizer with TRL's response schema, so TRL's worker parses its tool calls."""
    from trl.chat_template_utils import add_response_schema

    return add_response_schema(load_tokenizer(CHECKPOINT_DIR))


def async_fields(tmp_path, **overrides) -> dict:
    """Config fields for a few fast CPU steps (fixed-count batches); keyword overrides replace any field."""
    fields = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=16,
        max_steps=3,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=0,
        token_budget=0,
        max_staleness=2,
        max_tool_calling_iterations=1,
    )
    fields.update(overrides)
    return fields
