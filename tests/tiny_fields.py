"""The config fields of a few fast CPU training steps on the tiny models, shared by the trainer tests (synchronous,
asynchronous and multi-process); each test overrides what it is about."""

from __future__ import annotations


def tiny_run_fields(output_dir, **overrides) -> dict:
    """`GRPOConfig`/`AsyncGRPOConfig` fields for a short CPU run logging every step; keyword overrides replace any."""
    fields = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=16,
        max_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=0,
    )
    fields.update(overrides)
    return fields
