"""The one advantage pipeline (trl_aspo.values.scoring) and the one aspo loss assembly
(trl_aspo.trainers.loss_assembly) that both trainers call, checked against numbers worked out by hand."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from trl_aspo.algorithms.advantage_checks import NonFiniteAdvantageError
from trl_aspo.algorithms.policy_losses import get_policy_loss
from trl_aspo.trainers.loss_assembly import AssemblyInputs, assembled_loss
from trl_aspo.values.event_values import AsyncEventValues
from trl_aspo.values.scoring import AdvantageBatch, AdvantagePipeline, StepScorer


def pipeline_args(**overrides):
    fields = dict(
        advantage_estimator="spo++",
        advantage_normalization="token",
        tool_shaping=False,
        tool_shaping_delta=-2.0,
        tool_shaping_k=0.7,
        tool_shaping_correct_threshold=0.5,
        tool_shaping_interactive_bonus=0.0,
        tool_shaping_penalty=None,
        tool_shaping_correct_reward=None,
        num_generations=1,
        value_reward_range=None,
        value_rho=0.875,
        value_init_file=None,
    )
    return SimpleNamespace(**{**fields, **overrides})


def test_token_normalization_then_shaping_by_hand():
    """Three scorable completions and one without a reward. Token measure with L = (2, 4, 2): mu = sum(L A)/sum(L),
    sigma^2 = sum(L (A - mu)^2) / (sum(L) - 1); then shaping on the correct, tool-calling ones."""
    centered = torch.tensor([0.5, -0.5, 0.25, 7.0], dtype=torch.float64)
    scorable = torch.tensor([True, True, True, False])
    lengths = torch.tensor([2, 4, 2, 3])
    rewards = torch.tensor([1.0, 0.0, 1.0, float("nan")], dtype=torch.float64)
    positions = torch.tensor([0, 1, 1, 0])
    tool_stats = torch.stack(
        [positions, lengths, torch.ones(4, dtype=torch.long), torch.zeros(4, dtype=torch.long)], 1
    )
    scored = AdvantagePipeline(pipeline_args(tool_shaping=True)).score(
        AdvantageBatch(centered, scorable, lengths, torch.zeros(4, dtype=torch.long), rewards, tool_stats=tool_stats)
    )

    mu = (2 * 0.5 + 4 * -0.5 + 2 * 0.25) / 8  # -0.0625
    sigma = math.sqrt((2 * (0.5 - mu) ** 2 + 4 * (-0.5 - mu) ** 2 + 2 * (0.25 - mu) ** 2) / 7)
    normalized = [(a - mu) / (sigma + 1e-8) for a in (0.5, -0.5, 0.25)]
    # Eligible: completions 0 and 2 (correct, a call). mean p = 0.5, mean L = 2: b_i = -2 (p_i - 0.5) / 2.
    bias = [-2 * (0 - 0.5) / 2, 0.0, -2 * (1 - 0.5) / 2]
    clipped = [max(-0.7 * abs(a), min(0.7 * abs(a), b)) for a, b in zip(normalized, bias, strict=True)]
    expected = [a + b for a, b in zip(normalized, clipped, strict=True)] + [0.0]
    assert scored.advantages.tolist() == pytest.approx(expected, abs=1e-12)
    # Statistics are over the three scorable completions: the unscorable one takes part in none (issue 31 item 12).
    assert scored.metrics["shaping/eligible_frac"] == pytest.approx(2 / 3)
    assert scored.metrics["zero_advantage_share"] == 0.0
    assert scored.metrics["advantage/p50"] == pytest.approx(sorted(normalized)[1], abs=1e-9)


def test_group_normalization_keeps_the_group_score_and_zeroes_the_unscorable():
    group = torch.tensor([1.0, -1.0, 0.3], dtype=torch.float64)
    scored = AdvantagePipeline(pipeline_args(advantage_normalization="group", advantage_estimator="group")).score(
        AdvantageBatch(
            centered=torch.tensor([0.5, -0.5, 0.1], dtype=torch.float64),
            scorable=torch.tensor([True, True, False]),
            token_counts=torch.tensor([3, 3, 3]),
            group_ids=torch.tensor([0, 0, 1]),
            rewards=torch.tensor([1.0, 0.0, float("nan")], dtype=torch.float64),
            group_advantages=group,
        )
    )
    assert scored.advantages.tolist() == [1.0, -1.0, 0.0]
    assert "shaping/eligible_frac" not in scored.metrics


def test_a_non_finite_advantage_stops_the_step_naming_its_reward():
    hook_args = pipeline_args(tool_shaping=True, tool_shaping_penalty=f"{__name__}.infinite_penalty")
    with pytest.raises(NonFiniteAdvantageError, match=r"rewards/score\[0\]=1.0"):
        AdvantagePipeline(hook_args).score(
            AdvantageBatch(
                centered=torch.tensor([0.5, -0.5], dtype=torch.float64),
                scorable=torch.tensor([True, True]),
                token_counts=torch.tensor([2, 2]),
                group_ids=torch.tensor([0, 0]),
                rewards=torch.tensor([1.0, 0.0], dtype=torch.float64),
                tool_stats=torch.tensor([[0, 2, 1, 0], [-1, 2, 0, 0]]),
                reward_columns={"rewards/score": torch.tensor([1.0, 0.0])},
            )
        )


def infinite_penalty(texts, positions, lengths, calls, turns, advantages):
    return torch.full_like(advantages, float("inf"))


def test_the_async_scorer_ends_in_the_same_pipeline():
    """`StepScorer` (the asynchronous baseline) hands its `R - v` to the pipeline the synchronous trainer calls: the
    same numbers as the pipeline on the same centered values."""
    args = pipeline_args()
    scorer = StepScorer(args, AsyncEventValues(rho=args.value_rho))
    rewards = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    scored = scorer.score(
        keys=["a", "b", "c"],
        rewards=rewards,
        versions=[0, 0, 0],
        token_counts=torch.tensor([2, 3, 4]),
        group_ids=torch.tensor([0, 1, 2]),
        worker_advantages=torch.zeros(3, dtype=torch.float64),
    )
    # Fresh prompts start at Beta(0.5, 0.5): v = 0.5, so R - v = (0.5, -0.5, 0.5).
    centered = torch.tensor([0.5, -0.5, 0.5], dtype=torch.float64)
    same = AdvantagePipeline(args).score(
        AdvantageBatch(centered, torch.ones(3, dtype=torch.bool), torch.tensor([2, 3, 4]), torch.arange(3), rewards)
    )
    torch.testing.assert_close(scored.advantages, same.advantages)
    assert set(same.metrics) <= set(scored.metrics)


def loss_args(**overrides):
    fields = dict(
        aspo_dual_clip=3.0,
        aspo_dual_clip_pos=None,
        aspo_dual_clip_neg=None,
        aspo_epsilon_high_entropy=0.4,
        aspo_entropy_quantile=None,
        aspo_flip_threshold_start=0.0,
        aspo_flip_decay_steps=0,
        aspo_aggregation="token",
        kl_clamp=None,
        use_bias_correction_kl=False,
    )
    return SimpleNamespace(**{**fields, **overrides})


def test_aspo_loss_assembly_by_hand():
    """One completion, two tokens, A = +1 (flipped: value -A/r), r = (1.1, 0.95): per-token -1/r, times the factor,
    plus 0.1 * k3 KL; token mean over the normalizer 2."""
    lp_old = torch.log(torch.tensor([[0.5, 0.4]], dtype=torch.float64))
    ratio = torch.tensor([[1.1, 0.95]], dtype=torch.float64)
    lp = (lp_old + torch.log(ratio)).requires_grad_()
    lp_ref = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    factor = torch.tensor([[1.0, 0.5]], dtype=torch.float64)
    out = assembled_loss(
        get_policy_loss("aspo"),
        AssemblyInputs(
            lp, lp_old, torch.tensor([1.0]), torch.ones(1, 2), factor=factor, ref_log_probs=lp_ref, kl_coef=0.1
        ),
        loss_args(),
        step=0,
        epsilon_low=0.2,
        epsilon_high=0.2,
        normalizer=2.0,
    )
    kl = [math.exp(r - c) - (r - c) - 1 for r, c in zip(lp_ref[0].tolist(), lp[0].tolist(), strict=True)]
    per_token = [-1 / 1.1 * 1.0 + 0.1 * kl[0], -1 / 0.95 * 0.5 + 0.1 * kl[1]]
    assert out.per_token_loss.tolist()[0] == pytest.approx(per_token, abs=1e-12)
    assert out.loss.item() == pytest.approx(sum(per_token) / 2, abs=1e-12)
    out.loss.backward()
    # Policy term: -A * w * factor / 2 with w = 1/r (the flip); the KL term adds 0.1 * (1 - exp(ref - lp)).
    kl_grad = [0.1 * (1 - math.exp(r - c)) for r, c in zip(lp_ref[0].tolist(), lp[0].tolist(), strict=True)]
    expected = [(-1 / 1.1 * 1.0 + kl_grad[0]) / 2, (-1 / 0.95 * 0.5 + kl_grad[1]) / 2]
    assert lp.grad[0].tolist() == pytest.approx(expected, abs=1e-12)


def test_aspo_loss_sequence_aggregation_divides_after_the_mean():
    lp = torch.zeros(2, 2, dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    out = assembled_loss(
        get_policy_loss("aspo"),
        AssemblyInputs(lp, lp, torch.tensor([1.0, -2.0]), mask),
        loss_args(aspo_aggregation="sequence"),
        step=0,
        epsilon_low=0.2,
        epsilon_high=0.2,
        normalizer=None,
        divisor=4.0,
    )
    # On-policy r = 1: per-token -A; sequence means (-1, 2), their mean 0.5, divided by 4.
    assert out.aggregated.item() == pytest.approx(0.5)
    assert out.loss.item() == pytest.approx(0.125)


def constant_penalty(texts, positions, lengths, calls, turns, advantages):
    return torch.full_like(advantages, 0.25)


def test_where_the_trainers_disagreed_the_synchronous_behaviour_holds():
    """Before the merge the asynchronous scorer counted `zero_advantage_share` after shaping and let a shaping extra
    move an unscorable sample; both now do what the synchronous trainer did: the share counts completions without
    signal from the reward (after normalization, before shaping), and an unscorable sample stays at 0 and is no part
    of the share (two of the three scorable ones have advantage 0)."""
    args = pipeline_args(
        advantage_estimator="group", advantage_normalization="group", num_generations=2, tool_shaping=True
    )
    args.tool_shaping_penalty = f"{__name__}.constant_penalty"
    scored = AdvantagePipeline(args).score(
        AdvantageBatch(
            centered=torch.tensor([0.0, 0.0, 0.5, -0.5], dtype=torch.float64),
            scorable=torch.tensor([True, True, True, False]),
            token_counts=torch.full((4,), 4),
            group_ids=torch.tensor([0, 0, 1, 1]),
            rewards=torch.tensor([1.0, 1.0, 1.0, float("nan")], dtype=torch.float64),
            group_advantages=torch.tensor([0.0, 0.0, 1.0, -1.0], dtype=torch.float64),
            tool_stats=torch.tensor([[-1, 4, 0, 0]] * 4),
        )
    )
    assert scored.advantages.tolist() == [-0.25, -0.25, 0.75, 0.0]  # the penalty is subtracted
    assert scored.metrics["zero_advantage_share"] == pytest.approx(2 / 3)
