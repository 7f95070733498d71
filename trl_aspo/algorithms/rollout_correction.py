r"""Rollout importance-sampling correction of the decoupled objective (docs/async.md, "Off-policy correction").

Three policies meet in an asynchronous step (AReaL's decoupled PPO; verl's "decoupled" rollout correction): the
behaviour policy ``pi_b`` that sampled a token (the generator, up to `max_staleness` versions old, another engine),
the proximal policy ``pi_prox`` (the trainer's parameters at the start of the optimizer step that trains the sample)
and the current policy ``pi_theta``. The decoupled loss takes its ratio against ``pi_prox`` and multiplies the
per-token loss by a gradient-free weight ``c = f(rho)``, ``rho = pi_prox / pi_b``:

    token modes:     rho_t = exp(lp_prox_t - lp_b_t)                     one weight per action token
    sequence modes:  rho   = exp(sum_t (lp_prox_t - lp_b_t))            one weight per completion (its action tokens)
    *_truncate:      c = clamp(rho, C_min, C_max)                        (either bound None: open)
    *_mask:          c = rho if C_min <= rho <= C_max else 0

exactly as TRL's `GRPOConfig.vllm_importance_sampling_{mode,clip_min,clip_max}` define them for the synchronous
trainer (`GRPOTrainer._generate_and_score_completions`); IcePop (Zheng et al. 2025) is `token_mask` with both bounds,
and the SPO++ asynchronous recipe (arXiv 2608.24870, Table 3) `token_truncate` with `C_max = 2`. A token whose
behaviour log-prob is NaN (unavailable) gets ``rho = 1``, as in TRL. The log-ratio is clamped to [-20, 20] so the
exponential stays finite (a bound that narrow changes no weight a finite clip bound allows).

:func:`correction_sums` gives the diagnostics users compare across frameworks, as sums that add over micro-batches and
ranks: the weight's mean, the effective sample size fraction ``(sum c)^2 / (n sum c^2)``, the share of tokens
truncated or masked by the sign of the advantage, and the mean ``|log rho|`` (the train/inference mismatch).
"""

from __future__ import annotations

import math

import torch

CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
LOG_RATIO_CLAMP = 20.0
# The order of `correction_sums`' columns.
CORRECTION_SUM_NAMES = (
    "weight",
    "weight_squared",
    "tokens",
    "positive_tokens",
    "negative_tokens",
    "changed_positive",
    "changed_negative",
    "abs_log_ratio",
)


def rollout_correction_weight(
    proximal_log_probs: torch.Tensor,
    behaviour_log_probs: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The correction weight ``c`` (B, T), detached, where each token was truncated or masked (B, T) bool, and the
    per-token log-ratio ``log rho_t`` (B, T) (0 outside `mask`). A sequence mode gives every token of a completion
    its completion's weight."""
    if mode not in CORRECTION_MODES:
        raise ValueError(f"`mode` must be one of {CORRECTION_MODES}, got {mode!r}.")
    if proximal_log_probs.shape != behaviour_log_probs.shape or proximal_log_probs.shape != mask.shape:
        raise ValueError(
            "`proximal_log_probs`, `behaviour_log_probs` and `mask` must share a (B, T) shape, got "
            f"{tuple(proximal_log_probs.shape)}, {tuple(behaviour_log_probs.shape)} and {tuple(mask.shape)}."
        )
    if clip_min is not None and clip_max is not None and clip_min > clip_max:
        raise ValueError(f"`clip_min` ({clip_min}) must not exceed `clip_max` ({clip_max}).")
    mask = mask.bool()
    token_log_ratio = (proximal_log_probs.detach().float() - behaviour_log_probs.detach().float()).nan_to_num(0.0)
    token_log_ratio = token_log_ratio.masked_fill(~mask, 0.0)
    log_ratio = token_log_ratio.sum(-1, keepdim=True) if mode.startswith("sequence") else token_log_ratio
    ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    outside = (ratio < low) | (ratio > high)
    weight = ratio.masked_fill(outside, 0.0) if mode.endswith("mask") else ratio.clamp(min=low, max=high)
    shape = proximal_log_probs.shape
    return weight.expand(shape), outside.expand(shape) & mask, token_log_ratio


def correction_sums(
    weight: torch.Tensor, changed: torch.Tensor, log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """(8,) float64 sums over the action tokens, in the order of `CORRECTION_SUM_NAMES`: sum c, sum c^2, tokens,
    tokens with A > 0 and A < 0, truncated-or-masked tokens with A > 0 and A < 0, sum |log rho_t|. `advantages` is
    (B,) or (B, T)."""
    mask = mask.bool()
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    positive, negative = (advantages > 0) & mask, (advantages < 0) & mask
    weight = weight.double().masked_fill(~mask, 0.0)
    columns = [
        weight.sum(),
        (weight * weight).sum(),
        mask.sum(),
        positive.sum(),
        negative.sum(),
        (changed & positive).sum(),
        (changed & negative).sum(),
        log_ratio.double().abs().masked_fill(~mask, 0.0).sum(),
    ]
    return torch.stack([column.double() for column in columns])


def correction_metrics(sums: list[float]) -> dict[str, float]:
    """The `offpolicy/*` metrics of (rank- and micro-batch-summed) `correction_sums`; none without action tokens, and
    a sign's clipped share only where that sign has tokens."""
    total = dict(zip(CORRECTION_SUM_NAMES, sums, strict=True))
    tokens = total["tokens"]
    if tokens <= 0:
        return {}
    metrics = {
        "offpolicy/is_weight_mean": total["weight"] / tokens,
        "offpolicy/ess": total["weight"] ** 2 / (tokens * total["weight_squared"]) if total["weight_squared"] else 0.0,
        "offpolicy/log_ratio_abs_mean": total["abs_log_ratio"] / tokens,
    }
    for sign in ("positive", "negative"):
        if total[f"{sign}_tokens"] > 0:
            metrics[f"offpolicy/clipped_frac_{sign[:3]}"] = total[f"changed_{sign}"] / total[f"{sign}_tokens"]
    return metrics
