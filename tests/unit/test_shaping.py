"""Tests for tool-position advantage shaping (Lin & Xu 2025, arXiv 2508.19201); numbers are hand-computed."""

import math

import pytest
import torch

from trl_aspo.algorithms.shaping import (
    CallablePenalty,
    InteractiveTurnBonus,
    shaping_stats,
    tool_position_bias,
    tool_position_shaping,
)


def _t(values, dtype=torch.long):
    return torch.tensor(values, dtype=dtype)


def reference_shaping(advantages, positions, lengths, eligible, groups, delta=-2.0, k=0.7):
    """Loop-based transcription of the equation, independent of the vectorized code."""
    out = [float(a) for a in advantages.tolist()]
    ids, eli = groups.tolist(), eligible.tolist()
    for g in set(ids):
        members = [i for i in range(len(ids)) if ids[i] == g and eli[i]]
        if not members:
            continue
        mean_p = sum(int(positions[i]) for i in members) / len(members)
        mean_l = sum(int(lengths[i]) for i in members) / len(members)
        for i in members:
            b = delta * (int(positions[i]) - mean_p) / mean_l
            bound = k * abs(out[i])
            out[i] += min(max(b, -bound), bound)
    return torch.tensor(out, dtype=torch.float64)


def _random_batch(generator, size, num_groups):
    lengths = torch.randint(1, 200, (size,), generator=generator)
    has_call = torch.rand(size, generator=generator) < 0.7
    positions = torch.where(has_call, (torch.rand(size, generator=generator) * lengths).long(), -1)
    eligible = has_call & (torch.rand(size, generator=generator) < 0.7)
    groups = torch.randint(0, num_groups, (size,), generator=generator) * 7 + 3  # non-contiguous ids
    advantages = torch.randn(size, generator=generator, dtype=torch.float64)
    return advantages, positions, lengths, eligible, groups


def test_unclipped():
    # mean p = 20, mean L = 100: b = -2 * (p - 20) / 100 = [0.2, 0, -0.2], all within 0.7 * |A| = 0.7.
    shaped = tool_position_shaping(
        _t([1.0, 1.0, 1.0], torch.float32),
        _t([10, 20, 30]),
        _t([100, 100, 100]),
        _t([True] * 3, torch.bool),
        _t([0] * 3),
    )
    torch.testing.assert_close(shaped, _t([1.2, 1.0, 0.8], torch.float32))


def test_clipped_both_signs():
    # mean p = 50, mean L = 100: b = [1.0, 0.2, -1.0, -0.2]; bounds 0.7|A| = [0.07, 0.14, 0.35, 0.7].
    advantages = _t([0.1, -0.2, 0.5, -1.0], torch.float64)
    args = (_t([0, 40, 100, 60]), _t([100, 100, 120, 80]), _t([True] * 4, torch.bool), _t([5] * 4))
    bias = tool_position_bias(advantages, *args)
    torch.testing.assert_close(bias, _t([0.07, 0.14, -0.35, -0.2], torch.float64))
    torch.testing.assert_close(tool_position_shaping(advantages, *args), _t([0.17, -0.06, 0.15, -1.2], torch.float64))
    # The clip keeps every advantage's sign.
    assert torch.equal(torch.sign(tool_position_shaping(advantages, *args)), torch.sign(advantages))


def test_several_groups_and_ineligible_untouched():
    advantages = _t([1.0, 1.0, 1.0, -1.0, 2.0, 0.5], torch.float64)
    positions = _t([4, 8, -1, 0, 10, 20])
    lengths = _t([20, 20, 10, 40, 60, 50])
    eligible = _t([True, True, False, True, True, True], torch.bool)
    groups = _t([0, 0, 0, 1, 1, 1])
    # Group 0: E = {0, 1}, mean p = 6, mean L = 20 (the ineligible length 10 is excluded): b = [0.2, -0.2].
    # Group 1: mean p = 10, mean L = 50: b = [0.4, 0, -0.4], bounds [0.7, 1.4, 0.35].
    shaped = tool_position_shaping(advantages, positions, lengths, eligible, groups)
    torch.testing.assert_close(shaped, _t([1.2, 0.8, 1.0, -0.6, 2.0, 0.15], torch.float64))


