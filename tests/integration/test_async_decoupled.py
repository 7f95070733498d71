"""The decoupled objective in AsyncASPOTrainer (issue 30): the ratio against the trainer's own log-probs at the step,
each token's loss weighted by the rollout correction c = f(pi_prox / pi_generator), with TRL's PPO loss and a
registered loss, in each of TRL's four modes; its diagnostics; a ratio of 1 at zero drift."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import async_fields, calculator_tokenizer, fixed_policy, packed_inputs, trainer_with_local_worker

# Five packed action tokens of three samples: generator probabilities, the trainer's current ones, advantages.
OLD = [0.5, 0.1, 0.5, 0.4, 0.3]
CURRENT = [0.55, 0.3, 0.5, 0.2, 0.3]
ADVANTAGES = [1.0, 1.0, -2.0, -2.0, 0.5]
SEGMENTS = [0, 0, 1, 1, 2]
BOUNDS = (0.6, 1.5)  # rho = 1.1, 3, 1, 0.5, 1: token 2 above, token 4 below


def _unclipped(level: str) -> list[float]:
    """rho per token, or per sample (the product of its tokens' rho) at every token of it."""
    rho = [c / o for c, o in zip(CURRENT, OLD, strict=True)]
    if level == "sequence":
        per_sample = {s: math.prod(r for r, t in zip(rho, SEGMENTS, strict=True) if t == s) for s in set(SEGMENTS)}
        rho = [per_sample[s] for s in SEGMENTS]
    return rho


def _expected_weights(mode: str) -> list[float]:
    """c per token, by hand: `_unclipped` truncated or masked to the bounds."""
    rho = _unclipped(mode.split("_")[0])
    low, high = BOUNDS
    if mode.endswith("truncate"):
        return [min(max(r, low), high) for r in rho]
    return [r if low <= r <= high else 0.0 for r in rho]


@pytest.fixture(scope="module")
def tokenizer():
    return calculator_tokenizer()


def _trainer(tmp_path, tokenizer, processed_logprobs=False, **fields):
    """AsyncASPOTrainer with the local worker (reporting the processed distribution's log-probs if asked)."""
    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer
    from trl_aspo.builtin.task import correctness_reward, make_dataset

    args = AsyncASPOConfig(
        **async_fields(tmp_path, **{"per_device_train_batch_size": 4, "num_generations": 2, **fields})
    )
    dataset = make_dataset("train", 8, seed=0)
    return trainer_with_local_worker(
        AsyncASPOTrainer, args, tokenizer, dataset, [correctness_reward], processed_logprobs=processed_logprobs
    )


@pytest.mark.parametrize("loss_type", ["ppo", "aspo"])
def test_the_decoupled_gradient_by_hand_in_each_mode(tmp_path, tokenizer, loss_type):
    """One micro-batch of the step: d loss / d lp = -c * A * w(r = 1) / 5 with w = 1 for both losses (a single pass:
    the ratio against pi_prox is 1, where PPO's clip and the flip leave the weight 1), and the diagnostics."""
    trainer = _trainer(
        tmp_path,
        tokenizer,
        loss_type=loss_type,
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_clip_min=BOUNDS[0],
        vllm_importance_sampling_clip_max=BOUNDS[1],
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    trainer._loss_step_units = torch.tensor([5.0, 3.0])
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        trainer.args.vllm_importance_sampling_mode = mode
        trainer._metrics["train"].clear()
        current = torch.tensor(CURRENT).log()[None].requires_grad_(True)
        trainer.compute_loss(fixed_policy(current), packed_inputs(OLD, ADVANTAGES, SEGMENTS)).backward()
        weights = _expected_weights(mode)
        expected = [-c * a / 5 for c, a in zip(weights, ADVANTAGES, strict=True)]
        assert current.grad[0].tolist() == pytest.approx(expected, rel=1e-5, abs=1e-8), mode
        metrics = {name: values[-1] for name, values in trainer._metrics["train"].items() if "offpolicy" in name}
        changed = [not BOUNDS[0] <= r <= BOUNDS[1] for r in _unclipped(mode.split("_")[0])]
        assert metrics["offpolicy/is_weight_mean"] == pytest.approx(sum(weights) / 5, rel=1e-5), mode
        assert metrics["offpolicy/ess"] == pytest.approx(sum(weights) ** 2 / (5 * sum(w * w for w in weights)))
        positive = [i for i, a in enumerate(ADVANTAGES) if a > 0]
        assert metrics["offpolicy/clipped_frac_pos"] == pytest.approx(sum(changed[i] for i in positive) / 3), mode
        log_rho = [abs(math.log(c / o)) for c, o in zip(CURRENT, OLD, strict=True)]
        assert metrics["offpolicy/log_ratio_abs_mean"] == pytest.approx(sum(log_rho) / 5, rel=1e-5)


def test_without_the_switch_the_ratio_is_against_the_generator(tmp_path, tokenizer):
    """Bypass (the default): TRL's loss on pi_theta / pi_generator; r = 3 on token 2 is clipped (no gradient)."""
    trainer = _trainer(tmp_path, tokenizer)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    current = torch.tensor(CURRENT).log()[None].requires_grad_(True)
    trainer.compute_loss(fixed_policy(current), packed_inputs(OLD, ADVANTAGES, SEGMENTS)).backward()
    rho = _unclipped("token")
    weights = [
        r if (a > 0 and r <= 1.2) or (a < 0 and r >= 0.8) or a == 0 else 0.0
        for r, a in zip(rho, ADVANTAGES, strict=True)
    ]
    assert current.grad[0].tolist() == pytest.approx(
        [-w * a / 5 for w, a in zip(weights, ADVANTAGES, strict=True)], rel=1e-5
    )
    assert not any("offpolicy/is_weight" in name for name in trainer._metrics["train"])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("loss_type", "mode"),
    [
        ("aspo", "token_truncate"),
        ("aspo", "token_mask"),
        ("aspo", "sequence_truncate"),
        ("aspo", "sequence_mask"),
        ("ppo", "token_truncate"),
    ],
)
def test_training_runs_in_each_mode(tmp_path, tokenizer, loss_type, mode):
    """Three optimizer steps with the local worker (jitter, so samples arrive stale): finite losses, parameters moved,
    every diagnostic logged per step, and the staleness under its cross-framework name."""
    trainer = _trainer(
        tmp_path,
        tokenizer,
        loss_type=loss_type,
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=0.5,
        vllm_importance_sampling_clip_max=2.0,
    )
    before = [parameter.detach().clone() for parameter in trainer.model.parameters()]
    trainer.train()
    assert any(not torch.equal(b, a) for b, a in zip(before, trainer.model.parameters(), strict=True))
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == trainer.args.max_steps
    for log in logs:
        assert math.isfinite(log["loss"])
        for name in ("is_weight_mean", "ess", "log_ratio_abs_mean", "staleness_mean", "staleness_max"):
            assert math.isfinite(log[f"offpolicy/{name}"]), name
        assert 0.0 < log["offpolicy/ess"] <= 1.0 + 1e-9


@pytest.mark.slow
def test_the_ratio_at_zero_drift_is_one_and_processed_log_probs_are_refused(tmp_path, tokenizer):
    """The first step's samples come from the starting weights, which the trainer still holds. The local worker
    sampling at top-p 0.9 and top-k 20 reports full-softmax log-probs: every token's |log rho| is float rounding (the
    trainer's packed forward against the worker's). Reporting the processed distribution's log-probs, as vLLM behind
    TRL's worker does, is refused naming both fields, and when accepted on purpose the mismatch shows."""
    sampling = {"top_p": 0.9, "top_k": 20, "max_steps": 1, "max_staleness": 0}
    with pytest.raises(ValueError, match=r"AsyncASPOConfig\.top_p=0\.9 is invalid: .*top_p=0\.9, top_k=20"):
        _trainer(tmp_path / "refused", tokenizer, True, vllm_importance_sampling_correction=True, **sampling)

    mismatch = {}
    for label, processed in (("full softmax", False), ("processed", True)):
        trainer = _trainer(
            tmp_path / label.replace(" ", ""),
            tokenizer,
            processed,
            vllm_importance_sampling_correction=True,
            allow_processed_sampling_logprobs=processed,
            **sampling,
        )
        trainer.train()
        (log,) = [log for log in trainer.state.log_history if "loss" in log]
        assert log["offpolicy/staleness_max"] == 0.0
        mismatch[label] = log["offpolicy/log_ratio_abs_mean"]
    assert mismatch["full softmax"] < 1e-4
    assert mismatch["processed"] > 100 * max(mismatch["full softmax"], 1e-6)
