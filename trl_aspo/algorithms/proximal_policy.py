r"""The proximal policy of the decoupled objective over a rollout batch (docs/async.md; DESIGN section 5).

With `steps_per_rollout_batch = k`, the asynchronous trainer trains one rollout batch in k optimizer steps, one
mini-batch each (verl's `ppo_mini_batch_size`, AReaL's `ppo_n_minibatches`), and the decoupled loss takes its ratio
against ``pi_prox``, the policy at the batch start. Everything is on **the optimizer-step clock**: ``s_b`` is the
global step at which a sample's behaviour version was published, ``s_prox`` the global step at the batch start and
``s_theta = s_prox + j`` at the batch's step j (j = 0 .. k-1). TRL's `model_version` counts publications and is never
the current step.

- `recompute` (exact): ``log pi_prox`` is recorded by a no-grad forward of the batch's mini-batches under the
  parameters at its start (the trainer's `record_proximal_log_probs`); step 0 reuses its own forward, detached.
- `loglinear` (AReaL `prox_logp_method: loglinear`; A-3PO, arXiv 2512.06547), no extra forward::

      log pi_prox = log pi_b + alpha (sg(log pi_theta) - log pi_b)
      alpha = 1                                                     at j = 0 (exactly `recompute`)
      alpha = clamp((s_prox - s_b) / (s_theta - s_b), 0, 1)         at j >= 1 (s_b > s_prox counts as s_prox)

  so the proximal log-ratio is ``log r = (1 - alpha)(log pi_theta - log pi_b)``: under linear drift in the step it
  tracks the j steps since the batch start, while what is not drift (the engines' numeric mismatch) enters with weight
  ``j / (s + j)``, ``s = s_prox - s_b``; a sample of the batch-start version (``s = 0``) has ``pi_prox = pi_b`` on
  every later step (the bypass ratio). One version per sample (its dispatch version): exact only when no completion
  spans a publication. AReaL's code takes ``v_prox = v_theta - 1`` with alpha 0 when ``v_b >= v_prox``; that guard
  makes step 0 inexact and is not followed here.

`proximal_sums` gives the per-step diagnostics as sums that add over micro-batches and ranks: the mean
``|log pi_theta - log pi_prox|``, PPO's KL as verl's k1 ``mean(log pi_prox - log pi_theta)`` (AReaL logs the opposite
sign, TRL a k3 under `kl`), and PPO's clip fraction on the proximal ratio (tokens where the clip binds: ``A > 0, r >
1 + eps_high`` or ``A < 0, r < 1 - eps_low``, as verl's `pg_clipfrac`).
"""

from __future__ import annotations

import torch

PROXIMAL_POLICIES = ("recompute", "loglinear")
# The order of `proximal_sums`' columns.
PROXIMAL_SUM_NAMES = ("tokens", "abs_log_ratio", "k1", "clipped")


def loglinear_alpha(behaviour_steps: torch.Tensor, batch_start_step: int, step_in_batch: int) -> torch.Tensor:
    """Each sample's interpolation weight (float64, same shape as `behaviour_steps`, the ``s_b`` of each sample) at
    step `step_in_batch` (j) of a rollout batch that started at global step `batch_start_step` (``s_prox``)."""
    if step_in_batch < 0:
        raise ValueError(f"`step_in_batch` must be >= 0, got {step_in_batch}.")
    steps = behaviour_steps.to(torch.float64)
    if step_in_batch == 0:
        return torch.ones_like(steps)
    # A version published after the batch start cannot be in it; were it, its alpha would be 0 (pi_prox = pi_b).
    since_behaviour = (batch_start_step - steps).clamp(min=0.0)
    return since_behaviour / (since_behaviour + step_in_batch)


def loglinear_proximal_log_probs(
    behaviour_log_probs: torch.Tensor, current_log_probs: torch.Tensor, alpha: torch.Tensor
) -> torch.Tensor:
    """``log pi_b + alpha (sg(log pi_theta) - log pi_b)``, detached, in `current_log_probs`' dtype; `alpha`
    broadcasts (per token, or (B, 1) per sample)."""
    behaviour = behaviour_log_probs.to(torch.float64)
    current = current_log_probs.detach().to(torch.float64)
    return (behaviour + alpha.to(torch.float64) * (current - behaviour)).to(current_log_probs.dtype)


def proximal_sums(
    log_probs: torch.Tensor,
    proximal_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
) -> torch.Tensor:
    """(4,) float64 sums over the action tokens (`mask`, (B, T)), in `PROXIMAL_SUM_NAMES` order: tokens,
    ``|log r|``, ``log pi_prox - log pi_theta`` and tokens where PPO's clip binds, ``r = pi_theta / pi_prox``.
    `advantages`: (B,) or (B, T)."""
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    valid = mask.bool()
    log_ratio = (log_probs.detach() - proximal_log_probs.detach()).to(torch.float64)
    ratio = torch.exp(log_ratio)
    clipped = ((advantages > 0) & (ratio > 1 + epsilon_high)) | ((advantages < 0) & (ratio < 1 - epsilon_low))
    return torch.stack(
        [
            valid.sum().to(torch.float64),
            log_ratio.abs()[valid].sum(),
            (-log_ratio)[valid].sum(),
            (clipped & valid).sum().to(torch.float64),
        ]
    )


def proximal_metrics(sums: list[float]) -> dict[str, tuple[float, float]]:
    """The logged `(numerator, denominator)` pairs of rank-summed `proximal_sums` (none without action tokens)."""
    tokens, abs_log_ratio, k1, clipped = sums
    if tokens <= 0:
        return {}
    return {
        "offpolicy/proximal_log_ratio_abs_mean": (abs_log_ratio, tokens),
        "ppo/approx_kl": (k1, tokens),
        "ppo/clip_frac": (clipped, tokens),
    }
