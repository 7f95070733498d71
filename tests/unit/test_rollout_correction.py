"""The rollout correction weight of the decoupled objective (trl_aspo.algorithms.rollout_correction) against hand
computations, for each mode at token and sequence level, at and beyond its bounds; and its diagnostics."""

from __future__ import annotations

import math

import pytest
import torch

from trl_aspo.algorithms.rollout_correction import (
    CORRECTION_SUM_NAMES,
    correction_metrics,
    correction_sums,
    rollout_correction_weight,
)

# Two completions: the first with three action tokens, the second with two and one padding position. Token ratios
# rho_t = pi_prox / pi_b chosen by hand: 0.4, 1.0, 2.5 and 1.5, 0.9 (padding: 7.0, which no mode may read).
RHO = [[0.4, 1.0, 2.5], [1.5, 0.9, 7.0]]
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
BEHAVIOUR = torch.log(torch.tensor([[0.5, 0.2, 0.1], [0.3, 0.6, 0.1]]))
PROXIMAL = BEHAVIOUR + torch.log(torch.tensor(RHO))
# Sequence ratios: the products over action tokens, 0.4 * 1 * 2.5 = 1.0 and 1.5 * 0.9 = 1.35.


def _weight(mode, clip_min, clip_max):
    weight, changed, log_ratio = rollout_correction_weight(PROXIMAL, BEHAVIOUR, MASK, mode, clip_min, clip_max)
    return weight * MASK, changed, log_ratio


@pytest.mark.parametrize(
    ("mode", "clip_min", "clip_max", "expected", "changed"),
    [
        # Truncate: clamp each token ratio to [0.5, 2] (0.4 -> 0.5, 2.5 -> 2).
        ("token_truncate", 0.5, 2.0, [[0.5, 1.0, 2.0], [1.5, 0.9, 0.0]], [[1, 0, 1], [0, 0, 0]]),
        # Upper bound only (the SPO++ recipe's 2): 0.4 stays.
        ("token_truncate", None, 2.0, [[0.4, 1.0, 2.0], [1.5, 0.9, 0.0]], [[0, 0, 1], [0, 0, 0]]),
        # Mask: 0 outside [0.5, 2]; a ratio on a bound is kept (IcePop with both bounds).
        ("token_mask", 0.5, 2.0, [[0.0, 1.0, 0.0], [1.5, 0.9, 0.0]], [[1, 0, 1], [0, 0, 0]]),
        # The ratio 1.0 (exact in floating point) on the lower bound is kept.
        ("token_mask", 1.0, 2.0, [[0.0, 1.0, 0.0], [1.5, 0.0, 0.0]], [[1, 0, 1], [0, 1, 0]]),
        # Sequence: one ratio per completion, 1.0 and 1.35, truncated to [0.5, 1.2] or masked outside it.
        ("sequence_truncate", 0.5, 1.2, [[1.0, 1.0, 1.0], [1.2, 1.2, 0.0]], [[0, 0, 0], [1, 1, 0]]),
        ("sequence_mask", 0.5, 1.2, [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]], [[0, 0, 0], [1, 1, 0]]),
        ("sequence_mask", 1.1, None, [[0.0, 0.0, 0.0], [1.35, 1.35, 0.0]], [[1, 1, 1], [0, 0, 0]]),
    ],
)
def test_each_mode_by_hand(mode, clip_min, clip_max, expected, changed):
    weight, was_changed, log_ratio = _weight(mode, clip_min, clip_max)
    assert weight.tolist() == [pytest.approx(row, rel=1e-5) for row in expected]
    assert was_changed.int().tolist() == changed
    assert log_ratio.tolist() == [
        pytest.approx([math.log(r) for r in RHO[0]], abs=1e-6),
        pytest.approx([math.log(1.5), math.log(0.9), 0.0], abs=1e-6),
    ]


def test_a_missing_behaviour_log_prob_is_ratio_one_and_the_weight_has_no_gradient():
    proximal = PROXIMAL.clone().requires_grad_()
    behaviour = BEHAVIOUR.clone()
    behaviour[0, 0] = float("nan")
    weight, _, _ = rollout_correction_weight(proximal, behaviour, MASK, "token_truncate", None, 3.0)
    assert weight[0, 0].item() == 1.0
    assert not weight.requires_grad


