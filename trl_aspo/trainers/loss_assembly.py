"""The asymmetric IS loss as both trainers assemble it (docs/asymmetric_loss.md), around the pure per-token term of
`trl_aspo.algorithms.losses.asymmetric_policy_loss` (Wang et al. 2025, arXiv 2510.06062):

    per_token = aspo(lp, lp_old, A)                     flipped ratio for A > 0, hard clip, soft dual clip
              * factor                                  TRL's masks and the vLLM IS correction (gradient-free)
              + kl_coef * k3(lp_ref, lp)                clamped by `kl_clamp` (as verl), bias-corrected if asked
    loss      = aggregate(per_token, mask) / divisor    `aspo_aggregation`: token or sequence mean

`ASPOTrainer` hands over its padded (B, T) batch with `old_per_token_logps`; `AsyncASPOTrainer` its packed tokens laid
out per sample (`trl_aspo.algorithms.packed.SegmentRows`) with the generator's log-probs as the old policy and no
KL or factor (TRL's asynchronous trainer has neither). The aggregation's normalizer is each trainer's (TRL's dapo
normalizer, or one optimizer step's units); everything else is this one function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trl_aspo.algorithms.aspo_metrics import ASPO_TOKEN_STATS, aspo_metric_ratios, aspo_metric_sums
from trl_aspo.algorithms.kl import k3_kl
from trl_aspo.algorithms.losses import (
    aggregate_loss,
    asymmetric_policy_loss,
    entropy_split_mask,
    progressive_flip_threshold,
)


def aspo_loss_options(args, step: int) -> dict:
    """The `asymmetric_policy_loss` options the config sets at optimizer step `step` (the dual-clip constants, the
    high-entropy offsets and the progressive flip threshold); the caller adds the clip range and the masks."""
    return {
        "dual_clip": args.aspo_dual_clip,
        "dual_clip_pos": args.aspo_dual_clip_pos,
        "dual_clip_neg": args.aspo_dual_clip_neg,
        "epsilon_low_high_entropy": args.aspo_epsilon_high_entropy,
        "epsilon_high_high_entropy": args.aspo_epsilon_high_entropy,
        "flip_threshold": progressive_flip_threshold(step, args.aspo_flip_threshold_start, args.aspo_flip_decay_steps),
    }


@dataclass
class AspoLossInputs:
    """(B, T) tensors of one micro-batch. `advantages` is (B,) or (B, T); `entropies` (detached) are needed with
    `aspo_entropy_quantile`; `unflipped` (B,) marks the samples kept on the standard ratio
    (`aspo_unflipped_fraction`); `factor` multiplies the per-token term (masks, IS correction); `ref_log_probs`
    with `kl_coef` adds the KL term."""

    log_probs: torch.Tensor
    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    entropies: torch.Tensor | None = None
    unflipped: torch.Tensor | None = None
    factor: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    kl_coef: float = 0.0


@dataclass
class AspoLossOutputs:
    """`loss` to backpropagate; `aggregated`, the detached loss before `divisor` (logged as `policy_loss`); the
    per-token loss; the stats of `asymmetric_policy_loss`; the per-token KL (None without it)."""

    loss: torch.Tensor
    aggregated: torch.Tensor
    per_token_loss: torch.Tensor
    stats: dict[str, torch.Tensor]
    per_token_kl: torch.Tensor | None


def aspo_loss(
    inputs: AspoLossInputs,
    args,
    step: int,
    epsilon_low: float,
    epsilon_high: float,
    normalizer: float | torch.Tensor | None,
    divisor: float = 1.0,
) -> AspoLossOutputs:
    """The aspo loss of one micro-batch at optimizer step `step` (see the module docstring)."""
    high_entropy = None
    if args.aspo_entropy_quantile is not None:
        high_entropy = entropy_split_mask(inputs.entropies, inputs.mask, args.aspo_entropy_quantile)
    per_token_loss, stats = asymmetric_policy_loss(
        inputs.log_probs,
        inputs.old_log_probs,
        inputs.advantages,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        high_entropy_mask=high_entropy,
        unflipped_mask=inputs.unflipped,
        **aspo_loss_options(args, step),
    )
    if inputs.factor is not None:
        per_token_loss = per_token_loss * inputs.factor
    per_token_kl = None
    if inputs.ref_log_probs is not None:
        per_token_kl = k3_kl(inputs.ref_log_probs, inputs.log_probs, args.kl_clamp)
        if args.use_bias_correction_kl:
            per_token_kl = per_token_kl * torch.exp(inputs.log_probs - inputs.old_log_probs)
        per_token_loss = per_token_loss + inputs.kl_coef * per_token_kl
    aggregated = aggregate_loss(per_token_loss, inputs.mask, args.aspo_aggregation, normalizer)
    loss = aggregated if divisor == 1.0 else aggregated / divisor
    return AspoLossOutputs(loss, aggregated.detach(), per_token_loss, stats, per_token_kl)


def log_aspo_token_metrics(
    metrics: dict[str, list], accelerator, stats: dict[str, torch.Tensor], mask: torch.Tensor, *sums: torch.Tensor
) -> tuple[list[float], float]:
    """Append the `aspo/*` ratios (trl_aspo.algorithms.aspo_metrics) of one micro-batch, summed over ranks, to
    `metrics`; returns the other `sums` (scalars: entropy, loss, KL ...) summed over ranks and the action tokens.
    One reduction and one device-to-host copy for everything: each `.item()` would stall a GPU on its own."""
    columns = [aspo_metric_sums(stats, mask), *(value.float().view(1) for value in sums)]
    totals = accelerator.reduce(torch.cat([column.float() for column in columns]), reduction="sum").tolist()
    width = len(ASPO_TOKEN_STATS) + 2
    for name, pair in aspo_metric_ratios(totals[:width]).items():
        metrics[name].append(pair)
    return totals[width:], totals[width - 1]
