"""The logged `aspo/*` metrics of both trainers, as ratios over the logging window.

Each `aspo/*` metric is a ratio: a share of action tokens (`aspo/<stat>_frac` = tokens with the stat / action tokens)
or a mean over flipped tokens (`aspo/flip_weight_mean` = sum of the flipped tokens' gradient weights / flipped
tokens). A micro-batch contributes its numerator and denominator, summed over ranks, and the logged value is
``sum(numerators) / sum(denominators)`` over the logging window, so every token of the window weighs the same and a
micro-batch without flipped tokens adds nothing to the flip-weight mean (a mean of per-micro-batch ratios would
weigh short micro-batches up and count such a micro-batch as a 0). A micro-batch whose denominator is 0 logs no
pair, so a window without any flipped token logs no `aspo/flip_weight_mean` at all.

TRL's `AsyncGRPOTrainer` reduces ``(numerator, denominator)`` pairs this way itself; `reduce_ratio_metrics` does it
for the synchronous trainer, whose `GRPOTrainer.log` averages plain numbers.
"""

from __future__ import annotations

import torch

ASPO_TOKEN_STATS = ("hard_clip_pos", "hard_clip_neg", "dual_clip_pos", "dual_clip_neg", "flipped")


def aspo_metric_sums(stats: dict[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """(7,) float32 sums over the action tokens (`mask`): the tokens of each `ASPO_TOKEN_STATS` stat, the flipped
    tokens' flip weights (the `stats` of `trl_aspo.algorithms.losses.asymmetric_policy_loss`), and the action
    tokens."""
    mask = mask.float()
    columns = [(stats[name].float() * mask).sum() for name in ASPO_TOKEN_STATS]
    columns += [(stats["flip_weight"].float() * mask).sum(), mask.sum()]
    return torch.stack(columns)


def aspo_metric_ratios(sums: list[float]) -> dict[str, tuple[float, float]]:
    """The `(numerator, denominator)` pair of each `aspo/*` metric from the (rank-summed) `aspo_metric_sums`; a
    metric whose denominator is 0 is left out."""
    tokens, flipped = sums[-1], sums[ASPO_TOKEN_STATS.index("flipped")]
    pairs = {f"aspo/{name}_frac": (sums[index], tokens) for index, name in enumerate(ASPO_TOKEN_STATS)}
    pairs["aspo/flip_weight_mean"] = (sums[len(ASPO_TOKEN_STATS)], flipped)
    return {name: pair for name, pair in pairs.items() if pair[1] > 0}


def reduce_ratio_metrics(metrics: dict[str, list]) -> None:
    """Replace, in place, every metric logged as `(numerator, denominator)` pairs by its one window value
    ``sum(numerators) / sum(denominators)`` (the rule of TRL's async `_reduce_metric`)."""
    for name, values in metrics.items():
        if values and isinstance(values[0], tuple):
            numerator, denominator = (sum(column) for column in zip(*values, strict=True))
            metrics[name] = [numerator / denominator]