def test_ineligible_with_position_keeps_advantage():
    # An incorrect completion that calls the tool is neither shaped nor part of the group means.
    advantages = _t([0.5, 0.5, -1.0], torch.float64)
    positions, lengths = _t([0, 10, 90]), _t([100, 100, 100])
    shaped = tool_position_shaping(advantages, positions, lengths, _t([True, True, False], torch.bool), _t([0, 0, 0]))
    torch.testing.assert_close(shaped, _t([0.6, 0.4, -1.0], torch.float64))


def test_single_eligible_member_and_equal_positions_give_zero_bias():
    advantages = _t([1.0, -1.0, 1.0, 1.0, 1.0], torch.float64)
    positions = _t([30, -1, 5, 5, 5])
    lengths = _t([50, 40, 10, 20, 90])
    eligible = _t([True, False, True, True, True], torch.bool)
    groups = _t([0, 0, 1, 1, 1])
    bias = tool_position_bias(advantages, positions, lengths, eligible, groups)
    assert torch.equal(bias, torch.zeros(5, dtype=torch.float64))


def test_single_stream_one_group():
    # One completion per prompt: the whole batch is the group. mean p = 15, mean L = 60.
    advantages = _t([0.5, 0.5, 0.5, 0.5], torch.float64)
    positions = _t([0, 30, -1, 15])
    lengths = _t([60, 60, 10, 60])
    eligible = _t([True, True, False, True], torch.bool)
    shaped = tool_position_shaping(advantages, positions, lengths, eligible, torch.zeros(4, dtype=torch.long))
    # b = -2 * [-15, 15, 0] / 60 = [0.5, -0.5, 0], clipped to +-0.35.
    torch.testing.assert_close(shaped, _t([0.85, 0.15, 0.5, 0.5], torch.float64))


@pytest.mark.parametrize("delta,k", [(-2.0, 0.7), (-2.5, 0.9), (1.0, 0.3), (-2.0, 0.0)])
def test_matches_reference_on_random_data(delta, k):
    generator = torch.Generator().manual_seed(0)
    batch = _random_batch(generator, 64, 5)
    shaped = tool_position_shaping(*batch, delta=delta, k=k)
    torch.testing.assert_close(shaped, reference_shaping(*batch, delta=delta, k=k))


def test_low_precision_advantages_keep_dtype():
    generator = torch.Generator().manual_seed(1)
    advantages, *rest = _random_batch(generator, 32, 4)
    shaped = tool_position_shaping(advantages.to(torch.bfloat16), *rest)
    assert shaped.dtype == torch.bfloat16
    torch.testing.assert_close(
        shaped.double(), reference_shaping(advantages.to(torch.bfloat16).double(), *rest), atol=2e-2, rtol=2e-2
    )


def test_cross_rank_grouping_on_gathered_data():
    # 3 prompts x 4 generations over 2 ranks of 6, gathered process-major: rank 0 holds all of group 0
    # and half of group 1, so group 1 straddles the ranks.
    ranks = [
        {
            "advantages": _t([2.0, -2.0, 1.5, 2.0, 1.0, -0.5], torch.float64),
            "positions": _t([3, 9, 1, 20, 5, 40]),
            "lengths": _t([50, 50, 50, 60, 50, 45]),
            "eligible": _t([True, True, True, False, True, True], torch.bool),
            "groups": _t([0, 0, 0, 0, 1, 1]),
        },
        {
            "advantages": _t([1.0, 3.0, -1.0, 0.5, 2.0, 2.0], torch.float64),
            "positions": _t([12, 2, 7, 30, -1, 0]),
            "lengths": _t([55, 50, 40, 35, 30, 50]),
            "eligible": _t([True, True, True, True, False, True], torch.bool),
            "groups": _t([1, 1, 2, 2, 2, 2]),
        },
    ]
    gathered = {key: torch.cat([rank[key] for rank in ranks]) for key in ranks[0]}  # accelerator.gather

    shaped = tool_position_shaping(**gathered)
    expected = reference_shaping(**gathered)
    torch.testing.assert_close(shaped, expected)
    for rank in range(2):
        torch.testing.assert_close(shaped[6 * rank : 6 * rank + 6], expected[6 * rank : 6 * rank + 6])
    # Shaping a rank's slice on its own would use a partial mean for the straddling group 1.
    local = tool_position_shaping(**ranks[0])
    torch.testing.assert_close(local[:4], expected[:4])
    assert not torch.allclose(local[4:], expected[4:6])


