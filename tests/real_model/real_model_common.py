"""What the real-model tier's test modules share: a reward with signal on an untrained model, the fields of one short
step, and both trainers built on `builtin:smollm2-135m-instruct` with the calculator tool."""

from __future__ import annotations

import hashlib
import json

import torch

from trl_aspo.builtin import SMOLLM2
from trl_aspo.builtin.task import calculator, make_chat_dataset
from trl_aspo.infra import resolve_model_path

THREE_METHODS = dict(loss_type="aspo", tool_shaping=True, advantage_estimator="spo++")
LORA = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def run_fields(tmp_path, **overrides) -> dict:
    fields = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=1,
        max_completion_length=16,
        max_tool_calling_iterations=1,
        max_steps=1,
        learning_rate=1e-5,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=0,
        **THREE_METHODS,
    )
    fields.update(overrides)
    return fields


def snapshot(model) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def moved(before: dict[str, torch.Tensor], model) -> set[str]:
    return {name for name, param in model.named_parameters() if not torch.equal(before[name], param.detach())}


def sync_trainer(tmp_path, model=SMOLLM2, peft_config=None, **overrides):
    from helpers import recording_batches

    from trl_aspo import ASPOConfig, ASPOTrainer

    trainer = ASPOTrainer(
        model,
        reward_funcs=[hashed_reward],
        args=ASPOConfig(**run_fields(tmp_path, **overrides)),
        train_dataset=make_chat_dataset("train", 8),
        tools=[calculator],
        peft_config=peft_config,
    )
    return trainer, recording_batches(trainer)


def async_trainer(tmp_path, peft_config=None, **overrides):
    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer
    from trl_aspo.infra import LocalRolloutWorker, LocalWeightTransfer, install_cpu_fallbacks

    install_cpu_fallbacks()
    fields = run_fields(tmp_path, token_budget=0, max_staleness=2, max_inflight_tasks=4, **overrides)
    args = AsyncASPOConfig(**fields)
    path = resolve_model_path(SMOLLM2)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    dataset = make_chat_dataset("train", 8)
    worker = LocalRolloutWorker(path, tokenizer, dataset, [hashed_reward], args, tools=[calculator])
    trainer = AsyncASPOTrainer(
        path,
        reward_funcs=[hashed_reward],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        tools=[calculator],
        peft_config=peft_config,
        rollout_worker=worker,
        weight_transfer=LocalWeightTransfer(worker),
    )
    advantages, score_step = [], trainer._score_step

    def recording(samples, context=()):
        advantages.append(score_step(samples, context))
        return advantages[-1]

    trainer._score_step = recording
    return trainer, advantages


def hashed_reward(completions, **kwargs) -> list[float]:
    """A reward in [0, 1) that differs between different completions whatever their correctness (a hash of the
    completion's messages), so every group with two different completions carries signal."""
    return [
        int.from_bytes(hashlib.sha256(json.dumps(c, sort_keys=True).encode()).digest()[:4], "big") / 2**32
        for c in completions
    ]
