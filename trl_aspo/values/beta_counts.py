"""Beta pseudo-counts, the bookkeeping every per-prompt value tracker shares (SPO, Xu & Ding 2025, arXiv 2509.13232;
SPO++, arXiv 2608.24870; docs/design.md section 3).

Each prompt ``x`` (identified by a string key, see :mod:`trl_aspo.values.prompt_ids`) carries a Beta(alpha, beta)
belief about its success rate; its value is ``v_x = alpha / (alpha + beta)`` and the advantage of a completion with
reward ``R`` is ``A = R - v_x``. Rewards must lie in [0, 1]; fractional rewards act as fractional pseudo-counts.
Prompts with no data start at the Jeffreys prior Beta(0.5, 0.5) (value 0.5).

Jeffreys-smoothed initialization from ``s`` successes in ``n0`` samples (:func:`jeffreys_prior`, every tracker's
``init_from_counts``)::

    alpha_0 = N0 * (s + 0.5) / (n0 + 1),   beta_0 = N0 * (n0 - s + 0.5) / (n0 + 1)

with ``N0 = 1/(1 - rho)`` by default (:func:`default_prior_strength`; ``rho_min`` for KL-adaptive rho, 8 at 0.875):
the effective evidence ``alpha + beta`` a prompt carries in steady state under forgetting ``rho``.

All state is kept in Python floats (IEEE float64) and values are returned as ``torch.float64`` tensors: the trackers
are bookkeeping, not model math, and float64 keeps the SPO++ sums order-invariant to ~1e-15.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

PRIOR_ALPHA = 0.5
PRIOR_BETA = 0.5

Numbers = torch.Tensor | Sequence[float]


def as_float_list(values: Numbers | float, n: int, name: str) -> list[float]:
    """Convert a tensor/sequence (or scalar, broadcast to ``n``) to a list of Python floats of length ``n``."""
    if isinstance(values, torch.Tensor) and values.dim() == 0:
        values = values.item()
    if isinstance(values, int | float):
        return [float(values)] * n
    out = torch.as_tensor(values, dtype=torch.float64).reshape(-1).tolist()
    if len(out) != n:
        raise ValueError(f"`{name}` has {len(out)} entries but `keys` has {n}; they must match one to one.")
    return out


def validate_rewards(keys: Sequence[str], rewards: Numbers) -> list[float]:
    """Check rewards are finite and in [0, 1] before any state changes, so a bad batch leaves the tracker intact."""
    if isinstance(rewards, torch.Tensor) and rewards.dim() > 1:
        raise ValueError(f"`rewards` must be 1-D (one reward per key), got shape {tuple(rewards.shape)}.")
    if not isinstance(rewards, torch.Tensor):
        for key, r in zip(keys, rewards, strict=False):
            if r is None:
                raise ValueError(f"reward None for prompt key {key!r}: filter out None/NaN rewards before observe().")
    values = as_float_list(rewards, len(keys), "rewards")
    for key, r in zip(keys, values, strict=True):
        if math.isnan(r):
            raise ValueError(
                f"reward nan for prompt key {key!r}: filter out NaN/None rewards (e.g. from reward functions "
                "that abstain) before calling observe()."
            )
        if not 0.0 <= r <= 1.0:
            raise ValueError(
                f"reward {r!r} for prompt key {key!r} is outside [0, 1]; the Beta tracker treats rewards as "
                "(fractional) success counts, so map rewards into [0, 1] first."
            )
    return values


def jeffreys_prior(
    keys: Sequence[str], successes: Numbers, trials: Numbers, prior_strength: float
) -> list[tuple[float, float]]:
    """Jeffreys-smoothed pseudo-counts ``N0*(s+0.5)/(n0+1)``, ``N0*(n0-s+0.5)/(n0+1)`` per key."""
    if not (math.isfinite(prior_strength) and prior_strength > 0):
        raise ValueError(f"`prior_strength` must be a positive finite number, got {prior_strength!r}.")
    s_list = as_float_list(successes, len(keys), "successes")
    n_list = as_float_list(trials, len(keys), "trials")
    counts = []
    for key, s, n0 in zip(keys, s_list, n_list, strict=True):
        if not n0 >= 1:
            raise ValueError(f"trials {n0!r} for prompt key {key!r} must be >= 1.")
        if not 0 <= s <= n0:
            raise ValueError(f"successes {s!r} for prompt key {key!r} must lie in [0, trials={n0!r}].")
        scale = prior_strength / (n0 + 1.0)
        counts.append((scale * (s + 0.5), scale * (n0 - s + 0.5)))
    return counts


def validate_pseudo_counts(keys: Sequence[str], alphas: Numbers, betas: Numbers) -> tuple[list[float], list[float]]:
    alpha_list = as_float_list(alphas, len(keys), "alphas")
    beta_list = as_float_list(betas, len(keys), "betas")
    for key, alpha, beta in zip(keys, alpha_list, beta_list, strict=True):
        if not (math.isfinite(alpha) and math.isfinite(beta) and alpha >= 0 and beta >= 0 and alpha + beta > 0):
            raise ValueError(
                f"pseudo-counts alpha={alpha!r}, beta={beta!r} for prompt key {key!r} must be finite, >= 0 and not "
                "both 0."
            )
    return alpha_list, beta_list


def default_prior_strength(rho: float) -> float:
    """Default prior pseudo-count ``N0 = 1 / (1 - rho)`` (SPO, arXiv 2509.13232; SPO++, arXiv 2608.24870).

    ``1 / (1 - rho) = sum_k rho^k`` is the steady-state evidence ``alpha + beta`` of a prompt observed once per
    visit (or event) under forgetting ``rho``, so the prior weighs as much as the evidence that will replace it.
    ``rho`` is ``rho_min`` for KL-adaptive forgetting and the constant ``rho`` otherwise; ``rho = 1`` (no forgetting)
    has no finite default.
    """
    rho = validate_rho(rho)
    if rho == 1.0:
        raise ValueError("rho = 1 (no forgetting) has no default prior strength 1/(1 - rho); set it explicitly.")
    return 1.0 / (1.0 - rho)


def validate_rho(rho: float, name: str = "rho") -> float:
    rho = float(rho)
    if not 0.0 < rho <= 1.0:
        raise ValueError(f"`{name}` must lie in (0, 1], got {rho!r}.")
    return rho
