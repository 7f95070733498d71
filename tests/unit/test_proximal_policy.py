"""The proximal policy's pure functions (trl_aspo.algorithms.proximal_policy) and PPO's dual clip, against numbers
worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from trl_aspo.algorithms.losses import clipped_surrogate_loss
from trl_aspo.algorithms.proximal_policy import (
    loglinear_alpha,
    loglinear_proximal_log_probs,
    proximal_metrics,
    proximal_sums,
)


def test_loglinear_alpha_by_hand():
    """s_prox = 5: a sample of the batch-start version (s_b = 5) has alpha 1 at j = 0 and 0 after; s_b = 3 gives
    2 / (2 + j); s_b = 0 gives 5 / (5 + j); a version published after the batch start counts as s_prox."""
    behaviour = torch.tensor([5, 3, 0, 7])
    assert loglinear_alpha(behaviour, 5, 0).tolist() == [1.0, 1.0, 1.0, 1.0]
    assert loglinear_alpha(behaviour, 5, 1).tolist() == pytest.approx([0.0, 2 / 3, 5 / 6, 0.0])
    assert loglinear_alpha(behaviour, 5, 3).tolist() == pytest.approx([0.0, 2 / 5, 5 / 8, 0.0])
    assert loglinear_alpha(behaviour, 5, 1).dtype == torch.float64
    with pytest.raises(ValueError, match="step_in_batch"):
        loglinear_alpha(behaviour, 5, -1)


def test_loglinear_interpolates_in_log_space_and_is_detached():
    """log pi_prox = lp_b + alpha (lp_theta - lp_b): -2 + 0.25 * (-1 - -2) = -1.75; alpha 1 is pi_theta, 0 pi_b."""
    behaviour = torch.tensor([[-2.0, -0.5]])
    current = torch.tensor([[-1.0, -0.7]], requires_grad=True)
    proximal = loglinear_proximal_log_probs(behaviour, current, torch.tensor([[0.25]]))
    assert proximal.tolist()[0] == pytest.approx([-1.75, -0.55])
    assert not proximal.requires_grad
    assert loglinear_proximal_log_probs(behaviour, current, torch.ones(1, 1)).tolist() == current.tolist()
    assert loglinear_proximal_log_probs(behaviour, current, torch.zeros(1, 1)).tolist() == behaviour.tolist()


def test_proximal_sums_by_hand():
    """r = 1.5 (A > 0, above 1 + 0.2: clipped), 0.5 (A < 0, below 1 - 0.2: clipped), 1.1 (A < 0: not), a masked
    token ignored."""
    proximal = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    current = proximal + torch.tensor([[math.log(1.5), math.log(0.5), math.log(1.1), 3.0]])
    advantages = torch.tensor([[1.0, -1.0, -2.0, 1.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    sums = proximal_sums(current, proximal, advantages, mask, 0.2, 0.2).tolist()
    logs = [math.log(1.5), math.log(0.5), math.log(1.1)]
    assert sums == pytest.approx([3, sum(abs(x) for x in logs), -sum(logs), 2])
    metrics = proximal_metrics(sums)
    assert metrics["ppo/clip_frac"] == pytest.approx((2, 3))
    assert metrics["ppo/approx_kl"][0] == pytest.approx(-sum(logs))
    assert proximal_metrics([0.0, 0.0, 0.0, 0.0]) == {}


def test_dual_clip_caps_negative_advantages_with_no_gradient():
    """eps 0.2, c = 2. A = -1: r = 4 -> surrogate max(4, 1.2) = 4, capped at -cA = 2 with no gradient; r = 1.5 ->
    1.5 (gradient -A r = 1.5); r = 0.5 -> the clip 0.8 (no gradient). A = +1, r = 4 -> -min(4, 1.2) = -1.2, never
    capped."""
    ratios = torch.tensor([[4.0, 1.5, 0.5, 4.0]])
    advantages = torch.tensor([[-1.0, -1.0, -1.0, 1.0]])
    log_probs = ratios.log().requires_grad_(True)
    old = torch.zeros_like(log_probs)
    loss, capped = clipped_surrogate_loss(log_probs, old, advantages, 0.2, 0.2, dual_clip=2.0)
    assert loss.tolist()[0] == pytest.approx([2.0, 1.5, 0.8, -1.2])
    assert capped.tolist() == [[True, False, False, False]]
    loss.sum().backward()
    assert log_probs.grad.tolist()[0] == pytest.approx([0.0, 1.5, 0.0, 0.0])
    plain, never = clipped_surrogate_loss(ratios.log(), old, advantages, 0.2, 0.2)
    assert plain.tolist()[0] == pytest.approx([4.0, 1.5, 0.8, -1.2]) and not never.any()
    with pytest.raises(ValueError, match="dual_clip"):
        clipped_surrogate_loss(ratios.log(), old, advantages, 0.2, 0.2, dual_clip=1.0)
