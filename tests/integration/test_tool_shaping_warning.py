"""Both trainers warn through one check when tool_shaping has nothing that runs tools (issue 17 item 4)."""

from __future__ import annotations

import warnings

import pytest
from helpers import MODEL, async_fields, calculator_tokenizer

from trl_aspo.builtin.task import calculator, correctness_reward, make_dataset

NO_TOOLS = r"tool_shaping=True, but the trainer has no .*tool_call_pattern is None"


def _sync_trainer(tiny_model, tiny_tokenizer, calculator_dataset, config, **kwargs):
    from trl_aspo import ASPOTrainer

    return ASPOTrainer(
        tiny_model,
        [correctness_reward],
        config,
        train_dataset=calculator_dataset,
        processing_class=tiny_tokenizer,
        **kwargs,
    )


def test_synchronous_trainer_warns_without_tools(tiny_model, tiny_tokenizer, calculator_dataset, tiny_config):
    with pytest.warns(UserWarning, match="ASPOConfig." + NO_TOOLS):
        _sync_trainer(tiny_model, tiny_tokenizer, calculator_dataset, tiny_config(tool_shaping=True))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*" + NO_TOOLS)
        _sync_trainer(
            tiny_model, tiny_tokenizer, calculator_dataset, tiny_config(tool_shaping=True), tools=[calculator]
        )


def _async_trainer(tmp_path, **kwargs):
    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer
    from trl_aspo.infra import NoOpWeightTransfer, ReplayRolloutWorker, install_cpu_fallbacks

    install_cpu_fallbacks()
    fields = async_fields(tmp_path, per_device_train_batch_size=4, num_generations=2, tool_shaping=True)
    return AsyncASPOTrainer(
        MODEL,
        reward_funcs=correctness_reward,
        args=AsyncASPOConfig(**fields),
        train_dataset=make_dataset("train", 8, seed=0),
        processing_class=calculator_tokenizer(),
        rollout_worker=ReplayRolloutWorker([]),
        weight_transfer=NoOpWeightTransfer(),
        **kwargs,
    )


def test_asynchronous_trainer_warns_without_tools(tmp_path):
    with pytest.warns(UserWarning, match="AsyncASPOConfig." + NO_TOOLS):
        _async_trainer(tmp_path)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*" + NO_TOOLS)
        _async_trainer(tmp_path, tools=[calculator])
