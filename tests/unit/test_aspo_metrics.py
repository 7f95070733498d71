"""The logged metrics of a registered loss are ratios over the logging window, in both trainers' logging code
(trl_aspo.algorithms.policy_losses; the aspo loss's `aspo/*` metrics, on stub trainers)."""

from __future__ import annotations

import types
from collections import defaultdict

import pytest
import torch

from trl_aspo.algorithms.aspo_policy_loss import ASPO_METRICS
from trl_aspo.algorithms.policy_losses import get_policy_loss, metric_pairs, metric_sums, reduce_ratio_metrics

ASPO = get_policy_loss("aspo")
STATS = ("hard_clip_pos", "hard_clip_neg", "dual_clip_pos", "dual_clip_neg", "flipped", "flip_weight")


def _micro_batch(flip_weights: list[float], tokens: int, hard_clipped: int):
    """(1, tokens) stats of one micro-batch: the first len(flip_weights) tokens flipped with those weights, the last
    `hard_clipped` tokens hard-clipped negative; one padding column the mask leaves out."""
    shape = (1, tokens + 1)
    stats = {name: torch.zeros(shape) for name in STATS}
    stats["flipped"][0, : len(flip_weights)] = 1.0
    stats["flip_weight"][0, : len(flip_weights)] = torch.tensor(flip_weights)
    stats["hard_clip_neg"][0, tokens - hard_clipped : tokens] = 1.0
    stats["flipped"][0, tokens] = stats["flip_weight"][0, tokens] = 5.0  # padding: must not count
    mask = torch.zeros(shape, dtype=torch.bool)
    mask[0, :tokens] = True
    return stats, mask


# Micro-batch 1: 4 action tokens, 2 flipped (weights 0.8, 0.6), 1 hard-clipped; micro-batch 2: 6 tokens, none flipped,
# 3 hard-clipped. Over the window: flip_weight_mean = 1.4 / 2 = 0.7 (the per-micro-batch mean gave (0.7 + 0) / 2),
# flipped_frac = 2 / 10 (gave (0.5 + 0) / 2), hard_clip_neg_frac = 4 / 10 (gave (0.25 + 0.5) / 2).
MICRO_BATCHES = [_micro_batch([0.8, 0.6], 4, 1), _micro_batch([], 6, 3)]
EXPECTED = {"aspo/flip_weight_mean": 0.7, "aspo/flipped_frac": 0.2, "aspo/hard_clip_neg_frac": 0.4}


def test_sums_and_pairs_by_hand():
    stats, mask = MICRO_BATCHES[0]
    sums = metric_sums(ASPO_METRICS, stats, mask).tolist()
    # (numerator, denominator) per metric: the five token shares over 4 action tokens, then 1.4 over 2 flipped.
    assert sums == pytest.approx([0.0, 4.0, 1.0, 4.0, 0.0, 4.0, 0.0, 4.0, 2.0, 4.0, 1.4, 2.0])
    pairs = metric_pairs(ASPO_METRICS, sums)
    assert pairs["aspo/flip_weight_mean"] == pytest.approx((1.4, 2.0))
    assert pairs["aspo/hard_clip_neg_frac"] == pytest.approx((1.0, 4.0))
    # No flipped token: no flip-weight pair; no action token at all: no pair.
    assert "aspo/flip_weight_mean" not in metric_pairs(ASPO_METRICS, metric_sums(ASPO_METRICS, *MICRO_BATCHES[1]))
    assert metric_pairs(ASPO_METRICS, [0.0] * 12) == {}


def test_a_loss_without_declared_metrics_logs_each_stat_as_its_token_mean():
    entry = types.SimpleNamespace(name="mine", metrics=None)
    stats = {"clipped": torch.tensor([[1.0, 0.0, 1.0]])}
    logged = type(ASPO).logged_metrics(entry, stats)
    assert [metric.name for metric in logged] == ["mine/clipped_mean"]
    sums = metric_sums(logged, stats, torch.tensor([[1.0, 1.0, 0.0]])).tolist()
    assert metric_pairs(logged, sums) == {"mine/clipped_mean": (1.0, 2.0)}


def test_a_window_without_flipped_tokens_logs_no_flip_weight_mean():
    metrics = defaultdict(list)
    for name, pair in metric_pairs(ASPO_METRICS, metric_sums(ASPO_METRICS, *MICRO_BATCHES[1]).tolist()).items():
        metrics[name].append(pair)
    reduce_ratio_metrics(metrics)
    assert "aspo/flip_weight_mean" not in metrics
    assert metrics["aspo/hard_clip_neg_frac"] == [pytest.approx(0.5)]


def _stub(num_processes: int = 1):
    """The attributes `_log_loss_metrics` reads, on one process (reduce is the identity)."""
    accelerator = types.SimpleNamespace(reduce=lambda tensor, reduction: tensor, num_processes=num_processes)
    args = types.SimpleNamespace(aspo_adaptive_kl_beta=None)
    return types.SimpleNamespace(accelerator=accelerator, args=args, _metrics={"train": defaultdict(list)})


def test_synchronous_trainer_logs_window_ratios():
    from trl_aspo import ASPOTrainer

    trainer = _stub()
    for stats, mask in MICRO_BATCHES:
        entropies = torch.ones(mask.shape)
        out = types.SimpleNamespace(stats=stats, aggregated=torch.tensor(0.5), per_token_kl=None)
        ASPOTrainer._log_loss_metrics(trainer, "train", ASPO, out, entropies, mask)
    metrics = trainer._metrics["train"]
    reduce_ratio_metrics(metrics)  # what ASPOTrainer.log does before GRPOTrainer.log averages
    for name, value in EXPECTED.items():
        assert metrics[name] == [pytest.approx(value)], name
    assert metrics["entropy"] == [1.0, 1.0]


def test_asynchronous_trainer_logs_window_ratios():
    from trl.experimental.async_grpo.async_grpo_trainer import _reduce_metric

    from trl_aspo import AsyncASPOTrainer

    trainer = _stub()
    # A batch's first step (steps_per_rollout_batch 1): each metric once, under its own name.
    trainer.steps_per_rollout_batch, trainer._step_in_batch = 1, 0
    trainer._append_step_metrics = lambda values: AsyncASPOTrainer._append_step_metrics(trainer, values)
    for stats, mask in MICRO_BATCHES:
        AsyncASPOTrainer._log_loss_metrics(trainer, ASPO, stats, mask, torch.full(mask.shape, 2.0))
    metrics = trainer._metrics["train"]
    for name, value in EXPECTED.items():
        assert _reduce_metric(name, metrics[name]) == pytest.approx(value), name
    assert _reduce_metric("policy_loss", metrics["policy_loss"]) == pytest.approx(2.0)
    assert not any(name.endswith("_later_steps") for name in metrics)
