"""`loss_type="aspo"`: the asymmetric IS loss (Wang et al. 2025, arXiv 2510.06062) as one policy-loss registration.

The per-token term is `trl_aspo.algorithms.losses.asymmetric_policy_loss` (its docstring holds the table of values and
gradient weights), configured by the `aspo_*` fields of the trainer's config: the soft dual-clip constants, the
entropy-split offsets (`aspo_entropy_quantile`), the progressive flip threshold at the optimizer step, and the
unflipped mix (`aspo_unflipped_fraction`, drawn once per batch by `draw_unflipped`). Its entry also carries its
weight for the weight map, its `aspo/*` metrics and its citation.
"""

from __future__ import annotations

import torch

from trl_aspo.algorithms.losses import (
    asymmetric_policy_loss,
    entropy_split_mask,
    progressive_flip_threshold,
    unflipped_sample_mask,
)
from trl_aspo.algorithms.papers import ASPO_PAPER
from trl_aspo.algorithms.policy_losses import PolicyLossInputs, RatioMetric, register_policy_loss
from trl_aspo.algorithms.weight_map import aspo_weight

# Shares of action tokens in each clip region, and the mean gradient weight of the flipped tokens.
ASPO_METRICS = (
    *(
        RatioMetric(f"aspo/{stat}_frac", stat)
        for stat in ("hard_clip_pos", "hard_clip_neg", "dual_clip_pos", "dual_clip_neg", "flipped")
    ),
    RatioMetric("aspo/flip_weight_mean", "flip_weight", "flipped"),
)


def draw_unflipped(advantages: torch.Tensor, args, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """`aspo_unflipped_fraction` of the positive-advantage samples (B,), kept on the standard ratio."""
    if args.aspo_unflipped_fraction <= 0:
        return {}
    return {"unflipped": unflipped_sample_mask(advantages, args.aspo_unflipped_fraction, generator)}


def aspo_token_weight(stats: dict[str, torch.Tensor], advantages: torch.Tensor, args) -> torch.Tensor:
    dual_clip_neg = args.aspo_dual_clip if args.aspo_dual_clip_neg is None else args.aspo_dual_clip_neg
    return aspo_weight(stats, advantages, dual_clip_neg)


@register_policy_loss(
    "aspo",
    draw=draw_unflipped,
    weight=aspo_token_weight,
    metrics=ASPO_METRICS,
    on_policy_warning=(
        "every optimizer step is on-policy (ratio 1), where the flip changes nothing and the loss equals TRL's. Set "
        "num_iterations > 1 or steps_per_generation > gradient_accumulation_steps (several mini-batches per rollout, "
        "as the reference) to make it act."
    ),
    papers=(ASPO_PAPER,),
    reads_fields="aspo_",
)
def aspo_policy_loss(inputs: PolicyLossInputs):
    args = inputs.args
    high_entropy = None
    if args.aspo_entropy_quantile is not None:
        high_entropy = entropy_split_mask(inputs.entropies, inputs.mask, args.aspo_entropy_quantile)
    return asymmetric_policy_loss(
        inputs.log_probs,
        inputs.old_log_probs,
        inputs.advantages,
        epsilon_low=inputs.epsilon_low,
        epsilon_high=inputs.epsilon_high,
        dual_clip=args.aspo_dual_clip,
        dual_clip_pos=args.aspo_dual_clip_pos,
        dual_clip_neg=args.aspo_dual_clip_neg,
        high_entropy_mask=high_entropy,
        epsilon_low_high_entropy=args.aspo_epsilon_high_entropy,
        epsilon_high_high_entropy=args.aspo_epsilon_high_entropy,
        flip_threshold=progressive_flip_threshold(
            inputs.step, args.aspo_flip_threshold_start, args.aspo_flip_decay_steps
        ),
        unflipped_mask=inputs.draws.get("unflipped"),
    )
