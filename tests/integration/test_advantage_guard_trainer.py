"""Issue 17 item 10: a non-finite advantage stops the run where it is made in both trainers (before, a NaN advantage
logged loss 0.0, made every weight NaN, and the next generation crashed elsewhere)."""

from __future__ import annotations

import pytest
import torch

from trl_aspo.algorithms.advantage_checks import NonFiniteAdvantageError


def overflowing_penalty(texts, positions, lengths, num_calls, interactive_turns, advantages):
    """A `tool_shaping_penalty` returning 1e308: finite in float64, infinite in float32 (the loss's precision)."""
    return torch.full(advantages.shape, 1e308, dtype=torch.float64)


@pytest.mark.slow
def test_sync_trainer_stops_on_an_overflowing_advantage(tiny_tokenizer, calculator_dataset, tiny_config):
    from helpers import digit_share_reward

    from trl_aspo import ASPOTrainer
    from trl_aspo.builtin import build_random_model

    config = tiny_config(
        max_steps=1, tool_shaping=True, tool_shaping_penalty=f"{__name__}.overflowing_penalty", num_iterations=2
    )
    with pytest.warns(UserWarning, match="tool_shaping=True"):  # no tools: the penalty still applies to every one
        trainer = ASPOTrainer(
            model=build_random_model(tiny_tokenizer, seed=0),
            reward_funcs=[digit_share_reward],
            args=config,
            train_dataset=calculator_dataset,
            processing_class=tiny_tokenizer,
        )
    weights = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    with pytest.raises(
        NonFiniteAdvantageError,
        match=r"advantages are not finite in float32 .*computed from: reward\[0\]=.*rewards/digit_share_reward\[0\]="
        rf".*ASPOConfig\.tool_shaping_penalty='{__name__}\.overflowing_penalty'",
    ):
        trainer.train()
    assert all(torch.equal(p, weights[name]) for name, p in trainer.model.named_parameters())  # no step taken


@pytest.mark.slow
def test_async_trainer_stops_on_an_overflowing_advantage(tmp_path):
    from helpers import async_fields, calculator_tokenizer, trainer_with_local_worker

    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer
    from trl_aspo.builtin.task import correctness_reward, make_dataset

    args = AsyncASPOConfig(
        **async_fields(tmp_path, per_device_train_batch_size=4, num_generations=2, max_steps=1, max_inflight_tasks=1),
        tool_shaping=True,
        tool_shaping_penalty=f"{__name__}.overflowing_penalty",
    )
    trainer = trainer_with_local_worker(
        AsyncASPOTrainer, args, calculator_tokenizer(), make_dataset("train", 32, seed=0), [correctness_reward]
    )
    with pytest.raises(
        NonFiniteAdvantageError,
        match=r"4 of 4 advantages are not finite in float32 .*computed from: reward\[0\]=.*"
        rf"AsyncASPOConfig\.tool_shaping_penalty='{__name__}\.overflowing_penalty'",
    ):
        trainer.train()
