"""Both trainers refuse a `max_completion_length` that leaves no room in the model's context once the model is
loaded, and the synchronous trainer a prompt that does not fit with it (issue 45 item 7: 10^9 was accepted and
generation ran past the model's positions)."""

from __future__ import annotations

import pytest
from helpers import MODEL, async_fields, calculator_tokenizer

from trl_aspo import ASPOTrainer
from trl_aspo.builtin.task import correctness_reward
from trl_aspo.infra import NoOpWeightTransfer, ReplayRolloutWorker


def test_the_synchronous_trainer_refuses_a_budget_beyond_the_context(
    tiny_tokenizer, tiny_model, calculator_dataset, tiny_config
):
    context = tiny_model.config.max_position_embeddings
    with pytest.raises(
        ValueError, match=rf"max_completion_length={10**9} must be smaller than the model's context of "
    ):
        ASPOTrainer(
            tiny_model,
            [correctness_reward],
            tiny_config(max_completion_length=10**9),
            train_dataset=calculator_dataset,
            processing_class=tiny_tokenizer,
        )
    with pytest.raises(ValueError, match=rf"max_completion_length={context} must be smaller than .* {context} tokens"):
        ASPOTrainer(
            tiny_model,
            [correctness_reward],
            tiny_config(max_completion_length=context),
            train_dataset=calculator_dataset,
            processing_class=tiny_tokenizer,
        )


def test_the_synchronous_trainer_refuses_a_prompt_that_does_not_fit(
    tiny_tokenizer, tiny_model, calculator_dataset, tiny_config
):
    context = tiny_model.config.max_position_embeddings
    trainer = ASPOTrainer(
        tiny_model,
        [correctness_reward],
        tiny_config(max_completion_length=context - 4, max_steps=1),
        train_dataset=calculator_dataset,
        processing_class=tiny_tokenizer,
    )
    with pytest.raises(ValueError, match=rf"^The prompt .* has \d+ tokens: with max_completion_length={context - 4} "):
        trainer.train()


def test_the_asynchronous_trainer_refuses_a_budget_beyond_the_context(tmp_path):
    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer
    from trl_aspo.builtin.task import make_dataset
    from trl_aspo.infra import install_cpu_fallbacks

    install_cpu_fallbacks()
    args = AsyncASPOConfig(**async_fields(tmp_path, max_completion_length=10**9))
    with pytest.raises(
        ValueError, match=rf"max_completion_length={10**9} must be smaller than the model's context of "
    ):
        AsyncASPOTrainer(
            MODEL,
            reward_funcs=correctness_reward,
            args=args,
            train_dataset=make_dataset("train", 4, seed=0),
            processing_class=calculator_tokenizer(),
            rollout_worker=ReplayRolloutWorker([]),
            weight_transfer=NoOpWeightTransfer(),
        )


def test_the_local_worker_refuses_a_conversation_that_does_not_fit(tmp_path):
    """The local worker samples up to max_completion_length after each turn's whole conversation: one that does not
    fit the policy's positions stops the run with the error naming it."""
    from helpers import trainer_with_local_worker

    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer
    from trl_aspo.builtin.task import make_dataset

    tokenizer = calculator_tokenizer()
    fields = async_fields(tmp_path, per_device_train_batch_size=2, num_generations=2, max_steps=1)
    args = AsyncASPOConfig(**{**fields, "max_completion_length": 500, "max_inflight_tasks": 1})
    trainer = trainer_with_local_worker(
        AsyncASPOTrainer, args, tokenizer, make_dataset("train", 4, seed=0), [correctness_reward]
    )
    with pytest.raises(Exception) as error:  # TRL's health check re-raises the worker's failure
        trainer.train()
    text = "".join(str(part) for part in (error.value, error.value.__cause__))
    assert "The conversation starting" in text and "with max_completion_length=500 it needs" in text, text
