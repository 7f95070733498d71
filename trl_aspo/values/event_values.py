"""SPO++ event-time values for asynchronous rollouts (SPO++, arXiv 2608.24870; docs/design.md section 4).

The policy event of a sample is the model version ``z`` that generated it. The value of prompt ``x`` for a sample
generated at version ``z`` is ``v(x, z) = alpha / (alpha + beta)`` with::

    alpha = rho^(z - z0) * alpha_0 + sum_{i visible, z_i < z} rho^(z - z_i) * R_i
    beta  = rho^(z - z0) * beta_0  + sum_{i visible, z_i < z} rho^(z - z_i) * (1 - R_i)

over the outcomes of ``x`` observed so far whose generating version is strictly earlier than ``z``: a sample never
sees its own outcome nor any outcome generated at its version or later (its weight would exceed 1). Outcomes of the
same version as the sample do not count even where they were scored before its dispatch (SPO++'s eq. 3 counts
those with weight 1): the trainer holds same-version outcomes by arrival order, not by dispatch, so counting them
would make the value order-dependent; with the worker draining at publish (`drain_on_publish`) every outcome of an
earlier version is in before version ``z`` generates, so the value is the synchronous tracker's at event ``z``
(docs/async.md, "The SPO++ asynchronous recipe"). The prior
``(alpha_0, beta_0)`` is anchored at the prompt's entry event ``z0``: the earliest version at which the prompt was
entered (:meth:`AsyncEventValues.enter`, called for every sample before it is scored), or the ``event`` of an
initialization from counts. The asynchronous trainer enters each sample with its prompt's first dispatch version,
which the rollout worker records when it hands the prompt out (trl_aspo.infra.prompt_stream), so ``z0`` is fixed before
any sample of the prompt arrives. The value is a function of the *set* of visible outcomes and entered versions,
never of the order in which they arrived. In the synchronous limit (version ``q`` scored after every outcome of
versions ``< q`` was observed) it equals :class:`trl_aspo.values.event_tracker.EventValueTracker` at dispatch event
``q``.

Numerics: the ratio does not depend on a common factor, so it is evaluated relative to the newest contributing event
``r <= z`` (every weight ``rho^(r - .) <= 1``, the newest 1): no ``rho^-z`` blow-up, and no 0/0 after long gaps.

Memory: outcomes older than the staleness horizon (``model_version - max_staleness``; TRL drops samples older than
that, so no later query can have ``z`` below it) are folded into one aggregate per prompt by :meth:`advance`;
only outcomes inside the window are kept one by one. State is plain Python floats (IEEE float64).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from trl_aspo.values.beta_counts import (
    PRIOR_ALPHA,
    PRIOR_BETA,
    Numbers,
    jeffreys_prior,
    validate_pseudo_counts,
    validate_rewards,
)
from trl_aspo.values.state_checks import (
    MAX_COUNT,
    check_entry,
    check_event,
    check_pseudo_counts,
    check_reward,
    check_rho,
    check_visits,
    state_mapping,
)


def check_async_event_values_state(state_dict: dict[str, Any], where: str = "tracker") -> None:
    """Validate an `AsyncEventValues.state_dict()` before it is restored, with the checks its methods apply on the
    way in: rho in (0, 1]; an integer horizon; per key a prior `[alpha_0, beta_0, version]` as `set_pseudo_counts`
    accepts; a folded aggregate `[a, b, version]` (one of a, b may be 0 after long forgetting, not both) older than
    the horizon; window outcomes `[version, reward]` with a reward in [0, 1] at or after the horizon; integer
    versions and visits in [0, 2**53]. Raises ValueError naming `where`, the field and the prompt key."""
    if state_dict.get("type") != "AsyncEventValues":
        raise ValueError(f"{where} is not an AsyncEventValues state (type={state_dict.get('type')!r}).")
    check_rho(state_dict, where)
    horizon = state_dict.get("horizon")
    if isinstance(horizon, bool) or not isinstance(horizon, int) or not 0 <= horizon <= MAX_COUNT:
        raise ValueError(f"{where}.horizon must be an integer in [0, {MAX_COUNT}], got {horizon!r}.")
    priors = state_mapping(state_dict, "prior", where)
    for key, entry in priors.items():
        alpha, beta, version = check_entry(entry, f"{where}.prior", key, ("alpha", "beta", "version"))
        check_pseudo_counts(alpha, beta, f"{where}.prior", key)
        check_event(version, f"{where}.prior", key, "version")
    for field in ("folded", "window"):
        for key in state_mapping(state_dict, field, where):
            if key not in priors:
                raise ValueError(f"{where}.{field} of prompt key {key!r}: the key has no entry in {where}.prior.")
    for key, entry in state_mapping(state_dict, "folded", where).items():
        a, b, version = check_entry(entry, f"{where}.folded", key, ("a", "b", "version"))
        check_pseudo_counts(a, b, f"{where}.folded", key)
        check_event(version, f"{where}.folded", key, "version")
        if version >= horizon:
            raise ValueError(
                f"{where}.folded of prompt key {key!r}: version {version} must be older than the horizon {horizon} "
                "(only outcomes older than the horizon are folded)."
            )
    for key, outcomes in state_mapping(state_dict, "window", where).items():
        if not isinstance(outcomes, list):
            raise ValueError(f"{where}.window of prompt key {key!r} must be a list, got {type(outcomes).__name__}.")
        for outcome in outcomes:
            version, reward = check_entry(outcome, f"{where}.window", key, ("version", "reward"))
            check_event(version, f"{where}.window", key, "version")
            if version < horizon:
                raise ValueError(
                    f"{where}.window of prompt key {key!r}: version {version} is older than the horizon {horizon} "
                    "(such outcomes are folded)."
                )
            check_reward(reward, f"{where}.window", key)
    check_visits(state_dict, where, required=True)


def _check_version(version: int, name: str = "version") -> int:
    if isinstance(version, bool) or int(version) != version or version < 0:
        raise ValueError(f"`{name}` must be a non-negative integer model version, got {version!r}.")
    return int(version)


def _versions(versions: Sequence[int] | torch.Tensor | int, n: int) -> list[int]:
    if isinstance(versions, torch.Tensor):
        if versions.is_floating_point() or versions.is_complex():
            raise ValueError(f"`versions` must hold integers, got dtype {versions.dtype}.")
        versions = versions.reshape(-1).tolist()
    if isinstance(versions, int):
        versions = [versions] * n
    if len(versions) != n:
        raise ValueError(f"`versions` has {len(versions)} entries but `keys` has {n}; they must match.")
    return [_check_version(v, "versions") for v in versions]


class AsyncEventValues:
    """Per-prompt SPO++ values ``v(x, z)`` for samples that arrive out of order and stale (see module docstring).

    Per key: the prior ``[alpha_0, beta_0, z0]``; the folded aggregate ``[a, b, e]`` of every outcome older than
    the horizon (``a = sum rho^(e - z_i) R_i``, ``e`` its newest version); and the outcomes inside the window,
    ``[[z_i, R_i], ...]``.
    """

    # Evidence ages by policy events (model versions): `enter`, `value` and `observe` take them, and a prompt's prior
    # is anchored at its first dispatch (`enter`, with the version the worker stamped).
    ages_by_event = True

    def __init__(self, rho: float = 0.875) -> None:
        rho = float(rho)
        if not 0.0 < rho <= 1.0:
            raise ValueError(f"`rho` must lie in (0, 1], got {rho!r}.")
        self.rho = rho
        self.horizon = 0
        self._prior: dict[str, list[float]] = {}
        self._folded: dict[str, list[float]] = {}
        self._window: dict[str, list[list[float]]] = {}
        self._visits: dict[str, int] = {}

    @property
    def num_tracked(self) -> int:
        return len(self._prior)

    def visits(self, keys: Sequence[str]) -> torch.Tensor:
        """Number of outcomes observed per key, int64 (B,)."""
        return torch.tensor([self._visits.get(key, 0) for key in keys], dtype=torch.long)

    def enter(self, keys: Sequence[str], versions: Sequence[int] | torch.Tensor | int) -> None:
        """Anchor each key's prior at the earliest version it is entered at (Beta(0.5, 0.5) for a new key)."""
        for key, version in zip(keys, _versions(versions, len(keys)), strict=True):
            prior = self._prior.get(key)
            if prior is None:
                self._prior[key] = [PRIOR_ALPHA, PRIOR_BETA, version]
            elif version < prior[2]:
                prior[2] = version

    def value(self, keys: Sequence[str], versions: Sequence[int] | torch.Tensor | int) -> torch.Tensor:
        """``v(x, z)`` per key for samples generated at ``versions`` (float64, (B,)); 0.5 for a key never entered.

        Raises for a version below the horizon: the evidence it must exclude may already be folded."""
        values = []
        for key, z in zip(keys, _versions(versions, len(keys)), strict=True):
            if z < self.horizon:
                raise ValueError(
                    f"version {z} of prompt key {key!r} is older than the staleness horizon {self.horizon}: "
                    "samples that stale must be dropped before scoring."
                )
            prior = self._prior.get(key)
            if prior is None:
                values.append(PRIOR_ALPHA / (PRIOR_ALPHA + PRIOR_BETA))
                continue
            if prior[2] > z:
                raise ValueError(
                    f"prompt key {key!r} entered at version {int(prior[2])}, later than the queried version {z}: "
                    "enter every sample's version before scoring it."
                )
            terms = [(prior[2], prior[0], prior[1])]
            folded = self._folded.get(key)
            if folded is not None:
                terms.append((folded[2], folded[0], folded[1]))
            terms += [(zi, r, 1.0 - r) for zi, r in self._window.get(key, ()) if zi < z]
            newest = max(event for event, _, _ in terms)
            alpha = sum(self.rho ** (newest - event) * a for event, a, _ in terms)
            beta = sum(self.rho ** (newest - event) * b for event, _, b in terms)
            values.append(alpha / (alpha + beta))
        return torch.tensor(values, dtype=torch.float64)

    def observe(self, keys: Sequence[str], rewards: Numbers, versions: Sequence[int] | torch.Tensor | int) -> None:
        """Record outcomes ``rewards[i]`` in [0, 1] of samples generated at ``versions[i]``, in any order.

        A key observed before it was entered enters at its earliest version here. An outcome older than the horizon
        goes straight into the aggregate (it is visible to every later query). Inputs are validated first."""
        values = validate_rewards(keys, rewards)
        versions = _versions(versions, len(keys))
        self.enter(keys, versions)
        for key, r, z in zip(keys, values, versions, strict=True):
            self._visits[key] = self._visits.get(key, 0) + 1
            if z < self.horizon:
                self._fold(key, z, r)
            else:
                self._window.setdefault(key, []).append([z, r])

    def _fold(self, key: str, z: int, r: float) -> None:
        folded = self._folded.get(key)
        if folded is None:
            self._folded[key] = [r, 1.0 - r, z]
            return
        newest = max(folded[2], z)
        old = self.rho ** (newest - folded[2])
        new = self.rho ** (newest - z)
        self._folded[key] = [old * folded[0] + new * r, old * folded[1] + new * (1.0 - r), newest]

    def advance(self, horizon: int) -> None:
        """Fold every outcome generated before ``horizon`` (no later query has an older version) into the aggregate.

        The trainer calls it with ``model_version - max_staleness``; the horizon never moves backwards."""
        horizon = _check_version(horizon, "horizon")
        if horizon <= self.horizon:
            return
        self.horizon = horizon
        for key in list(self._window):
            keep = []
            for z, r in self._window[key]:
                if z < horizon:
                    self._fold(key, int(z), r)
                else:
                    keep.append([z, r])
            if keep:
                self._window[key] = keep
            else:
                del self._window[key]

    def init_from_counts(
        self, keys: Sequence[str], successes: Numbers, trials: Numbers, prior_strength: float = 8.0, event: int = 0
    ) -> None:
        """Set each key's prior from ``s`` successes in ``n0`` samples (Jeffreys-smoothed), anchored at ``event``."""
        event = _check_version(event, "event")
        for key, (alpha, beta) in zip(keys, jeffreys_prior(keys, successes, trials, prior_strength), strict=True):
            self._set_prior(key, alpha, beta, event)

    def set_pseudo_counts(self, keys: Sequence[str], alphas: Numbers, betas: Numbers, event: int = 0) -> None:
        """Start each key at exactly Beta(alpha, beta) anchored at ``event``."""
        event = _check_version(event, "event")
        for key, alpha, beta in zip(keys, *validate_pseudo_counts(keys, alphas, betas), strict=True):
            self._set_prior(key, alpha, beta, event)

    def _set_prior(self, key: str, alpha: float, beta: float, event: int) -> None:
        self._prior[key] = [alpha, beta, event]
        self._folded.pop(key, None)
        self._window.pop(key, None)

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state (str keys, floats, ints, lists): storable with ``torch.save`` or ``json``."""
        return {
            "type": "AsyncEventValues",
            "rho": self.rho,
            "horizon": self.horizon,
            "prior": {k: [a, b, int(z)] for k, (a, b, z) in self._prior.items()},
            "folded": {k: [a, b, int(z)] for k, (a, b, z) in self._folded.items()},
            "window": {k: [[int(z), r] for z, r in w] for k, w in self._window.items()},
            "visits": dict(self._visits),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state produced by :meth:`state_dict` exactly, after `check_async_event_values_state`."""
        check_async_event_values_state(state_dict)
        self.rho = float(state_dict["rho"])
        self.horizon = int(state_dict["horizon"])
        self._prior = {k: [float(a), float(b), int(z)] for k, (a, b, z) in state_dict["prior"].items()}
        self._folded = {k: [float(a), float(b), int(z)] for k, (a, b, z) in state_dict["folded"].items()}
        self._window = {k: [[int(z), float(r)] for z, r in w] for k, w in state_dict["window"].items()}
        self._visits = {k: int(n) for k, n in state_dict["visits"].items()}
