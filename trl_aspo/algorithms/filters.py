"""Sample filters of the ASPO reference recipe (Archer2.0, arXiv 2510.06062).

:func:`zero_variance_groups` marks the completions of prompt groups whose rewards are all equal, which the reference
rejects before its update ("rejection sampling" of all-solved and all-failed prompts, as in DAPO's dynamic sampling,
arXiv 2503.14476): under the group baseline ``A_i = R_i - mean_G(R)`` such a group has ``A_i = 0`` and carries no
policy-gradient signal, yet it would still count in a token-mean loss's denominator and in the KL term.
"""

from __future__ import annotations

import torch


def zero_variance_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N,) bool: True for every completion of a group ``G`` of ``group_size`` consecutive rewards with
    ``max_G(R) == min_G(R)`` over its scorable (non-NaN) rewards; a group with no scorable reward counts as equal.
    """
    if rewards.dim() != 1:
        raise ValueError(f"`rewards` must be 1-D, got shape {tuple(rewards.shape)}.")
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of `group_size`={group_size}.")
    grouped = rewards.view(-1, group_size)
    scorable = ~torch.isnan(grouped)
    highest = torch.where(scorable, grouped, torch.full_like(grouped, -torch.inf)).amax(dim=1)
    lowest = torch.where(scorable, grouped, torch.full_like(grouped, torch.inf)).amin(dim=1)
    equal = (highest == lowest) | ~scorable.any(dim=1)
    return equal.repeat_interleave(group_size)


def zero_variance_from_std(reward_std: torch.Tensor) -> torch.Tensor:
    """Bool like ``reward_std``: True where a group's reward standard deviation (over its scorable rewards) is 0, or
    NaN because no reward was scorable. The same groups as :func:`zero_variance_groups`, for samples that carry their
    group's statistic (the asynchronous rollout worker stamps ``reward_std`` on each) instead of the whole group."""
    return ~(reward_std > 0)
