"""The zero-variance group filter (trl_aspo.algorithms.filters): by hand, and from the asynchronous worker's
per-group reward std."""

from __future__ import annotations

import math

import pytest
import torch


def test_zero_variance_std_marks_the_groups_zero_variance_groups_marks():
    from trl_aspo.algorithms.filters import zero_variance_from_std, zero_variance_groups

    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, float("nan"), float("nan"), 0.5, float("nan")])
    grouped = rewards.view(-1, 2)
    # The worker's statistic: population std over the group's scorable rewards (NaN when none is scorable).
    scorable = [row[~torch.isnan(row)] for row in grouped]
    stds = torch.tensor([row.std(correction=0).item() if row.numel() else math.nan for row in scorable])
    assert zero_variance_from_std(stds).tolist() == zero_variance_groups(rewards, 2)[::2].tolist()
    assert zero_variance_from_std(stds).tolist() == [True, False, True, True]


def test_zero_variance_groups_hand_numbers():
    from trl_aspo.algorithms.filters import zero_variance_groups

    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.5, 0.5, float("nan"), 0.5, float("nan"), float("nan")])
    # groups of 2: [1, 1] equal, [0, 0] equal, [0.5, 0.5] equal, [nan, 0.5] (one scorable) equal, [nan, nan] equal
    assert zero_variance_groups(rewards, 2).tolist() == [True] * 10
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.2, 0.3])
    assert zero_variance_groups(rewards, 2).tolist() == [False, False, True, True, False, False]
    assert zero_variance_groups(rewards, 3).tolist() == [False] * 6
    with pytest.raises(ValueError, match="group_size"):
        zero_variance_groups(rewards, 4)