def test_empty_batch():
    empty = torch.zeros(0, dtype=torch.long)
    shaped = tool_position_shaping(torch.zeros(0), empty, empty, torch.zeros(0, dtype=torch.bool), empty)
    assert shaped.shape == (0,)


@pytest.mark.parametrize(
    "change,error,match",
    [
        ({"positions": _t([-1, 2])}, ValueError, "positions"),
        ({"positions": _t([10, 2])}, ValueError, "positions"),
        ({"lengths": _t([-5, 10])}, ValueError, "lengths"),
        ({"groups": _t([0, 0, 0])}, ValueError, "groups"),
        ({"advantages": torch.ones(2, 1)}, ValueError, "advantages"),
        ({"k": -0.1}, ValueError, "k"),
        ({"k": math.inf}, ValueError, "k"),
        ({"delta": math.nan}, ValueError, "delta"),
        ({"advantages": _t([1, 1])}, TypeError, "advantages"),
        ({"positions": _t([1.0, 2.0], torch.float32)}, TypeError, "positions"),
        ({"eligible": _t([1, 1])}, TypeError, "eligible"),
        ({"groups": [0, 0]}, TypeError, "groups"),
    ],
)
def test_bad_values_and_types_are_refused(change, error, match):
    """One change at a time to a valid two-sample input: a value out of range is a ValueError, a wrong type a
    TypeError, each naming the argument."""
    valid = {
        "advantages": _t([1.0, 1.0], torch.float32),
        "positions": _t([1, 2]),
        "lengths": _t([10, 10]),
        "eligible": _t([True, True], torch.bool),
        "groups": _t([0, 0]),
    }
    with pytest.raises(error, match=match):
        tool_position_shaping(**{**valid, **change})


def test_shaping_stats():
    bias = _t([0.2, -0.4, 0.0, 0.0], torch.float32)
    stats = shaping_stats(bias, _t([True, True, True, False], torch.bool))
    assert stats["eligible_frac"] == pytest.approx(0.75)
    assert stats["bias_mean"] == pytest.approx(-0.2 / 3)
    assert stats["bias_abs_mean"] == pytest.approx(0.2)
    assert stats["bias_abs_max"] == pytest.approx(0.4)
    none = shaping_stats(bias, torch.zeros(4, dtype=torch.bool))
    assert none["eligible_frac"] == 0.0 and math.isnan(none["bias_mean"])


def _hook_args(advantages, turns):
    size = len(advantages)
    zeros = torch.zeros(size, dtype=torch.long)
    return [""] * size, zeros, zeros + 10, zeros, _t(turns), _t(advantages, torch.float32)


def test_interactive_turn_bonus():
    hook = InteractiveTurnBonus(bonus=0.1, max_turns=3)
    adjustment = hook(*_hook_args([1.0, 1.0, -1.0, 0.0, 2.0], [2, 5, 2, 1, 0]))
    torch.testing.assert_close(adjustment, _t([0.2, 0.3, 0.0, 0.0, 0.0], torch.float32))


def test_callable_penalty():
    def long_answers(texts, positions, lengths, num_calls, interactive_turns, advantages):
        return torch.tensor([0.5 if len(t) > 3 else 0.0 for t in texts])

    texts, *rest = _hook_args([1.0, -1.0], [0, 0])
    adjustment = CallablePenalty(long_answers)(["long text", "ok"], *rest)
    torch.testing.assert_close(adjustment, _t([-0.5, 0.0], torch.float32))
    with pytest.raises(ValueError, match="shape"):
        CallablePenalty(lambda *args: torch.zeros(3))(texts, *rest)
