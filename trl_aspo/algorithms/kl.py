"""The per-token KL term of the loss: TRL's k3 estimator, optionally clamped as the ASPO reference's verl does."""

from __future__ import annotations

import torch

# verl's `kl_penalty(..., "low_var_kl")` clamps the log-ratio before the exponential (Archer2.0,
# verl/trainer/ppo/core_algos.py): exp(20) is finite in float32, and a clamped k3 then has a zero gradient, not NaN.
VERL_LOG_RATIO_CLAMP = 20.0


def k3_kl(ref_logps: torch.Tensor, logps: torch.Tensor, clamp: float | None = None) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref): k3 = exp(r) - r - 1 with r = log pi_ref - log pi (elementwise).

    `clamp=None` is TRL's expression unchanged (GRPOTrainer._compute_loss). `clamp=c` is verl's `low_var_kl`, the
    ASPO reference's KL loss: r clipped to [-20, 20], then k3 clipped to [-c, c] (k3 >= 0, so only c binds)."""
    log_ratio = ref_logps - logps
    if clamp is None:
        return torch.exp(log_ratio) - log_ratio - 1
    log_ratio = log_ratio.clamp(-VERL_LOG_RATIO_CLAMP, VERL_LOG_RATIO_CLAMP)
    return (torch.exp(log_ratio) - log_ratio - 1).clamp(-clamp, clamp)
