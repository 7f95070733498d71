"""SPO's tracker (Xu & Ding 2025, arXiv 2509.13232; docs/design.md section 3): evidence ages per *visit*. Every
observed outcome ``R`` of a prompt applies::

    alpha <- rho * alpha + R,   beta <- rho * beta + (1 - R)

with ``rho`` either a constant (0.875) or KL-adaptive (trl_aspo.values.kl_rho). The value
``v_x = alpha / (alpha + beta)`` is read (and frozen) when the prompt is dispatched. Updates apply in arrival order, so
with asynchronous rollouts the state reached depends on that order, by construction. Pseudo-counts and their
initialization: trl_aspo.values.beta_counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from trl_aspo.values.beta_counts import (
    PRIOR_ALPHA,
    PRIOR_BETA,
    Numbers,
    as_float_list,
    jeffreys_prior,
    validate_pseudo_counts,
    validate_rewards,
    validate_rho,
)
from trl_aspo.values.state_checks import check_entry, check_pseudo_counts, check_visits, state_mapping


def check_visit_tracker_state(state_dict: dict[str, Any], where: str = "tracker") -> None:
    """Validate a `VisitValueTracker.state_dict()` before it is restored: per key `[alpha, beta]` as
    `set_pseudo_counts` accepts, visits integers in [0, 2**53]. Raises ValueError naming `where`, the field and the
    prompt key."""
    if state_dict.get("type") != "VisitValueTracker":
        raise ValueError(f"{where} is not a VisitValueTracker state (type={state_dict.get('type')!r}).")
    for key, entry in state_mapping(state_dict, "state", where).items():
        alpha, beta = check_entry(entry, f"{where}.state", key, ("alpha", "beta"))
        check_pseudo_counts(alpha, beta, f"{where}.state", key)
    check_visits(state_dict, where, required=False)


class VisitValueTracker:
    """SPO tracker: per observation ``alpha <- rho*alpha + R``, ``beta <- rho*beta + (1 - R)``.

    ``rho`` is given per call (a float, or one value per outcome e.g. from :func:`kl_adaptive_rho`). Keys that
    appear several times in one call are updated sequentially in the given order. Unseen keys start at
    Beta(0.5, 0.5).
    """

    # No policy event: evidence ages per visit (`observe` takes rho), nothing is anchored at a first dispatch.
    ages_by_event = False

    def __init__(self) -> None:
        # key -> [alpha, beta]
        self._state: dict[str, list[float]] = {}
        # key -> number of outcomes observed (visits)
        self._visits: dict[str, int] = {}

    @property
    def num_tracked(self) -> int:
        """Number of keys with stored state (an initialized prior or at least one observation)."""
        return len(self._state)

    def visits(self, keys: Sequence[str]) -> torch.Tensor:
        """Number of outcomes observed per key (its visits; an initialized prior is not a visit), int64 (B,)."""
        return torch.tensor([self._visits.get(key, 0) for key in keys], dtype=torch.long)

    def pseudo_counts(self, keys: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(alpha, beta)`` (float64, shape (B,))."""
        pairs = [self._state.get(k, (PRIOR_ALPHA, PRIOR_BETA)) for k in keys]
        return (
            torch.tensor([p[0] for p in pairs], dtype=torch.float64),
            torch.tensor([p[1] for p in pairs], dtype=torch.float64),
        )

    def value(self, keys: Sequence[str]) -> torch.Tensor:
        """Return the values ``alpha / (alpha + beta)`` (float64, shape (B,))."""
        alpha, beta = self.pseudo_counts(keys)
        return alpha / (alpha + beta)

    def observe(self, keys: Sequence[str], rewards: Numbers, rho: float | Numbers) -> None:
        """Apply the SPO update for each ``(keys[i], rewards[i])`` with forgetting factor ``rho`` (or ``rho[i]``)."""
        values = validate_rewards(keys, rewards)
        rhos = [validate_rho(x) for x in as_float_list(rho, len(keys), "rho")]
        for key, r, decay in zip(keys, values, rhos, strict=True):
            self._visits[key] = self._visits.get(key, 0) + 1
            entry = self._state.setdefault(key, [PRIOR_ALPHA, PRIOR_BETA])
            entry[0] = decay * entry[0] + r
            entry[1] = decay * entry[1] + (1.0 - r)

    def init_from_counts(
        self, keys: Sequence[str], successes: Numbers, trials: Numbers, prior_strength: float = 8.0
    ) -> None:
        """Set each key's prior from ``s`` successes in ``n0`` samples (Jeffreys-smoothed); replaces existing state."""
        for key, (alpha, beta) in zip(keys, jeffreys_prior(keys, successes, trials, prior_strength), strict=True):
            self._state[key] = [alpha, beta]

    def set_pseudo_counts(self, keys: Sequence[str], alphas: Numbers, betas: Numbers) -> None:
        """Start each key at exactly Beta(alpha, beta) (e.g. counts exported from a checkpoint by ``trl-aspo
        values``); replaces any state held for those keys."""
        for key, alpha, beta in zip(keys, *validate_pseudo_counts(keys, alphas, betas), strict=True):
            self._state[key] = [alpha, beta]

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state (str keys, floats, lists): storable with ``torch.save`` or ``json``."""
        return {
            "type": "VisitValueTracker",
            "state": {k: list(v) for k, v in self._state.items()},
            "visits": dict(self._visits),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state produced by :meth:`state_dict` exactly (replacing the current state), after the checks of
        the tracker's own methods (ValueError naming the field and the prompt key)."""
        check_visit_tracker_state(state_dict)
        self._state = {k: [float(a), float(b)] for k, (a, b) in state_dict["state"].items()}
        self._visits = {k: int(n) for k, n in state_dict.get("visits", {}).items()}