def test_huge_log_ratios_stay_finite():
    proximal = torch.zeros(1, 2)
    behaviour = torch.tensor([[-500.0, 500.0]])
    weight, _, _ = rollout_correction_weight(proximal, behaviour, torch.ones(1, 2), "sequence_truncate", None, 2.0)
    assert weight.tolist() == [[1.0, 1.0]]  # exp(0): the two cancel in the sum
    weight, _, _ = rollout_correction_weight(proximal, behaviour, torch.ones(1, 2), "token_mask", None, 2.0)
    assert weight.tolist() == [[0.0, pytest.approx(math.exp(-20.0))]]  # clamped to [-20, 20], never inf or NaN


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (("token_cap", None, 2.0), r"`mode` must be one of"),
        (("token_mask", 3.0, 2.0), r"`clip_min` \(3.0\) must not exceed `clip_max` \(2.0\)"),
    ],
)
def test_bad_arguments_are_named(arguments, message):
    with pytest.raises(ValueError, match=message):
        rollout_correction_weight(PROXIMAL, BEHAVIOUR, MASK, *arguments)


def test_diagnostics_by_hand():
    """token_truncate [0.5, 2]: weights 0.5, 1, 2 | 1.5, 0.9 with A = +1 on the first completion, -1 on the second.
    Mean 5.9 / 5; ESS (5.9)^2 / (5 * (0.25 + 1 + 4 + 2.25 + 0.81)); clipped: 2 of 3 positive tokens, 0 of 2
    negative; mean |log rho| over the five action tokens."""
    weight, changed, log_ratio = rollout_correction_weight(PROXIMAL, BEHAVIOUR, MASK, "token_truncate", 0.5, 2.0)
    sums = correction_sums(weight, changed, log_ratio, torch.tensor([1.0, -1.0]), MASK)
    assert dict(zip(CORRECTION_SUM_NAMES, sums.tolist(), strict=True)) == pytest.approx(
        {
            "weight": 5.9,
            "weight_squared": 8.31,
            "tokens": 5,
            "positive_tokens": 3,
            "negative_tokens": 2,
            "changed_positive": 2,
            "changed_negative": 0,
            "abs_log_ratio": sum(abs(math.log(r)) for r in [0.4, 1.0, 2.5, 1.5, 0.9]),
        },
        rel=1e-5,
    )
    metrics = correction_metrics(sums.tolist())
    assert metrics == pytest.approx(
        {
            "offpolicy/is_weight_mean": 5.9 / 5,
            "offpolicy/ess": 5.9**2 / (5 * 8.31),
            "offpolicy/clipped_frac_pos": 2 / 3,
            "offpolicy/clipped_frac_neg": 0.0,
            "offpolicy/log_ratio_abs_mean": sum(abs(math.log(r)) for r in [0.4, 1.0, 2.5, 1.5, 0.9]) / 5,
        },
        rel=1e-5,
    )
    # Sums add over micro-batches and ranks; no action token logs nothing.
    assert correction_metrics([0.0] * len(CORRECTION_SUM_NAMES)) == {}


def test_the_synchronous_trainer_logs_trls_correction_as_the_same_diagnostics():
    """ASPOTrainer reads TRL's vLLM IS weight of a round (here token_truncate to at most 2, TRL's clip_min None) and
    logs it under the asynchronous trainer's `offpolicy/*` names, by the sign of the round's final advantages."""
    import types
    from collections import defaultdict

    from trl_aspo import ASPOTrainer

    trl_weight = torch.tensor([[0.4, 1.0, 2.0], [1.5, 0.9, 2.0]])  # TRL's clamp(rho, max=2), padding included
    trainer = types.SimpleNamespace(
        accelerator=types.SimpleNamespace(reduce=lambda tensor, reduction: tensor, device="cpu"),
        args=types.SimpleNamespace(vllm_importance_sampling_clip_min=None, vllm_importance_sampling_clip_max=2.0),
        vllm_importance_sampling_mode="token_truncate",
        _metrics={"train": defaultdict(list)},
    )
    output = {
        "completion_mask": MASK,
        "old_per_token_logps": PROXIMAL,
        "sampling_per_token_logps": BEHAVIOUR,
        "importance_sampling_ratio": trl_weight,
        "advantages": torch.tensor([1.0, -1.0]),
    }
    ASPOTrainer._log_rollout_correction(trainer, output)
    metrics = {name: values for name, values in trainer._metrics["train"].items()}
    weights = [0.4, 1.0, 2.0, 1.5, 0.9]
    assert metrics["offpolicy/is_weight_mean"] == [pytest.approx(sum(weights) / 5)]
    assert metrics["offpolicy/ess"] == [pytest.approx(sum(weights) ** 2 / (5 * sum(w * w for w in weights)))]
    assert metrics["offpolicy/clipped_frac_pos"] == [pytest.approx(1 / 3)]  # 2.5 truncated to 2
    assert metrics["offpolicy/clipped_frac_neg"] == [0.0]
    # Without TRL's correction (no weight in the round) nothing is logged.
    trainer._metrics["train"].clear()
    ASPOTrainer._log_rollout_correction(
        trainer, {key: v for key, v in output.items() if key != "importance_sampling_ratio"}
    )
    assert not trainer._metrics["train"]
