"""loss_type="aspo" inside ASPOTrainer: on-policy equivalence with TRL's dapo, and real off-policy runs."""

from __future__ import annotations

import pytest
import torch
from helpers import digit_share_reward

from trl_aspo import ASPOTrainer
from trl_aspo.builtin.task import calculator, correctness_reward


def _trainer(model, tokenizer, dataset, config, **kwargs):
    return ASPOTrainer(
        model=model,
        reward_funcs=[digit_share_reward],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        **kwargs,
    )


def _first_batch(trainer):
    """One generation batch as the training loop would prepare it, outside `train()`."""
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    return trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


def _gradients(trainer, inputs):
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), [p.grad.detach().clone() for p in trainer.model.parameters() if p.grad is not None]


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_on_policy_step_matches_trl(tiny_model, tiny_tokenizer, calculator_dataset, tiny_config, aggregation):
    """Ratio 1 everywhere: the aspo gradient equals TRL's dapo (token) / grpo (sequence) gradient."""
    trainer = _trainer(
        tiny_model, tiny_tokenizer, calculator_dataset, tiny_config(loss_type="aspo", aspo_aggregation=aggregation)
    )
    inputs = _first_batch(trainer)
    assert "old_per_token_logps" not in inputs  # on-policy: TRL uses lp.detach() as the old policy
    assert inputs["advantages"].abs().sum() > 0
    aspo_loss, aspo_grads = _gradients(trainer, inputs)
    trainer.loss_type = "dapo" if aggregation == "token" else "grpo"
    trl_loss, trl_grads = _gradients(trainer, inputs)
    assert len(aspo_grads) == len(trl_grads) > 0
    for ours, theirs in zip(aspo_grads, trl_grads, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
    # Values differ by design only where the flip applies: on-policy the flipped term -A/r equals -A*r = -A.
    torch.testing.assert_close(aspo_loss, trl_loss, atol=1e-6, rtol=1e-5)


def _saved(model, path):
    """The model reloaded from disk: with beta > 0 TRL builds the reference model from the policy's path."""
    from transformers import AutoModelForCausalLM

    model.save_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path)


@pytest.mark.slow
def test_off_policy_run_with_kl_and_tools(tiny_model, tiny_tokenizer, calculator_dataset, tiny_config, tmp_path):
    config = tiny_config(
        loss_type="aspo",
        num_iterations=2,
        beta=0.04,
        max_steps=4,
        max_completion_length=24,
        max_tool_calling_iterations=1,
        aspo_entropy_quantile=0.8,
        aspo_flip_threshold_start=0.5,
        aspo_flip_decay_steps=2,
        aspo_unflipped_fraction=0.25,
        aspo_adaptive_kl_beta=0.08,
        aspo_adaptive_kl_entropy_target=100.0,  # always below target: the coefficient must switch to 0.08
    )
    trainer = ASPOTrainer(
        model=_saved(tiny_model, tmp_path / "policy"),
        reward_funcs=[correctness_reward, digit_share_reward],
        args=config,
        train_dataset=calculator_dataset,
        processing_class=tiny_tokenizer,
        tools=[calculator],
    )
    trainer.train()
    rows = [row for row in trainer.state.log_history if "loss" in row]
    assert len(rows) == 4
    for row in rows:
        assert all(
            key in row
            for key in ("kl", "entropy", "aspo/flip_weight_mean", "aspo/hard_clip_pos_frac", "aspo/dual_clip_neg_frac")
        )
        assert all(torch.isfinite(torch.tensor(row[key])) for key in ("loss", "kl", "entropy"))
    generation_rows = rows[::2]  # num_iterations=2: every other step generates
    assert all(0.0 <= row["repetition_rate"] <= 1.0 for row in generation_rows)
    # The second pass over each generation batch is off-policy: some ratio differs from 1.
    assert any(row["aspo/flip_weight_mean"] != 1.0 for row in rows[1:])
    assert rows[-1]["aspo/kl_coef"] == pytest.approx(0.08)


@pytest.mark.slow
def test_aspo_with_gradient_checkpointing_and_lora(tiny_model, tiny_tokenizer, calculator_dataset, tiny_config):
    from peft import LoraConfig

    config = tiny_config(loss_type="aspo", gradient_checkpointing=True, num_iterations=2, beta=0.02)
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = _trainer(tiny_model, tiny_tokenizer, calculator_dataset, config, peft_config=peft_config)
    lora_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    trainer.train()
    assert lora_before
    assert any(not torch.equal(p, dict(trainer.model.named_parameters())[n]) for n, p in lora_before.items())
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in trainer.state.log_history if "loss" in r)


def test_top_entropy_quantile_and_off_policy_mask_compose(tiny_model, tiny_tokenizer, calculator_dataset, tiny_config):
    """TRL's entropy mask and off-policy sequence mask act on the aspo loss as on TRL's own."""
    config = tiny_config(loss_type="aspo", top_entropy_quantile=0.5, off_policy_mask_threshold=0.5)
    trainer = _trainer(tiny_model, tiny_tokenizer, calculator_dataset, config)
    inputs = _first_batch(trainer)
    aspo_loss, aspo_grads = _gradients(trainer, inputs)
    trainer.loss_type = "dapo"
    trl_loss, trl_grads = _gradients(trainer, inputs)
    torch.testing.assert_close(aspo_loss, trl_loss, atol=1e-6, rtol=1e-5)
    for ours, theirs in zip(aspo_grads, trl_grads, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
