"""Issue 17 item 3: the Archer2.0 recipes match the reference scripts where TRL can (per-sequence aggregation, warmup
over 10 rollouts stepped once per rollout, 10 epochs, no vLLM IS correction, verl's clamped k3 KL), with the two
options that needed: `lr_schedule_per_generation` and `kl_clamp`."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import get_scheduler

from trl_aspo import ASPOTrainer
from trl_aspo.algorithms.kl import k3_kl
from trl_aspo.algorithms.lr_schedule import per_generation_lr_lambda
from trl_aspo.builtin import build_random_model
from trl_aspo.cli.train import make_parser

RECIPES = ["configs/archer2_math.yaml", "configs/archer2_code.yaml"]


def parse_recipe(path):
    # bf16 and vLLM are GPU settings: override them so the configuration validates on a CPU machine.
    _, training, _, _ = make_parser().parse_args_and_config(
        args=["--config", path, "--bf16", "false", "--use_cpu", "true", "--use_vllm", "false"]
    )
    return training


def stepped_learning_rates(lr_lambda, base_lr: float, steps: int) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base_lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    rates = []
    for _ in range(steps):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize("path", RECIPES)
def test_recipes_carry_the_reference_values(path):
    training = parse_recipe(path)
    assert training.aspo_aggregation == "sequence"  # verl token-mean over micro-batches of 1 completion
    assert training.per_device_train_batch_size == 1 and training.gradient_accumulation_steps == 32
    assert training.num_train_epochs == 10  # trainer.total_epochs=10
    assert training.vllm_importance_sampling_correction is False
    assert training.kl_clamp == 10.0 and training.beta == 0.001
    assert training.lr_schedule_per_generation and training.optimizer_steps_per_generation() == 12
    assert training.warmup_steps == 120  # lr_warmup_steps=10 rollouts x 12 optimizer steps


@pytest.mark.parametrize("path", RECIPES)
def test_recipe_learning_rate_per_optimizer_step_is_the_references(path):
    """verl: rollout k < 10 runs all its 12 optimizer steps at k/10 x 1e-6 (0 for all of rollout 0), full from
    optimizer step 120 (rollout 10) on."""
    training = parse_recipe(path)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=training.learning_rate)
    trl_lambda = get_scheduler(
        training.lr_scheduler_type, optimizer, num_warmup_steps=training.warmup_steps, num_training_steps=1000
    ).lr_lambdas[0]
    stepped = per_generation_lr_lambda(trl_lambda, int(training.optimizer_steps_per_generation()))
    rates = stepped_learning_rates(stepped, training.learning_rate, 132)
    expected = [min(step // 12, 10) / 10 * 1e-6 for step in range(132)]
    assert rates == pytest.approx(expected, abs=1e-15)
    assert rates[:12] == [0.0] * 12 and rates[12] == pytest.approx(1e-7) and rates[119] == pytest.approx(9e-7)
    assert rates[120] == pytest.approx(1e-6)
    # Without the option TRL would step it per optimizer step: 1/120 x 1e-6 already at step 1.
    assert stepped_learning_rates(trl_lambda, 1e-6, 2)[1] == pytest.approx(1e-6 / 120)


def test_trainer_steps_its_schedule_once_per_generation_round(tiny_tokenizer, calculator_dataset, tiny_config):
    """2 optimizer steps per round (steps_per_generation=2, one accumulation step), warmup over 4 steps: the
    multipliers by hand are 0, 0, 0.5, 0.5, 1, 1 (TRL's per-step warmup: 0, 0.25, 0.5, 0.75, 1, 1)."""
    rates = {}
    for per_generation in (True, False):
        config = tiny_config(
            lr_scheduler_type="constant_with_warmup",
            warmup_steps=4,
            steps_per_generation=2,
            gradient_accumulation_steps=1,
            lr_schedule_per_generation=per_generation,
        )
        trainer = ASPOTrainer(
            model=build_random_model(tiny_tokenizer, seed=0),
            reward_funcs=[lambda completions, **kwargs: [0.0] * len(completions)],
            args=config,
            train_dataset=calculator_dataset,
            processing_class=tiny_tokenizer,
        )
        trainer.create_optimizer_and_scheduler(num_training_steps=6)
        trainer.create_scheduler(6, trainer.optimizer)  # a second call must not change the rounding
        rates[per_generation] = stepped_learning_rates(trainer.lr_scheduler.lr_lambdas[0], 1e-3, 6)
    assert rates[True] == pytest.approx([0.0, 0.0, 5e-4, 5e-4, 1e-3, 1e-3])
    assert rates[False] == pytest.approx([0.0, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])


def test_k3_kl_clamp_by_hand():
    """r = log pi_ref - log pi; k3 = e^r - r - 1; verl clamps r to [-20, 20] and k3 to [-10, 10]."""
    logps = torch.zeros(5)
    ref = torch.tensor([0.0, 1.0, 3.0, -12.0, 30.0])
    unclamped = [0.0, math.e - 2, math.exp(3) - 4, math.exp(-12) + 11, math.exp(30) - 31]
    torch.testing.assert_close(k3_kl(ref, logps), torch.tensor(unclamped))
    torch.testing.assert_close(k3_kl(ref, logps, clamp=10.0), torch.tensor([0.0, math.e - 2, 10.0, 10.0, 10.0]))
    # TRL's expression is what clamp=None computes.
    trl = torch.exp(ref - logps) - (ref - logps) - 1
    assert torch.equal(k3_kl(ref, logps), trl)
    # A log-ratio of 100 overflows exp in float32; clamped, the term is 10 with a zero (not NaN) gradient.
    policy = torch.zeros(1, requires_grad=True)
    k3_kl(torch.tensor([100.0]), policy, clamp=10.0).sum().backward()
    assert policy.grad.tolist() == [0.0]
    assert torch.isinf(k3_kl(torch.tensor([100.0]), torch.zeros(1)))


@pytest.mark.slow
@pytest.mark.parametrize("clamp", [None, 1e-9])
def test_trainer_kl_term_is_the_clamped_k3(
    tiny_tokenizer, calculator_dataset, tiny_config, monkeypatch, tmp_path, clamp
):
    """The aspo loss's per-token KL is k3 clamped to [-kl_clamp, kl_clamp] (by hand), or TRL's k3 without it. The
    second step's policy has moved from the reference, so a 1e-9 clamp binds."""
    from dense_reward import digit_share_reward

    import trl_aspo.trainers.loss_assembly as trainer_module

    calls = []

    def recording_k3_kl(ref_logps, logps, kl_clamp=None):
        out = k3_kl(ref_logps, logps, kl_clamp)
        calls.append((ref_logps.detach(), logps.detach(), kl_clamp, out.detach()))
        return out

    monkeypatch.setattr(trainer_module, "k3_kl", recording_k3_kl)
    config = tiny_config(loss_type="aspo", beta=0.1, kl_clamp=clamp, num_iterations=2)
    build_random_model(tiny_tokenizer, seed=0).save_pretrained(tmp_path / "policy")  # TRL loads the reference from it
    ASPOTrainer(
        model=str(tmp_path / "policy"),
        reward_funcs=[digit_share_reward],
        args=config,
        train_dataset=calculator_dataset,
        processing_class=tiny_tokenizer,
    ).train()
    assert calls
    for ref, logps, kl_clamp, out in calls:
        assert kl_clamp == clamp
        log_ratio = ref - logps
        k3 = torch.exp(log_ratio) - log_ratio - 1  # TRL's expression
        torch.testing.assert_close(out, k3 if clamp is None else k3.clamp(-clamp, clamp), rtol=0, atol=0)
    if clamp is not None:
        ref, logps, _, out = calls[-1]
        assert bool((torch.exp(ref - logps) - (ref - logps) - 1 > clamp).any())  # the clamp bound somewhere
