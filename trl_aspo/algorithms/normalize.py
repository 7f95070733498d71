"""Advantage normalization over a whole generation batch (gathered across ranks) for single-stream training.

With a per-prompt tracker baseline (see :mod:`trl_aspo.values.visit_tracker`, :mod:`trl_aspo.values.event_tracker`)
there are no groups, so advantages ``A_i = R_i - v_x`` are normalized over the whole batch instead:

* :func:`batch_normalize` -- SPO (Xu & Ding 2025, arXiv 2509.13232)::

      A~_i = (A_i - mean(A)) / (std(A) + eps),   std with the unbiased (n - 1) divisor

* :func:`token_measure_normalize` -- SPO++ (arXiv 2608.24870), under the action-token measure with ``L_i`` the
  number of action tokens of completion ``i``::

      mu      = sum(L_i * A_i) / sum(L_i)
      sigma^2 = sum(L_i * (A_i - mu)^2) / (sum(L_i) - 1)
      A~_i    = (A_i - mu) / (sigma + eps)

  With a token-mean loss every action token of completion ``i`` carries ``A~_i``, so the advantage the actor
  sees is centered over tokens: ``sum(L_i * A~_i) = 0``.

Degenerate batches, where the spread is undefined, are centered but not scaled: a single completion
(``n == 1``) or a total of at most one action token (``sum(L) <= 1``) returns ``A - mean``; a batch with no action
tokens at all returns zeros (no token would receive the advantage anyway). Outputs keep the input dtype.
"""

from __future__ import annotations

import torch


def _check_advantages(advantages: torch.Tensor) -> None:
    if not isinstance(advantages, torch.Tensor) or advantages.dim() != 1:
        shape = tuple(advantages.shape) if isinstance(advantages, torch.Tensor) else type(advantages).__name__
        raise ValueError(f"`advantages` must be a 1-D tensor (one value per completion), got {shape}.")
    if not advantages.is_floating_point():
        raise ValueError(f"`advantages` must be floating point, got dtype {advantages.dtype}.")


def batch_normalize(advantages: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(A - mean(A)) / (std(A) + eps)`` with the unbiased std; a single element returns ``A - mean`` (zeros)."""
    _check_advantages(advantages)
    if advantages.numel() == 0:
        return advantages.clone()
    centered = advantages - advantages.mean()
    if advantages.numel() == 1:
        return centered
    return centered / (advantages.std(unbiased=True) + eps)


def token_measure_normalize(advantages: torch.Tensor, token_counts: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Normalize ``advantages`` (B,) under the action-token measure with ``token_counts`` (B,) as weights ``L_i``.

    ``mu = sum(L A)/sum(L)``, ``sigma^2 = sum(L (A - mu)^2)/(sum(L) - 1)``, returns ``(A - mu)/(sigma + eps)``.
    ``sum(L) <= 1`` returns ``A - mu`` (zeros where ``sum(L) == 0``); counts must be finite and non-negative.
    """
    _check_advantages(advantages)
    if not isinstance(token_counts, torch.Tensor) or token_counts.shape != advantages.shape:
        shape = tuple(token_counts.shape) if isinstance(token_counts, torch.Tensor) else type(token_counts).__name__
        raise ValueError(
            f"`token_counts` must be a tensor with the shape of `advantages` {tuple(advantages.shape)}, got {shape}."
        )
    # Accumulate in at least float64: sum(L) can reach millions of tokens on a large gathered batch.
    dtype = torch.promote_types(advantages.dtype, torch.float64)
    counts = token_counts.to(dtype)
    if not torch.isfinite(counts).all() or (counts < 0).any():
        raise ValueError("`token_counts` must be finite and non-negative (action-token counts per completion).")
    total = counts.sum()
    if total <= 0:
        return torch.zeros_like(advantages)
    values = advantages.to(dtype)
    mu = (counts * values).sum() / total
    centered = values - mu
    if total <= 1:
        return centered.to(advantages.dtype)
    sigma = ((counts * centered.square()).sum() / (total - 1)).sqrt()
    return (centered / (sigma + eps)).to(advantages.dtype)
