"""Issue 17 item 10: a non-finite advantage stops the run where it is made, naming what fed it, in both trainers
(before, a NaN advantage logged loss 0.0, made every weight NaN, and the next generation crashed elsewhere)."""

from __future__ import annotations

import pytest
import torch

from trl_aspo import ASPOConfig
from trl_aspo.algorithms.advantage_checks import NonFiniteAdvantageError, advantage_sources, check_finite_advantages


def overflowing_penalty(texts, positions, lengths, num_calls, interactive_turns, advantages):
    """A `tool_shaping_penalty` returning 1e308: finite in float64, infinite in float32 (the loss's precision)."""
    return torch.full(advantages.shape, 1e308, dtype=torch.float64)


def test_finite_advantages_pass_and_others_name_their_inputs():
    advantages = torch.tensor([0.5, -0.5, 0.0])
    assert check_finite_advantages(advantages, {}) is advantages
    sources = {"reward": torch.tensor([1.0, 2.0, 3.0]), "ASPOConfig.tool_shaping_penalty": "my.penalty"}
    for bad in (float("nan"), float("inf"), 1e308):
        values = torch.tensor([0.5, bad, 0.0], dtype=torch.float64)
        with pytest.raises(
            NonFiniteAdvantageError,
            match=r"1 of 3 advantages are not finite in float32 \(sample 1: .*\).*computed from: reward\[1\]=2\.0; "
            r"ASPOConfig\.tool_shaping_penalty='my\.penalty'",
        ):
            check_finite_advantages(values, sources)
    assert issubclass(NonFiniteAdvantageError, ValueError)


def test_sources_name_the_shaping_fields_only_when_shaping():
    plain = ASPOConfig(output_dir="unused", per_device_train_batch_size=4, num_generations=2, use_cpu=True)
    assert set(advantage_sources(plain, {"reward": torch.zeros(1)})) == {
        "reward",
        "ASPOConfig.advantage_estimator",
        "ASPOConfig.advantage_normalization",
    }
    shaped = ASPOConfig(
        output_dir="unused", per_device_train_batch_size=4, num_generations=2, use_cpu=True, tool_shaping=True
    )
    assert "ASPOConfig.tool_shaping_penalty" in advantage_sources(shaped, {})


@pytest.mark.slow
def test_sync_trainer_stops_on_an_overflowing_advantage(tiny_tokenizer, calculator_dataset, tiny_config):
    from dense_reward import digit_share_reward

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
    from async_common import async_fields, calculator_tokenizer, trainer_with_local_worker

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
