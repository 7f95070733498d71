"""`builtin:smollm2-135m-instruct` in the vLLM environment: its transformers loads the converted folder the main
environment wrote (the cache is shared), and `trl vllm-serve` serves it to `AsyncASPOTrainer` with TRL's own worker
for one step with LoRA, the adapter merged into the weights synced to the server (TRL's merged path)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from vllm_common import LOGPROB_TOLERANCE, fixed_prompt_ids, policy_logprobs, server_completion, server_logprobs
from vllm_tier.conftest import VLLMServer

from trl_aspo.builtin import smollm2

USER_SMOLLM2_ROOT = smollm2.cache_root()  # read at collection, before tests/conftest.py points the cache elsewhere


@pytest.fixture(scope="module")
def smollm2_dir(field_table_folder):
    if not (USER_SMOLLM2_ROOT / smollm2.converted_dir().name).is_dir():
        pytest.fail(f"{smollm2.NAME} is not converted in {USER_SMOLLM2_ROOT}: run `make install-smollm2` first.")
    return USER_SMOLLM2_ROOT / smollm2.converted_dir().name


@pytest.fixture(scope="module")
def smollm2_server(smollm2_dir, tmp_path_factory):
    server = VLLMServer(smollm2_dir, tmp_path_factory.mktemp("smollm2-server"))
    try:
        server.wait_until_healthy()
        yield server
    finally:
        server.stop()


def test_the_vllm_environment_loads_the_converted_folder(smollm2_dir):
    import tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.chat_template_utils import qwen2_5_chat_template

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    raw = tokenizers.Tokenizer.from_file(str(Path(smollm2_dir) / "tokenizer.json"))
    text = 'Let me compute.<tool_call>\n{"name": "calculator"}\n</tool_call><|im_end|> café 数字'
    assert tokenizer(text, add_special_tokens=False).input_ids == raw.encode(text, add_special_tokens=False).ids
    assert tokenizer.chat_template == qwen2_5_chat_template
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, len(tokenizer)) == (0, 2, 49156)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    assert model.config.vocab_size == 49156 and "quantization_config" not in model.config.to_dict()


def test_one_async_lora_step_against_the_server_syncs_merged_weights(smollm2_server, smollm2_dir, tmp_path):
    import torch
    from helpers import async_fields, digit_share_reward
    from peft import LoraConfig
    from transformers import AutoTokenizer

    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer
    from trl_aspo.builtin.task import calculator, make_chat_dataset

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    fields = async_fields(
        tmp_path,
        vllm_server_base_url=smollm2_server.url,
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=1,
        max_completion_length=16,
        max_inflight_tasks=4,
        learning_rate=1e-4,
        dtype="float32",
    )
    trainer = AsyncASPOTrainer(
        str(smollm2_dir),
        reward_funcs=digit_share_reward,  # TRL's worker runs it in a spawned process: a module-level function
        args=AsyncASPOConfig(**fields),
        train_dataset=make_chat_dataset("train", 8),
        processing_class=tokenizer,
        tools=[calculator],
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
    )
    trainer.train()
    assert trainer.state.global_step == 1
    trainer._sync_weight()
    prompt = fixed_prompt_ids(tokenizer)
    completion = server_completion(smollm2_server.url, prompt)
    with torch.no_grad():
        trainer.model.merge_adapter()
        try:
            merged = policy_logprobs(trainer.model.get_base_model(), prompt, completion)
        finally:
            trainer.model.unmerge_adapter()
    gap = merged - server_logprobs(smollm2_server.url, prompt, completion)
    assert gap.abs().max().item() <= LOGPROB_TOLERANCE
