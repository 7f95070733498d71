"""Issue 17 item 3: the Archer2.0 recipes match the reference scripts where TRL can (per-sequence aggregation, warmup
over 10 rollouts stepped once per rollout, 10 epochs, no vLLM IS correction, verl's clamped k3 KL), with the two
options that needed: `lr_schedule_per_generation` and `kl_clamp` (in the trainer:
tests/integration/test_reference_recipe_trainer.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers import stepped_learning_rates
from transformers import get_scheduler

from trl_aspo.algorithms.kl import k3_kl
from trl_aspo.algorithms.lr_schedule import per_generation_lr_lambda
from trl_aspo.cli.parsers import make_parser

RECIPES = ["configs/archer2_math.yaml", "configs/archer2_code.yaml"]


def parse_recipe(path):
    # bf16 and vLLM are GPU settings: override them so the configuration validates on a CPU machine.
    _, training, _, _ = make_parser().parse_args_and_config(
        args=["--config", path, "--bf16", "false", "--use_cpu", "true", "--use_vllm", "false"]
    )
    return training


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


@pytest.mark.parametrize("path", RECIPES)
def test_recipes_skip_non_finite_steps_and_name_their_last_differences(path):
    """verl skips an optimizer step whose gradient norm is not finite (dp_actor.py); the recipe does too, and its
    comments name the differences TRL cannot express (issue 25, item 16)."""
    assert parse_recipe(path).skip_nonfinite_grad_steps is True
    text = Path(path).read_text()
    for difference in ("partial groups", "2,048 tokens", "std + 1e-4", "skip_nonfinite_grad_steps false"):
        assert difference in text, difference
