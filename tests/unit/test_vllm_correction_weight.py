"""TRL's vLLM importance-sampling correction composed with the asymmetric loss, on hand numbers.

Per token, the gradient of the loss w.r.t. log pi_theta is `-A * c * w`: `w = w_aspo(pi_theta / pi_old)` the
asymmetric weight of `trl_aspo.algorithms.losses` with the trainer's recomputation `pi_old` as the old policy, and
`c = min(pi_old / pi_vllm, C_max)` (mode `token_truncate`) TRL's gradient-free correction, which multiplies the
per-token loss (docs/vllm.md, "TRL's importance-sampling correction with the asymmetric loss")."""

from __future__ import annotations

import math

import torch

from trl_aspo.algorithms.losses import asymmetric_policy_loss


def test_composed_per_token_weight_on_hand_numbers():
    # (A, pi_old, pi_theta, pi_vllm) per token; eps 0.2/0.2, C = 3, TRL's default cap C_max = 3.
    tokens = [
        (1.0, 0.5, 0.4, 0.25),  # A>0, r = 0.8: flip w = 1/r = 1.25; c = 0.5/0.25 = 2      -> weight 2.5
        (-1.0, 0.5, 0.6, 0.1),  # A<0, r = 1.2: PPO w = r = 1.2; c = min(5, 3) = 3          -> weight 3.6
        (1.0, 0.5, 0.75, 0.5),  # A>0, r = 1.5 > 1.2: hard clip w = 0; c = 1               -> weight 0
        (2.0, 0.5, 0.1, 0.5),  # A>0, r = 0.2 < 1/C: soft dual clip w = C = 3; c = 1       -> weight 3
        (-0.5, 0.2, 0.1, 0.4),  # A<0, r = 0.5 < 0.8: hard clip w = 0; c = 0.5             -> weight 0
    ]
    expected_weight = torch.tensor([[2.5, 3.6, 0.0, 3.0, 0.0]], dtype=torch.float64)
    advantages = torch.tensor([[a for a, *_ in tokens]], dtype=torch.float64)
    old = torch.tensor([[math.log(p) for _, p, _, _ in tokens]], dtype=torch.float64)
    current = torch.tensor([[math.log(p) for _, _, p, _ in tokens]], dtype=torch.float64, requires_grad=True)
    sampling = torch.tensor([[math.log(p) for *_, p in tokens]], dtype=torch.float64)

    correction = torch.exp(old - sampling).clamp(max=3.0)  # TRL's token_truncate factor, no gradient
    per_token_loss, _ = asymmetric_policy_loss(current, old, advantages, epsilon_low=0.2, epsilon_high=0.2)
    (per_token_loss * correction).sum().backward()

    torch.testing.assert_close(current.grad, -advantages * expected_weight, rtol=1e-12, atol=1e-12)
