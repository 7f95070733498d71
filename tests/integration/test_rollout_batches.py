"""Rollout batches in AsyncASPOTrainer (issue 41): k optimizer steps per fetched batch, the proximal policy of the
decoupled objective on the optimizer-step clock (`recompute` and `loglinear`), PPO's dual clip, the diagnostics,
and the checkpoints at batch boundaries."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import (
    MODEL,
    async_fields,
    base_fields,
    calculator_tokenizer,
    fixed_policy,
    losses,
    packed_inputs,
    parameters,
    scripted_samples,
    scripted_trainer,
    trainer_with_local_worker,
)

from trl_aspo.trainers.rollout_batches import PROXIMAL_KEY, SEGMENT_STEP_KEY

# Five packed action tokens of three samples: generator, proximal and current probabilities, advantages.
OLD = [0.5, 0.1, 0.5, 0.4, 0.3]
PROXIMAL = [0.5, 0.26, 0.5, 0.3, 0.3]
CURRENT = [0.55, 0.3, 0.5, 0.2, 0.3]
ADVANTAGES = [1.0, 1.0, -2.0, -2.0, 0.5]
SEGMENTS = [0, 0, 1, 1, 2]
BOUNDS = (0.6, 1.5)


@pytest.fixture(scope="module")
def tokenizer():
    return calculator_tokenizer()


def varied_reward(completions, **kwargs):
    """A reward that differs between completions whatever their correctness, so advantages are nonzero."""
    return [(sum(map(ord, str(completion))) % 7) / 6 for completion in completions]


def _hand_trainer(tmp_path, tokenizer, **fields):
    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer
    from trl_aspo.builtin.task import correctness_reward, make_dataset

    args = AsyncASPOConfig(
        **async_fields(tmp_path, per_device_train_batch_size=4, num_generations=2),
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_min=BOUNDS[0],
        vllm_importance_sampling_clip_max=BOUNDS[1],
        steps_per_rollout_batch=2,
        **fields,
    )
    dataset = make_dataset("train", 8, seed=0)
    trainer = trainer_with_local_worker(AsyncASPOTrainer, args, tokenizer, dataset, [correctness_reward])
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def _gradient(trainer, inputs) -> list[float]:
    current = torch.tensor(CURRENT).log()[None].requires_grad_(True)
    trainer.compute_loss(fixed_policy(current), inputs).backward()
    return current.grad[0].tolist()


def _ppo_weight(ratio: float, advantage: float) -> float:
    """d(-min(rA, clip(r)A))/d lp / (-A): r where the clip does not bind (eps 0.2), else 0."""
    clipped = (advantage > 0 and ratio > 1.2) or (advantage < 0 and ratio < 0.8)
    return 0.0 if clipped else ratio


def _expected(proximal: list[float]) -> list[float]:
    """-w_is * A * w_ppo(pi_theta / pi_prox) / 5 per token, w_is = clamp(pi_prox / pi_b, 0.6, 1.5)."""
    grads = []
    for old, prox, current, advantage in zip(OLD, proximal, CURRENT, ADVANTAGES, strict=True):
        correction = min(max(prox / old, BOUNDS[0]), BOUNDS[1])
        grads.append(-correction * advantage * _ppo_weight(current / prox, advantage) / 5)
    return grads


def test_a_two_step_batch_by_hand_recompute(tmp_path, tokenizer):
    """Step 0: the ratio against the step's own forward is 1. Step 1: exp(lp_theta - lp_prox) with the recorded
    lp_prox (token 3: r = 0.2/0.3 < 0.8 with A < 0, clipped), and the proximal diagnostics, also under
    `_later_steps`."""
    trainer = _hand_trainer(tmp_path, tokenizer)
    inputs = packed_inputs(OLD, ADVANTAGES, SEGMENTS)
    trainer._batch_start_step, trainer._step_in_batch = 4, 0
    assert _gradient(trainer, inputs) == pytest.approx(_expected(CURRENT), rel=1e-5, abs=1e-8)
    metrics = trainer._metrics["train"]
    assert metrics["offpolicy/proximal_log_ratio_abs_mean"][-1] == (0.0, 5.0)
    assert "ppo/clip_frac_later_steps" not in metrics

    metrics.clear()
    inputs[PROXIMAL_KEY] = torch.tensor(PROXIMAL).log()[None]
    trainer._step_in_batch = 1
    assert _gradient(trainer, inputs) == pytest.approx(_expected(PROXIMAL), rel=1e-5, abs=1e-8)
    log_ratios = [math.log(c / p) for c, p in zip(CURRENT, PROXIMAL, strict=True)]
    for name in ("offpolicy/proximal_log_ratio_abs_mean", "offpolicy/proximal_log_ratio_abs_mean_later_steps"):
        numerator, tokens = metrics[name][-1]
        assert (numerator / tokens) == pytest.approx(sum(abs(x) for x in log_ratios) / 5, rel=1e-6)
    assert metrics["ppo/clip_frac"][-1] == pytest.approx((1.0, 5.0))
    assert metrics["ppo/approx_kl"][-1][0] == pytest.approx(-sum(log_ratios), rel=1e-6)


def test_a_two_step_batch_by_hand_loglinear(tmp_path, tokenizer):
    """Batch start s_prox = 4, step j = 1; the three samples' versions were published at steps 4, 2 and 0: alpha
    = 0, 2/3 and 4/5, log pi_prox = lp_b + alpha (lp_theta - lp_b); at j = 0 alpha is 1 for all (the step's own
    log-probs)."""
    trainer = _hand_trainer(tmp_path, tokenizer, proximal_policy="loglinear")
    inputs = packed_inputs(OLD, ADVANTAGES, SEGMENTS)
    inputs[SEGMENT_STEP_KEY] = torch.tensor([[4, 2, 0]])
    trainer._batch_start_step, trainer._step_in_batch = 4, 0
    assert _gradient(trainer, inputs) == pytest.approx(_expected(CURRENT), rel=1e-5, abs=1e-8)
    assert trainer._metrics["train"]["offpolicy/proximal_alpha_mean"][-1] == pytest.approx((5.0, 5.0))

    trainer._metrics["train"].clear()
    trainer._step_in_batch = 1
    alpha = [0.0, 2 / 3, 4 / 5]
    proximal = [
        math.exp(math.log(old) + alpha[sample] * (math.log(current) - math.log(old)))
        for old, current, sample in zip(OLD, CURRENT, SEGMENTS, strict=True)
    ]
    assert _gradient(trainer, inputs) == pytest.approx(_expected(proximal), rel=1e-5, abs=1e-8)
    tokens_alpha = sum(alpha[sample] for sample in SEGMENTS)
    assert trainer._metrics["train"]["offpolicy/proximal_alpha_mean"][-1] == pytest.approx((tokens_alpha, 5.0))


def test_the_dual_clip_acts_on_the_surrogate_before_the_correction_weight(tmp_path, tokenizer):
    """c = 2 at step j = 1 with pi_prox = 0.08 on token 3 (A = -2): r = 2.5, so the surrogate -A r = 5 is capped at
    -c A = 4: no gradient there, the others as PPO's, each times w_is; `ppo/dual_clip_frac` = 1/5 (over all action
    tokens)."""
    trainer = _hand_trainer(tmp_path, tokenizer, ppo_dual_clip=2.0)
    proximal = [0.5, 0.26, 0.5, 0.08, 0.3]
    inputs = packed_inputs(OLD, ADVANTAGES, SEGMENTS)
    inputs[PROXIMAL_KEY] = torch.tensor(proximal).log()[None]
    trainer._batch_start_step, trainer._step_in_batch = 0, 1
    expected = _expected(proximal)
    expected[3] = 0.0
    assert _gradient(trainer, inputs) == pytest.approx(expected, rel=1e-5, abs=1e-8)
    assert trainer._metrics["train"]["ppo/dual_clip_frac"][-1] == pytest.approx((1.0, 5.0))
    assert trainer._metrics["train"]["ppo/dual_clip_frac_later_steps"][-1] == pytest.approx((1.0, 5.0))


def _real_run(tmp_path, tokenizer, **fields):
    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer
    from trl_aspo.builtin.task import make_dataset

    args = AsyncASPOConfig(
        **async_fields(
            tmp_path,
            per_device_train_batch_size=4,
            num_generations=2,
            max_steps=4,
            logging_steps=1,
            lr_scheduler_type="constant",
            learning_rate=fields.pop("learning_rate", 3e-3),
        ),
        loss_type="aspo",
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_max=2.0,
        steps_per_rollout_batch=2,
        **fields,
    )
    dataset = make_dataset("train", 8, seed=0)
    trainer = trainer_with_local_worker(AsyncASPOTrainer, args, tokenizer, dataset, [varied_reward])
    advantages = []
    compute_loss = trainer.compute_loss

    def recording_compute_loss(model, inputs, *args, **kwargs):
        advantages.append(inputs["advantages"][inputs["token_index"] >= 0].abs().sum().item())
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = recording_compute_loss
    trainer.train()
    assert all(total > 0 for total in advantages)
    return [log for log in trainer.state.log_history if "loss" in log]


@pytest.mark.slow
@pytest.mark.parametrize("proximal_policy", ["recompute", "loglinear"])
@pytest.mark.parametrize("weight_sync_steps", [1, 2])
def test_the_proximal_ratio_moves_only_after_a_batchs_first_step(
    tmp_path, tokenizer, proximal_policy, weight_sync_steps
):
    """k = 2, constant lr, nonzero advantages: |log pi_theta / pi_prox| is exactly 0 on every j = 0 step and > 0 on
    every j = 1 step, where the flip and the clips act on it (flip weight away from 1)."""
    logs = _real_run(tmp_path, tokenizer, proximal_policy=proximal_policy, weight_sync_steps=weight_sync_steps)
    assert [log["step"] for log in logs] == [1, 2, 3, 4]
    for log in logs:
        moved = log["offpolicy/proximal_log_ratio_abs_mean"]
        if log["step"] % 2 == 1:  # j = 0
            assert moved == 0.0 and "offpolicy/proximal_log_ratio_abs_mean_later_steps" not in log
        else:
            assert moved > 1e-3 and log["offpolicy/proximal_log_ratio_abs_mean_later_steps"] == moved
            assert math.isfinite(log["ppo/approx_kl_later_steps"])
    later = [log for log in logs if log["step"] % 2 == 0 and "aspo/flip_weight_mean" in log]
    assert any(log["aspo/flip_weight_mean"] != 1.0 for log in later)


@pytest.mark.slow
def test_recompute_at_learning_rate_zero_has_ratio_one_on_every_step(tmp_path, tokenizer):
    """The recorded forward is the training forward: with no update the proximal ratio is 1 within 1e-6."""
    logs = _real_run(tmp_path, tokenizer, learning_rate=0.0)
    assert len(logs) == 4
    assert all(log["offpolicy/proximal_log_ratio_abs_mean"] < 1e-6 for log in logs)


def _scripted(tmp_path, tokenizer, samples, max_steps, saves=False, **fields):
    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer

    checkpoints = {"save_strategy": "steps", "save_steps": 2} if saves else {}
    args = AsyncASPOConfig(
        **base_fields(tmp_path, max_steps=max_steps, logging_steps=1, lr_scheduler_type="constant", **checkpoints),
        loss_type="aspo",
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_max=2.0,
        **fields,
    )
    return scripted_trainer(AsyncASPOTrainer, args, tokenizer, samples)


@pytest.mark.slow
def test_one_step_per_batch_is_the_proximal_choice_free_decoupled_run(tmp_path, tokenizer):
    """k = 1: `loglinear` and `recompute` are the same run (the proximal policy is the step's own log-probs), and a
    k = 2 run's first step is the k = 1 run's."""
    samples = scripted_samples(tokenizer, [index // 4 for index in range(24)])
    runs = {}
    for label, fields in {
        "recompute": {},
        "loglinear": {"proximal_policy": "loglinear"},
        "k2": {"steps_per_rollout_batch": 2},
    }.items():
        trainer = _scripted(tmp_path / label, tokenizer, samples, 2, **fields)
        trainer.train()
        runs[label] = (losses(trainer), parameters(trainer.model))
    assert runs["loglinear"][0] == runs["recompute"][0]
    for name, value in runs["recompute"][1].items():
        assert torch.equal(runs["loglinear"][1][name], value), name
    assert runs["k2"][0][0] == runs["recompute"][0][0] and runs["k2"][0][1] != runs["recompute"][0][1]


@pytest.mark.slow
def test_a_resume_from_a_batch_boundary_equals_the_uninterrupted_run(tmp_path, tokenizer):
    """k = 2, four steps, a checkpoint at step 2 (a boundary): resumed there on the rest of the stream, the run ends
    with the uninterrupted run's parameters and losses."""
    samples = scripted_samples(tokenizer, [index // 4 for index in range(24)])
    whole = _scripted(tmp_path / "whole", tokenizer, samples, 4, saves=True, steps_per_rollout_batch=2)
    whole.train()
    checkpoint = tmp_path / "whole" / "out" / "checkpoint-2"
    assert (checkpoint / "rollout_batches.json").is_file()
    resumed = _scripted(tmp_path / "whole", tokenizer, samples[8:], 4, saves=True, steps_per_rollout_batch=2)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert losses(resumed)[-2:] == losses(whole)[-2:]
    whole_parameters = parameters(whole.model)
    for name, value in parameters(resumed.model).items():
        assert torch.equal(value, whole_parameters[name]), name


def test_an_automatic_max_inflight_tasks_scales_with_the_batch(tmp_path, tokenizer):
    """TRL's automatic size is max_staleness x samples per step; with k steps per rollout batch it is k times that,
    in the trainer (TRL's worker reads it) and in the local worker."""
    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer
    from trl_aspo.builtin.task import correctness_reward, make_dataset
    from trl_aspo.infra import LocalRolloutWorker

    fields = base_fields(tmp_path, max_inflight_tasks=-1, max_staleness=3, steps_per_rollout_batch=2)
    trainer = scripted_trainer(AsyncASPOTrainer, AsyncASPOConfig(**fields), tokenizer, [])
    assert trainer.args.max_inflight_tasks == 3 * 4 * 2
    local = LocalRolloutWorker(
        MODEL, tokenizer, make_dataset("train", 4, seed=0), [correctness_reward], AsyncASPOConfig(**fields)
    )
    assert local._loop_kwargs["max_inflight_tasks"] == 3 * 4 * 2
