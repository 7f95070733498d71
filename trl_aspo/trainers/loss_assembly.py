"""A registered policy loss (trl_aspo.algorithms.policy_losses) as both trainers assemble it (docs/development.md,
"Adding a method"):

    per_token = loss(lp, lp_old, A, ...)                the registered per-token term (aspo: arXiv 2510.06062)
              * factor                                  TRL's masks, the vLLM or off-policy IS correction (no gradient)
              + kl_coef * k3(lp_ref, lp)                clamped by `kl_clamp` (as verl), bias-corrected if asked
    loss      = aggregate(per_token, mask) / divisor    `aspo_aggregation`: token or sequence mean

`ASPOTrainer` hands over its padded (B, T) batch with `old_per_token_logps`; `AsyncASPOTrainer` its packed tokens laid
out per sample (`trl_aspo.algorithms.packed.SegmentRows`) with the generator's log-probs (or, decoupled, its own) as
the old policy and no KL (TRL's asynchronous trainer has none). The aggregation's normalizer is each trainer's (TRL's
dapo normalizer, or one optimizer step's units); everything else is this one function.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trl_aspo.algorithms.kl import k3_kl
from trl_aspo.algorithms.losses import aggregate_loss
from trl_aspo.algorithms.policy_losses import PolicyLoss, PolicyLossInputs, metric_pairs, metric_sums


@dataclass
class AssemblyInputs:
    """(B, T) tensors of one micro-batch. `advantages` is (B,) or (B, T); `entropies` are detached; `draws` holds the
    loss's (B,) per-sample draws; `factor` multiplies the per-token term (masks, IS correction); `ref_log_probs`
    with `kl_coef` adds the KL term."""

    log_probs: torch.Tensor
    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    entropies: torch.Tensor | None = None
    draws: dict[str, torch.Tensor] = field(default_factory=dict)
    factor: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    kl_coef: float = 0.0


@dataclass
class LossOutputs:
    """`loss` to backpropagate; `aggregated`, the detached loss before `divisor` (logged as `policy_loss`); the
    per-token loss; the loss's stats; the per-token KL (None without it)."""

    loss: torch.Tensor
    aggregated: torch.Tensor
    per_token_loss: torch.Tensor
    stats: dict[str, torch.Tensor]
    per_token_kl: torch.Tensor | None


def assembled_loss(
    policy_loss: PolicyLoss,
    inputs: AssemblyInputs,
    args,
    step: int,
    epsilon_low: float,
    epsilon_high: float,
    normalizer: float | torch.Tensor | None,
    divisor: float = 1.0,
) -> LossOutputs:
    """The registered `policy_loss` of one micro-batch at optimizer step `step` (see the module docstring)."""
    per_token_loss, stats = policy_loss(
        PolicyLossInputs(
            inputs.log_probs,
            inputs.old_log_probs,
            inputs.advantages,
            inputs.mask,
            args,
            step=step,
            epsilon_low=epsilon_low,
            epsilon_high=epsilon_high,
            entropies=inputs.entropies,
            draws=inputs.draws,
        )
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
    return LossOutputs(loss, aggregated.detach(), per_token_loss, stats, per_token_kl)


def log_loss_metrics(
    metrics: dict[str, list],
    accelerator,
    policy_loss: PolicyLoss,
    stats: dict[str, torch.Tensor],
    mask: torch.Tensor,
    *sums: torch.Tensor,
) -> tuple[list[float], float]:
    """Append the loss's metric ratios (`PolicyLoss.logged_metrics`) of one micro-batch, summed over ranks, to
    `metrics`; returns the other `sums` (scalars: entropy, loss, KL ...) and the action tokens, summed over ranks.
    One reduction and one device-to-host copy for everything: each `.item()` would stall a GPU on its own."""
    logged = policy_loss.logged_metrics(stats)
    columns = [metric_sums(logged, stats, mask).to(mask.device), mask.float().sum().view(1)]
    columns += [value.float().view(1) for value in sums]
    totals = accelerator.reduce(torch.cat([column.float() for column in columns]), reduction="sum").tolist()
    width = 2 * len(logged)
    for name, pair in metric_pairs(logged, totals[:width]).items():
        metrics[name].append(pair)
    return totals[width + 1 :], totals[width]
