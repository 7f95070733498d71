"""A policy loss registered in a user's own file (examples/clipped_is_loss.py: CISPO under another name) trains in both
trainers with no trl-aspo file edited; the registry refuses what it cannot run (issue 29, item 1)."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
from helpers import REPO_ROOT, async_fields, calculator_tokenizer, digit_share_reward, fixed_policy, packed_inputs

from trl_aspo.algorithms import PolicyLossInputs, get_policy_loss, register_policy_loss
from trl_aspo.algorithms.policy_losses import unregister_policy_loss


@pytest.fixture(scope="module")
def clipped_is():
    """The example file imported as a user would import their own module (registering "clipped_is")."""
    spec = importlib.util.spec_from_file_location("clipped_is_loss", REPO_ROOT / "examples" / "clipped_is_loss.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    unregister_policy_loss("clipped_is")
    sys.modules.pop("clipped_is_loss", None)


def _gradients(trainer, inputs):
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), [p.grad.detach().clone() for p in trainer.model.parameters() if p.grad is not None]


def test_the_synchronous_gradient_is_trls_own_cispo(
    clipped_is, tiny_model, tiny_tokenizer, calculator_dataset, tiny_config
):
    """TRL computes the same loss as `cispo` inline: on one real batch whose old policy is moved off the current
    one (so some ratios pass epsilon_high and are clipped), the registered loss gives TRL's gradient and value."""
    from trl_aspo import ASPOTrainer

    config = tiny_config(loss_type="clipped_is", epsilon_high=1.05, steps_per_generation=2, num_iterations=2)
    trainer = ASPOTrainer(
        tiny_model,
        [digit_share_reward],
        args=config,
        train_dataset=calculator_dataset,
        processing_class=tiny_tokenizer,
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    noise = torch.randn(inputs["old_per_token_logps"].shape, generator=torch.Generator().manual_seed(0))
    inputs["old_per_token_logps"] = inputs["old_per_token_logps"] + 0.2 * noise
    assert inputs["advantages"].abs().sum() > 0
    ours, our_grads = _gradients(trainer, inputs)
    clipped = trainer._metrics["train"]["clipped_is/clipped_mean"]
    assert clipped and 0 < clipped[0][0] / clipped[0][1] < 1  # (clipped tokens, action tokens): some, not all
    trainer.loss_type = "cispo"
    theirs, their_grads = _gradients(trainer, inputs)
    assert len(our_grads) == len(their_grads) > 0
    for mine, trl in zip(our_grads, their_grads, strict=True):
        torch.testing.assert_close(mine, trl, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)


def test_the_asynchronous_gradient_by_hand(clipped_is, tmp_path):
    """Five packed tokens of one step: d loss / d lp = -min(r, epsilon_high) * A / 5 (token mean over the step)."""
    from helpers import trainer_with_local_worker

    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer
    from trl_aspo.builtin.task import correctness_reward, make_dataset

    args = AsyncASPOConfig(
        **async_fields(tmp_path, per_device_train_batch_size=4, num_generations=2, max_steps=1),
        loss_type="clipped_is",
        epsilon_high=1.2,
    )
    trainer = trainer_with_local_worker(
        AsyncASPOTrainer, args, calculator_tokenizer(), make_dataset("train", 8, seed=0), [correctness_reward]
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    trainer._loss_step_units = torch.tensor([5.0, 3.0])
    old, current = [0.5, 0.1, 0.5, 0.4, 0.3], [0.55, 0.3, 0.5, 0.2, 0.3]
    advantages, segments = [1.0, 1.0, -2.0, -2.0, 0.0], [0, 0, 1, 1, 2]
    current_lp = torch.tensor(current).log()[None].requires_grad_(True)
    trainer.compute_loss(fixed_policy(current_lp), packed_inputs(old, advantages, segments)).backward()
    n = len(old)
    expected = [-min(c / o, 1.2) * a / n for c, o, a in zip(current, old, advantages, strict=True)]
    assert current_lp.grad[0].tolist() == pytest.approx(expected, rel=1e-5)


@pytest.mark.slow
def test_both_trainers_train_with_the_registered_loss(clipped_is, tmp_path, tiny_config, calculator_dataset):
    """Two optimizer steps of each trainer on the built-in model: finite losses, parameters moved, the loss's stat
    logged."""
    from helpers import MODEL, trainer_with_local_worker
    from transformers import AutoModelForCausalLM

    from trl_aspo import ASPOTrainer, AsyncASPOConfig, AsyncASPOTrainer
    from trl_aspo.builtin.task import correctness_reward

    tokenizer = calculator_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(MODEL)
    before = [parameter.detach().clone() for parameter in model.parameters()]
    sync = ASPOTrainer(
        model,
        [digit_share_reward],
        args=tiny_config(loss_type="clipped_is", epsilon_high=5.0, num_iterations=2),
        train_dataset=calculator_dataset,
        processing_class=tokenizer,
    )
    sync.train()
    moved = [not torch.equal(b, a) for b, a in zip(before, sync.model.parameters(), strict=True)]
    assert any(moved)
    logs = [log for log in sync.state.log_history if "loss" in log]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(log["loss"])) for log in logs)
    assert all("clipped_is/clipped_mean" in log for log in logs)

    args = AsyncASPOConfig(
        **async_fields(tmp_path / "async", per_device_train_batch_size=4, num_generations=2, max_steps=2),
        loss_type="clipped_is",
        epsilon_high=5.0,
    )
    asynchronous = trainer_with_local_worker(
        AsyncASPOTrainer, args, tokenizer, calculator_dataset, [correctness_reward, digit_share_reward]
    )
    asynchronous.train()
    logs = [log for log in asynchronous.state.log_history if "clipped_is/clipped_mean" in log]
    assert len(logs) == 2 and all(0.0 <= log["clipped_is/clipped_mean"] <= 1.0 for log in logs)


def test_the_registry_refuses_what_it_cannot_run(clipped_is, tmp_path):
    from trl_aspo import ASPOConfig

    with pytest.raises(ValueError, match=r"register_policy_loss\('cispo'\): 'cispo' is a TRL loss type"):
        register_policy_loss("cispo")(lambda inputs: inputs.log_probs)
    with pytest.raises(ValueError, match=r"'ppo' is a TRL loss type"):
        register_policy_loss("ppo")(lambda inputs: inputs.log_probs)
    with pytest.raises(ValueError, match=r"register_policy_loss\('clipped_is'\): .* already registered"):
        register_policy_loss("clipped_is")(lambda inputs: inputs.log_probs)
    # The config takes the registered name; an unregistered one is refused with the registered names listed.
    fields = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none")
    assert ASPOConfig(**fields, loss_type="clipped_is", num_iterations=2).loss_type == "clipped_is"
    with pytest.raises(ValueError, match=r"loss_type='clipped_iss' is invalid: must be one of \(.*'clipped_is'"):
        ASPOConfig(**fields, loss_type="clipped_iss")
    # A function returning the wrong shape is named when it runs.
    register_policy_loss("scalar_loss")(lambda inputs: inputs.log_probs.sum())
    try:
        lp = torch.zeros(2, 3)
        with pytest.raises(ValueError, match=r"policy loss 'scalar_loss' must return a per-token loss of shape"):
            get_policy_loss("scalar_loss")(PolicyLossInputs(lp, lp, torch.ones(2), torch.ones(2, 3), None))
    finally:
        unregister_policy_loss("scalar_loss")
