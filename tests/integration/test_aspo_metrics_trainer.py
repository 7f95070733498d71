"""What a short single-stream ASPOTrainer run logs: zero_advantage_share, and no frac_reward_zero_std."""

from __future__ import annotations

from trl_aspo.builtin.task import correctness_reward


def test_single_stream_logs_zero_advantage_share_and_not_frac_reward_zero_std(
    tiny_model, tiny_tokenizer, calculator_dataset, tiny_config
):
    """With one completion per prompt every TRL group has one member, so `frac_reward_zero_std` would read 1.0 on
    every step: it is left out, and `zero_advantage_share` says which completions carry no signal."""
    from trl_aspo import ASPOTrainer

    args = tiny_config(advantage_estimator="spo++", num_generations=1, max_steps=2, max_completion_length=8)
    trainer = ASPOTrainer(
        tiny_model, [correctness_reward], args, train_dataset=calculator_dataset, processing_class=tiny_tokenizer
    )
    trainer.train()
    rows = [row for row in trainer.state.log_history if "loss" in row]
    assert len(rows) == 2
    assert all("frac_reward_zero_std" not in row and 0.0 <= row["zero_advantage_share"] <= 1.0 for row in rows)
