"""Rewards that misbehave: infinite values never reach the weights, and float32 rounding of a weighted sum is not a
range violation for the value tracker."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import recording_batches, tiny_run_fields

from trl_aspo import ASPOConfig, ASPOTrainer
from trl_aspo.builtin import build_random_model


def _trainer(tiny_tokenizer, dataset, output_dir, reward_funcs, **overrides) -> ASPOTrainer:
    fields = tiny_run_fields(output_dir, **{"max_completion_length": 8, "max_steps": 1, **overrides})
    return ASPOTrainer(
        model=build_random_model(tiny_tokenizer, seed=0),
        reward_funcs=reward_funcs,
        args=ASPOConfig(**fields),
        train_dataset=dataset,
        processing_class=tiny_tokenizer,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("estimator", "normalization"),
    [
        ("group", "group"),
        ("group", "batch"),
        ("group", "token"),
        ("spo", "batch"),
        ("spo", "token"),
        ("spo++", "batch"),
        ("spo++", "token"),
    ],
)
def test_infinite_rewards_leave_their_completions_unscored(
    tiny_tokenizer, calculator_dataset, tmp_path, estimator, normalization
):
    def infinite_for_the_second(completions, **kwargs):
        # Distinct finite rewards elsewhere, so every scorable completion has a non-zero advantage.
        rewards = [index / len(completions) for index in range(len(completions))]
        rewards[1], rewards[2] = math.inf, -math.inf
        return rewards

    overrides = dict(advantage_estimator=estimator, advantage_normalization=normalization)
    if estimator != "group":
        overrides["num_generations"] = 1
    trainer = _trainer(tiny_tokenizer, calculator_dataset, tmp_path, [infinite_for_the_second], **overrides)
    outputs = recording_batches(trainer)
    trainer.train()

    advantages = outputs[0]["advantages"]
    assert torch.isfinite(advantages).all()
    assert advantages[1] == advantages[2] == 0
    # The other completions keep their signal, also those sharing a group with the infinite ones (0 and 3).
    assert (advantages[[0, *range(3, 8)]] != 0).all()
    loss = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert len(loss) == 1 and math.isfinite(loss[0])
    if trainer._values is not None:
        # Only the 6 scorable outcomes are observed (spo++ also enters the 2 unscored prompts at dispatch, unvisited).
        visited = trainer._values.tracker.state_dict()["visits"]
        assert sorted(visited.values()) == [1] * 6


@pytest.mark.slow
def test_weighted_full_credit_rounding_above_one_is_accepted(tiny_tokenizer, calculator_dataset, tmp_path):
    def full_credit(completions, **kwargs):
        return [1.0] * len(completions)

    # Ten weights of 0.1 sum to 1.0000001 in float32: every completion's total is just above 1.
    reward_funcs = []
    for index in range(10):
        reward = lambda completions, **kwargs: full_credit(completions)  # noqa: E731
        reward.__name__ = f"full_credit_{index}"
        reward_funcs.append(reward)
    trainer = _trainer(
        tiny_tokenizer,
        calculator_dataset,
        tmp_path,
        reward_funcs,
        advantage_estimator="spo++",
        num_generations=1,
        reward_weights=[0.1] * 10,
    )
    outputs = recording_batches(trainer)
    trainer.train()
    assert torch.isfinite(outputs[0]["advantages"]).all()
    keys = list(trainer._values.tracker.state_dict()["state"])
    # One outcome of exactly 1 (clamped) at event 0 on the Beta(0.5, 0.5) prior: (0.5 + 1) / (0.5 + 0.5 + 1).
    assert trainer._values.tracker.value(keys, 1).tolist() == pytest.approx([0.75] * 8, abs=1e-12)


@pytest.mark.slow
def test_rewards_clearly_above_one_are_still_refused(tiny_tokenizer, calculator_dataset, tmp_path):
    def slightly_too_large(completions, **kwargs):
        return [1.00001] * len(completions)

    trainer = _trainer(
        tiny_tokenizer,
        calculator_dataset,
        tmp_path,
        [slightly_too_large],
        advantage_estimator="spo",
        num_generations=1,
    )
    with pytest.raises(ValueError, match=r"needs total rewards in \[0, 1\]; got 1\.00001"):
        trainer.train()
