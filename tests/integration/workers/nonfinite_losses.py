"""Policy losses that go non-finite, registered on import (`plugins: [nonfinite_losses]`), for
tests/integration/test_nonfinite_steps.py: `nan_loss` is NaN everywhere; `nan_on_rank_1` only on the process of rank
1, as one bad batch on one rank would be."""

import os

import torch

from trl_aspo.algorithms import PolicyLossInputs, register_policy_loss


def _plain(inputs: PolicyLossInputs) -> torch.Tensor:
    advantages = inputs.advantages if inputs.advantages.dim() == 2 else inputs.advantages[:, None]
    return -advantages * inputs.log_probs


@register_policy_loss("nan_loss")
def nan_loss(inputs: PolicyLossInputs):
    return _plain(inputs) * float("nan"), {}


@register_policy_loss("nan_on_rank_1")
def nan_on_rank_1(inputs: PolicyLossInputs):
    scale = float("nan") if os.environ.get("RANK") == "1" else 1.0
    return _plain(inputs) * scale, {}
