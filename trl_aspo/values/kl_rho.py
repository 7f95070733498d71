"""SPO's KL-adaptive forgetting factor (`value_rho_mode="kl"`; SPO, Xu & Ding 2025, arXiv 2509.13232; the SPO
authors' reference code, verl-recipe ``spo/spo_ray_trainer.py``, ``_get_spo_rho``): how far the policy has moved since
a prompt's previous visit sets how much of its evidence the next outcome keeps::

    D   = sum_t m_t |lp_stored_t - lp_now_t| / sum_t m_t        (the stored completion's action tokens)
    rho = clip(2^(-D / D_half), rho_min, rho_max)

The trainer side (which completion is stored, when D is measured) is trl_aspo.trainers.visit_drift.
"""

from __future__ import annotations

import torch


def logprob_drift(logps_stored: torch.Tensor, logps_now: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Policy drift since a prompt's previous visit (SPO, arXiv 2509.13232; verl-recipe ``spo``, ``_get_spo_rho``).

    ``D = sum_t m_t |lp_stored_t - lp_now_t| / sum_t m_t`` over the stored completion's action tokens, with
    ``lp_stored`` its log-probs under the policy right after the update that used that visit and ``lp_now`` under
    the current policy. Inputs have shape (B, T); ``mask`` is 1/True on action tokens. A completion with no action
    tokens has ``D = 0``. Returns float64, shape (B,).
    """
    if logps_stored.shape != logps_now.shape or logps_stored.shape != mask.shape or logps_stored.dim() != 2:
        raise ValueError(
            "`logps_stored`, `logps_now` and `mask` must share one (B, T) shape, got "
            f"{tuple(logps_stored.shape)}, {tuple(logps_now.shape)}, {tuple(mask.shape)}."
        )
    weights = mask.to(torch.float64)
    diff = (logps_stored.detach().to(torch.float64) - logps_now.detach().to(torch.float64)).abs()
    # Zero the masked-out positions explicitly so padding log-probs (possibly inf/nan) cannot leak in.
    diff = torch.where(weights > 0, diff, torch.zeros_like(diff))
    return (diff * weights).sum(-1) / weights.sum(-1).clamp(min=1.0)


def kl_adaptive_rho(
    drift: torch.Tensor, d_half: float = 0.06, rho_min: float = 0.875, rho_max: float = 0.96
) -> torch.Tensor:
    """KL-adaptive forgetting factor per visit (SPO): ``rho = clip(2^(-D / d_half), rho_min, rho_max)``.

    ``D`` is the drift since the prompt's previous visit (:func:`logprob_drift`; ``D = 0`` on a first visit, so
    ``rho = rho_max``): a prompt whose evidence was gathered under a policy that has moved more since forgets it
    faster (``D = d_half`` halves it before clipping). Returns float64, the shape of ``drift``.
    """
    if not d_half > 0:
        raise ValueError(f"`d_half` must be positive, got {d_half!r}.")
    if not 0 < rho_min <= rho_max <= 1:
        raise ValueError(f"need 0 < rho_min <= rho_max <= 1, got rho_min={rho_min!r}, rho_max={rho_max!r}.")
    return torch.exp2(-drift.to(torch.float64) / d_half).clamp(rho_min, rho_max)
