"""A policy loss in a user's own file: CISPO (MiniMax-M1, arXiv 2506.13585) registered as "clipped_is".

Importing this module registers the loss; then `loss_type="clipped_is"` trains in ASPOTrainer and AsyncASPOTrainer
with no trl-aspo file edited (docs/development.md, "Adding a method"). TRL 1.16 has its own `cispo`, which
GRPOTrainer computes inline; a registered loss may not take a TRL name, hence another one.

Per token, with ratio ``r = pi / pi_old``: ``loss = -sg(min(r, epsilon_high)) * A * log pi``, so the gradient is
``-min(r, epsilon_high) * A * grad log pi``: the importance weight is clipped and detached, and every token keeps a
gradient (PPO's clip zeroes it). `epsilon_high` is the trainer's (TRL's `epsilon_high`), an absolute bound as in
TRL's `cispo` (MiniMax-M1 uses 5 with no lower bound).
"""

import torch

from trl_aspo.algorithms import PolicyLossInputs, register_policy_loss


@register_policy_loss("clipped_is")
def clipped_is_loss(inputs: PolicyLossInputs):
    ratio = torch.exp(inputs.log_probs.detach() - inputs.old_log_probs)
    weight = ratio.clamp(max=inputs.epsilon_high)
    advantages = inputs.advantages if inputs.advantages.dim() == 2 else inputs.advantages[:, None]
    return -weight * advantages * inputs.log_probs, {"clipped": (ratio > inputs.epsilon_high).float()}
