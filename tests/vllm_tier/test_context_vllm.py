"""The context checks against the real server (`trl vllm-serve --max_model_len 512`): the synchronous trainer in
server mode reads the server's max_model_len (not the model config's positions), and TRL's rollout worker refuses a
turn that does not fit it before the request, naming the conversation (vLLM would shorten its budget silently)."""

from __future__ import annotations

import pytest
from helpers import MODEL, async_fields, calculator_tokenizer, digit_share_reward, tiny_run_fields

from trl_aspo import ASPOConfig, ASPOTrainer, AsyncASPOConfig, AsyncASPOTrainer
from trl_aspo.builtin.task import calculator, make_dataset
from trl_aspo.infra.served_context import served_max_model_len


def test_the_server_reports_its_max_model_len(vllm_server):
    assert served_max_model_len(vllm_server.url) == 512


def test_server_mode_refuses_a_budget_of_the_served_context_naming_the_server(vllm_server, tmp_path):
    fields = tiny_run_fields(
        tmp_path, use_vllm=True, vllm_mode="server", vllm_server_base_url=vllm_server.url, max_completion_length=512
    )
    with pytest.raises(
        ValueError,
        match=r"max_completion_length=512 must be smaller than the model's context of 512 "
        r"tokens \(the vLLM server's max_model_len\)",
    ):
        ASPOTrainer(
            MODEL,
            reward_funcs=digit_share_reward,
            args=ASPOConfig(**fields),
            train_dataset=make_dataset("train", 8, seed=0),
            processing_class=calculator_tokenizer(),
        )


def test_trl_worker_refuses_a_turn_beyond_the_served_context_naming_it(vllm_server, tmp_path):
    fields = async_fields(
        tmp_path,
        vllm_server_base_url=vllm_server.url,
        per_device_train_batch_size=2,
        num_generations=2,
        max_steps=1,
        max_inflight_tasks=1,
        max_completion_length=500,
    )
    trainer = AsyncASPOTrainer(
        MODEL,
        reward_funcs=digit_share_reward,
        args=AsyncASPOConfig(**fields),
        train_dataset=make_dataset("train", 4, seed=0),
        processing_class=calculator_tokenizer(),
        tools=[calculator],
    )
    with pytest.raises(Exception) as error:  # TRL's health check re-raises the worker's failure
        trainer.train()
    text = "".join(str(part) for part in (error.value, error.value.__cause__))
    assert "The conversation starting" in text and "with max_completion_length=500 it needs" in text, text
    assert "the model's context of 512" in text, text
