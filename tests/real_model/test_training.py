"""Both trainers on the real model, one optimizer step each: the three methods together (aspo loss, tool-position
shaping, spo++ value tracking) in float32, a bfloat16 load, and LoRA once per trainer.

The reward is a hash of the completion (conftest.hashed_reward), so advantages are nonzero whatever the untrained
model writes; each test asserts that first, then which parameters moved."""

from __future__ import annotations

import pytest
import torch
from real_model_common import LORA, async_trainer, moved, resolve_model_path, snapshot, sync_trainer

from trl_aspo.builtin import SMOLLM2


@pytest.mark.slow
def test_sync_trainer_trains_the_three_methods_in_float32(tmp_path):
    # One generation round of 4 completions trained as two optimizer steps of 2: the second is off-policy, where
    # the aspo loss's flip acts (on-policy its ratio is 1 and the loss is TRL's).
    trainer, batches = sync_trainer(tmp_path, per_device_train_batch_size=2, steps_per_generation=2, max_steps=2)
    assert trainer.model.dtype == torch.float32
    before = snapshot(trainer.model)
    trainer.train()
    advantages = torch.cat([batch["advantages"].flatten() for batch in batches])
    assert advantages.abs().sum() > 0
    assert moved(before, trainer.model) == set(before)  # full fine-tuning: every parameter


@pytest.mark.slow
def test_async_trainer_trains_the_three_methods_in_float32(tmp_path):
    trainer, advantages = async_trainer(tmp_path)
    before = snapshot(trainer.model)
    trainer.train()
    assert torch.cat(advantages).abs().sum() > 0
    assert moved(before, trainer.model) == set(before)
    policy = trainer.weight_transfer.worker.policy
    assert trainer.weight_transfer.syncs >= 1
    for name, param in trainer.model.named_parameters():
        assert torch.equal(dict(policy.named_parameters())[name], param.detach()), name


@pytest.mark.slow
def test_sync_trainer_trains_a_bfloat16_load(tmp_path):
    # Adam's first step moves each weight by about the learning rate; bf16 keeps 8 bits of mantissa, so 1e-5 on a
    # weight of 0.05 would round away: the bf16 run uses 1e-3.
    trainer, batches = sync_trainer(
        tmp_path,
        model=resolve_model_path(SMOLLM2),
        model_init_kwargs={"dtype": torch.bfloat16},
        learning_rate=1e-3,
    )
    assert trainer.model.dtype == torch.bfloat16
    before = snapshot(trainer.model)
    trainer.train()
    assert torch.cat([batch["advantages"].flatten() for batch in batches]).abs().sum() > 0
    # A bf16 weight w moves only if the step (about the learning rate) exceeds half its spacing, at least |w| / 512:
    # the tensors whose every weight is above 512 * 1e-3 stay put (the final norm's smallest weight is 0.87).
    frozen = {name for name, weight in before.items() if weight.abs().min().item() / 512 > 1e-3}
    assert frozen == {"model.norm.weight"}
    assert moved(before, trainer.model) == set(before) - frozen


@pytest.mark.slow
def test_sync_trainer_with_lora_moves_only_the_adapters(tmp_path):
    from peft import LoraConfig

    trainer, batches = sync_trainer(tmp_path, peft_config=LoraConfig(**LORA))
    before = snapshot(trainer.model)
    trainer.train()
    assert torch.cat([batch["advantages"].flatten() for batch in batches]).abs().sum() > 0
    lora_b = {name for name in before if "lora_B" in name}
    assert len(lora_b) == 2 * 30  # q_proj and v_proj of 30 layers
    # B starts at 0, so A's first gradient (B^T times the output gradient) is 0: one step moves exactly B.
    assert moved(before, trainer.model) == lora_b


@pytest.mark.slow
def test_async_trainer_with_lora_sends_merged_weights_to_its_worker(tmp_path):
    from peft import LoraConfig

    trainer, advantages = async_trainer(tmp_path, peft_config=LoraConfig(**LORA))
    before = snapshot(trainer.model)
    trainer.train()
    assert torch.cat(advantages).abs().sum() > 0
    lora_b = {name for name in before if "lora_B" in name}
    changed = moved(before, trainer.model)
    assert lora_b <= changed
    # TRL's merged sync adds B A into the frozen base weights and subtracts it again: W + BA - BA rounds, so the
    # targeted base weights drift by float32 rounding per sync; nothing else changes (lora_A: B was 0, see above).
    assert changed - lora_b <= {name for name in before if ".base_layer." in name}
    for name in changed - lora_b:
        torch.testing.assert_close(
            dict(trainer.model.named_parameters())[name].detach(), before[name], rtol=0, atol=1e-6
        )
    policy = dict(trainer.weight_transfer.worker.policy.named_parameters())
    scaling = LORA["lora_alpha"] / LORA["r"]
    prefix = "base_model.model."
    checked = 0
    for name, param in trainer.model.named_parameters():
        if ".base_layer.weight" not in name:
            continue
        a = dict(trainer.model.named_parameters())[name.replace("base_layer.weight", "lora_A.default.weight")]
        b = dict(trainer.model.named_parameters())[name.replace("base_layer.weight", "lora_B.default.weight")]
        merged = param.detach() + scaling * b.detach() @ a.detach()
        target = policy[name.removeprefix(prefix).replace(".base_layer", "")]
        torch.testing.assert_close(target, merged, rtol=0, atol=1e-6)
        assert not torch.equal(target, param.detach())  # the adapter moved, so the merge differs from the base
        checked += 1
    assert checked == 2 * 30
