"""Persistent per-prompt Beta value trackers for single-stream advantage estimation.

Each prompt ``x`` (identified by a string key, see :mod:`trl_aspo.values.prompt_ids`) carries a Beta(alpha, beta)
belief about its success rate; its value is ``v_x = alpha / (alpha + beta)`` and the advantage of a
completion with reward ``R`` is ``A = R - v_x`` with ``v_x`` read (and frozen) at dispatch time. Rewards
must lie in [0, 1]; fractional rewards act as fractional pseudo-counts. Prompts with no data start at the
Jeffreys prior Beta(0.5, 0.5) (value 0.5).

Two forgetting schemes are provided:

* :class:`VisitValueTracker` -- SPO (Xu & Ding 2025, arXiv 2509.13232). Evidence ages per *visit*: every
  observed outcome applies ``alpha <- rho*alpha + R`` and ``beta <- rho*beta + (1 - R)``, with ``rho``
  either a constant (0.875) or KL-adaptive (:func:`kl_adaptive_rho`).
* :class:`EventValueTracker` -- SPO++ (arXiv 2608.24870). Evidence ages by *policy events* (generation
  rounds ``q = 0, 1, 2, ...``). An outcome generated at event ``z_i`` has weight ``rho^(q - z_i)`` at
  dispatch ``q`` and the prior, initialized at event ``z0``, ages the same way::

      alpha_q = rho^(q - z0) * alpha_0 + sum_{i: z_i <= q} rho^(q - z_i) * R_i
      beta_q  = rho^(q - z0) * beta_0  + sum_{i: z_i <= q} rho^(q - z_i) * (1 - R_i)

  The sum does not depend on the order in which outcomes arrive, which matters once rollouts are
  asynchronous.

Jeffreys-smoothed initialization from ``s`` successes in ``n0`` samples (both trackers, see
``init_from_counts``): ``alpha_0 = N0*(s + 0.5)/(n0 + 1)``, ``beta_0 = N0*(n0 - s + 0.5)/(n0 + 1)`` with
``N0 = 1/(1 - rho)`` by default (:func:`default_prior_strength`; ``rho_min`` for KL-adaptive rho, 8 at 0.875): the
effective evidence ``alpha + beta`` a prompt carries in steady state under forgetting ``rho``.

SPO++ anchors a prompt's prior at the event at which the prompt enters the tracker (:meth:`EventValueTracker.enter`
at its first dispatch, or the ``event`` of ``init_from_counts`` for a pre-pass or file), so a prompt first drawn at
a late round starts from its full prior, not from one already aged by ``rho^q``.

All state is kept in Python floats (IEEE float64) and values are returned as ``torch.float64`` tensors:
the trackers are bookkeeping, not model math, and float64 keeps the SPO++ sums order-invariant to ~1e-15.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

PRIOR_ALPHA = 0.5
PRIOR_BETA = 0.5

Numbers = torch.Tensor | Sequence[float]


def _as_float_list(values: Numbers | float, n: int, name: str) -> list[float]:
    """Convert a tensor/sequence (or scalar, broadcast to ``n``) to a list of Python floats of length ``n``."""
    if isinstance(values, torch.Tensor) and values.dim() == 0:
        values = values.item()
    if isinstance(values, int | float):
        return [float(values)] * n
    out = torch.as_tensor(values, dtype=torch.float64).reshape(-1).tolist()
    if len(out) != n:
        raise ValueError(f"`{name}` has {len(out)} entries but `keys` has {n}; they must match one to one.")
    return out


def _validate_rewards(keys: Sequence[str], rewards: Numbers) -> list[float]:
    """Check rewards are finite and in [0, 1] before any state changes, so a bad batch leaves the tracker intact."""
    if isinstance(rewards, torch.Tensor) and rewards.dim() > 1:
        raise ValueError(f"`rewards` must be 1-D (one reward per key), got shape {tuple(rewards.shape)}.")
    if not isinstance(rewards, torch.Tensor):
        for key, r in zip(keys, rewards, strict=False):
            if r is None:
                raise ValueError(f"reward None for prompt key {key!r}: filter out None/NaN rewards before observe().")
    values = _as_float_list(rewards, len(keys), "rewards")
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


def _jeffreys_prior(
    keys: Sequence[str], successes: Numbers, trials: Numbers, prior_strength: float
) -> list[tuple[float, float]]:
    """Jeffreys-smoothed pseudo-counts ``N0*(s+0.5)/(n0+1)``, ``N0*(n0-s+0.5)/(n0+1)`` per key."""
    if not (math.isfinite(prior_strength) and prior_strength > 0):
        raise ValueError(f"`prior_strength` must be a positive finite number, got {prior_strength!r}.")
    s_list = _as_float_list(successes, len(keys), "successes")
    n_list = _as_float_list(trials, len(keys), "trials")
    counts = []
    for key, s, n0 in zip(keys, s_list, n_list, strict=True):
        if not n0 >= 1:
            raise ValueError(f"trials {n0!r} for prompt key {key!r} must be >= 1.")
        if not 0 <= s <= n0:
            raise ValueError(f"successes {s!r} for prompt key {key!r} must lie in [0, trials={n0!r}].")
        scale = prior_strength / (n0 + 1.0)
        counts.append((scale * (s + 0.5), scale * (n0 - s + 0.5)))
    return counts


def _validate_pseudo_counts(keys: Sequence[str], alphas: Numbers, betas: Numbers) -> tuple[list[float], list[float]]:
    alpha_list = _as_float_list(alphas, len(keys), "alphas")
    beta_list = _as_float_list(betas, len(keys), "betas")
    for key, alpha, beta in zip(keys, alpha_list, beta_list, strict=True):
        if not (math.isfinite(alpha) and math.isfinite(beta) and alpha >= 0 and beta >= 0 and alpha + beta > 0):
            raise ValueError(
                f"pseudo-counts alpha={alpha!r}, beta={beta!r} for prompt key {key!r} must be finite, >= 0 and not "
                "both 0."
            )
    return alpha_list, beta_list


# A bound on any stored count or event: integers above 2**53 are not exact in float64, and no run gets near it.
MAX_COUNT = 2**53


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT


def _mapping(state_dict: dict[str, Any], field: str, where: str, required: bool = True) -> dict[str, Any]:
    """`state_dict[field]` as a dict with string keys (an empty one when an optional field is absent)."""
    if field not in state_dict:
        if required:
            raise ValueError(f"{where}.{field} is missing.")
        return {}
    value = state_dict[field]
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        raise ValueError(f"{where}.{field} must map prompt keys (strings) to entries, got {type(value).__name__}.")
    return value


def check_entry(entry: Any, field: str, key: str, names: tuple[str, ...]) -> list:
    """`entry` as a list of len(names) items, or ValueError naming the field and the prompt key."""
    if not isinstance(entry, list | tuple) or len(entry) != len(names):
        raise ValueError(f"{field} of prompt key {key!r} must be [{', '.join(names)}], got {entry!r:.80}.")
    return list(entry)


def check_pseudo_counts(alpha: Any, beta: Any, field: str, key: str) -> None:
    """The rule of `set_pseudo_counts`: finite, >= 0 and not both 0 (one may underflow to 0 after long forgetting,
    never both: the prior or the newest outcome keeps the sum positive), so the value lies in [0, 1]."""
    if not (_is_number(alpha) and _is_number(beta)) or not (
        math.isfinite(alpha) and math.isfinite(beta) and alpha >= 0 and beta >= 0 and alpha + beta > 0
    ):
        raise ValueError(
            f"{field} of prompt key {key!r}: pseudo-counts alpha={alpha!r}, beta={beta!r} must be finite numbers, "
            ">= 0 and not both 0."
        )


def check_event(value: Any, field: str, key: str, name: str = "event", maximum: int = MAX_COUNT) -> None:
    if not _is_count(value) or value > maximum:
        raise ValueError(f"{field} of prompt key {key!r}: {name} must be an integer in [0, {maximum}], got {value!r}.")


def check_reward(value: Any, field: str, key: str) -> None:
    """The rule of `observe`: a reward is a number in [0, 1]."""
    if not _is_number(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{field} of prompt key {key!r}: reward {value!r} must be a number in [0, 1].")


def check_visits(state_dict: dict[str, Any], where: str, required: bool) -> None:
    for key, count in _mapping(state_dict, "visits", where, required).items():
        if not _is_count(count):
            raise ValueError(
                f"{where}.visits of prompt key {key!r} must be an integer in [0, {MAX_COUNT}], got {count!r}."
            )


def check_rho(state_dict: dict[str, Any], where: str) -> None:
    rho = state_dict.get("rho")
    if not _is_number(rho) or not 0.0 < rho <= 1.0:
        raise ValueError(f"{where}.rho must be a number in (0, 1], got {rho!r}.")


def check_event_tracker_state(state_dict: dict[str, Any], where: str = "tracker", max_event: int = MAX_COUNT) -> None:
    """Validate an `EventValueTracker.state_dict()` before it is restored, with the checks its methods apply on the
    way in: rho in (0, 1]; per key `[alpha, beta, event]` with pseudo-counts as `set_pseudo_counts` accepts and an
    integer event <= `max_event` (the trainer's event counter); pending outcomes `[event, reward]` with a reward in
    [0, 1] and an event after the key's reference event (the representation; an earlier one would age by rho^-k)
    and <= `max_event`; visits integers in [0, 2**53]. Raises ValueError naming `where`, the field and the key."""
    if state_dict.get("type") != "EventValueTracker":
        raise ValueError(f"{where} is not an EventValueTracker state (type={state_dict.get('type')!r}).")
    check_rho(state_dict, where)
    entries = _mapping(state_dict, "state", where)
    for key, entry in entries.items():
        alpha, beta, event = check_entry(entry, f"{where}.state", key, ("alpha", "beta", "event"))
        check_pseudo_counts(alpha, beta, f"{where}.state", key)
        check_event(event, f"{where}.state", key, maximum=max_event)
    for key, outcomes in _mapping(state_dict, "pending", where).items():
        if key not in entries:
            raise ValueError(f"{where}.pending of prompt key {key!r}: the key has no entry in {where}.state.")
        if not isinstance(outcomes, list):
            raise ValueError(f"{where}.pending of prompt key {key!r} must be a list, got {type(outcomes).__name__}.")
        for outcome in outcomes:
            event, reward = check_entry(outcome, f"{where}.pending", key, ("event", "reward"))
            check_event(event, f"{where}.pending", key, maximum=max_event)
            if event <= entries[key][2]:
                raise ValueError(
                    f"{where}.pending of prompt key {key!r}: outcome event {event} must be later than the key's "
                    f"reference event {entries[key][2]}."
                )
            check_reward(reward, f"{where}.pending", key)
    check_visits(state_dict, where, required=False)


def check_visit_tracker_state(state_dict: dict[str, Any], where: str = "tracker") -> None:
    """Validate a `VisitValueTracker.state_dict()` before it is restored: per key `[alpha, beta]` as
    `set_pseudo_counts` accepts, visits integers in [0, 2**53]. Raises ValueError naming `where`, the field and the
    prompt key."""
    if state_dict.get("type") != "VisitValueTracker":
        raise ValueError(f"{where} is not a VisitValueTracker state (type={state_dict.get('type')!r}).")
    for key, entry in _mapping(state_dict, "state", where).items():
        alpha, beta = check_entry(entry, f"{where}.state", key, ("alpha", "beta"))
        check_pseudo_counts(alpha, beta, f"{where}.state", key)
    check_visits(state_dict, where, required=False)


def default_prior_strength(rho: float) -> float:
    """Default prior pseudo-count ``N0 = 1 / (1 - rho)`` (SPO, arXiv 2509.13232; SPO++, arXiv 2608.24870).

    ``1 / (1 - rho) = sum_k rho^k`` is the steady-state evidence ``alpha + beta`` of a prompt observed once per
    visit (or event) under forgetting ``rho``, so the prior weighs as much as the evidence that will replace it.
    ``rho`` is ``rho_min`` for KL-adaptive forgetting and the constant ``rho`` otherwise; ``rho = 1`` (no forgetting)
    has no finite default.
    """
    rho = _validate_rho(rho)
    if rho == 1.0:
        raise ValueError("rho = 1 (no forgetting) has no default prior strength 1/(1 - rho); set it explicitly.")
    return 1.0 / (1.0 - rho)


def _validate_rho(rho: float, name: str = "rho") -> float:
    rho = float(rho)
    if not 0.0 < rho <= 1.0:
        raise ValueError(f"`{name}` must lie in (0, 1], got {rho!r}.")
    return rho


class EventValueTracker:
    """SPO++ tracker: evidence and prior age by policy events (generation rounds).

    Representation. Per key we store ``(alpha_e, beta_e, e)``: the pseudo-counts at the key's *reference
    event* ``e``, folding the prior and every outcome with ``z_i <= e``; plus a list of *pending* outcomes
    ``(z_i, R_i)`` with ``z_i > e``. An outcome at ``z <= e`` is added with weight ``rho^(e - z)``; moving the
    reference forward multiplies the stored counts by ``rho^(e' - e)``. Every factor is ``<= 1``, so nothing
    blows up over 10^5 events (old evidence underflows gracefully to 0 instead of ``rho^-q`` overflowing).

    Visibility. ``value(keys, event=q)`` uses exactly the prior plus the outcomes with ``z_i <= q``; outcomes
    generated at a later event than ``q`` stay pending and are not visible. Pending outcomes are folded
    into the stored counts when a query at ``q >= z_i`` happens, so the reference event only moves to the
    latest *folded* outcome event. Consequently querying a key at an event earlier than evidence that has
    already been folded (time running backwards for that key) cannot exclude it and raises ``ValueError``;
    with monotone dispatch events this never happens.

    The value ``alpha_q / (alpha_q + beta_q)`` does not depend on ``q`` beyond visibility (all terms age by
    the same factor ``rho^(q - e)``), so it is computed at the reference event, where ``alpha_e + beta_e``
    is at least ``min(1, alpha_0 + beta_0)``: no 0/0 after long gaps. :meth:`pseudo_counts` returns the
    aged counts, which do depend on ``q`` and may underflow to 0 for prompts unseen for thousands of events.

    Prior event. A key enters the tracker at Beta(0.5, 0.5) anchored at the event of :meth:`enter` (the trainer
    calls it at the key's first dispatch) or, for a key never entered, at the earliest event of its first observe call;
    :meth:`init_from_counts` anchors a prior at its ``event=`` (the start of training for a pre-pass or file). The
    prior of a prompt first drawn at event 40 therefore ages from 40, not from 0.
    """

    # A prompt's prior is anchored at its first dispatch (`enter`, which the trainer calls when it dispatches).
    enters_at_dispatch = True

    def __init__(self, rho: float = 0.875) -> None:
        self.rho = _validate_rho(rho)
        # key -> [alpha_e, beta_e, e]
        self._state: dict[str, list[float]] = {}
        # key -> [[z, R], ...] outcomes with z greater than the key's reference event
        self._pending: dict[str, list[list[float]]] = {}
        # key -> number of outcomes observed (visits)
        self._visits: dict[str, int] = {}

    @property
    def num_tracked(self) -> int:
        """Number of keys with stored state (entered, an initialized prior or at least one observation)."""
        return len(self._state)

    def visits(self, keys: Sequence[str]) -> torch.Tensor:
        """Number of outcomes observed per key (its visits; an initialized prior is not a visit), int64 (B,)."""
        return torch.tensor([self._visits.get(key, 0) for key in keys], dtype=torch.long)

    def _entry(self, key: str, event: int) -> list[float]:
        entry = self._state.get(key)
        if entry is None:
            entry = self._state[key] = [PRIOR_ALPHA, PRIOR_BETA, event]
        return entry

    def enter(self, keys: Sequence[str], event: int) -> None:
        """Anchor the default prior Beta(0.5, 0.5) of each key not yet tracked at ``event`` (its first dispatch).

        Keys already tracked (entered, initialized or observed) are left untouched."""
        event = self._check_event(event)
        for key in keys:
            self._entry(key, event)

    def _fold(self, key: str, event: int) -> list[float] | None:
        """Fold pending outcomes with ``z <= event`` into the stored counts; return the state (None if unseen)."""
        entry = self._state.get(key)
        if entry is None:
            return None
        pending = self._pending.get(key)
        if pending:
            visible = [p for p in pending if p[0] <= event]
            if visible:
                newest = max(p[0] for p in visible)
                decay = self.rho ** (newest - entry[2])
                entry[0] *= decay
                entry[1] *= decay
                entry[2] = newest
                for z, r in visible:
                    w = self.rho ** (newest - z)
                    entry[0] += w * r
                    entry[1] += w * (1.0 - r)
                rest = [p for p in pending if p[0] > event]
                if rest:
                    self._pending[key] = rest
                else:
                    del self._pending[key]
        if entry[2] > event:
            raise ValueError(
                f"prompt key {key!r} already holds evidence folded at event {int(entry[2])}, later than the "
                f"queried event {event}; dispatch events must not go backwards."
            )
        return entry

    @staticmethod
    def _check_event(event: int) -> int:
        if isinstance(event, bool) or int(event) != event or event < 0:
            raise ValueError(f"`event` must be a non-negative integer, got {event!r}.")
        return int(event)

    def pseudo_counts(self, keys: Sequence[str], event: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(alpha_q, beta_q)`` (float64, shape (B,)) at dispatch event ``q = event``."""
        event = self._check_event(event)
        alphas, betas = [], []
        for key in keys:
            entry = self._fold(key, event)
            alpha, beta, e = entry if entry is not None else (PRIOR_ALPHA, PRIOR_BETA, event)
            decay = self.rho ** (event - e)
            alphas.append(alpha * decay)
            betas.append(beta * decay)
        return torch.tensor(alphas, dtype=torch.float64), torch.tensor(betas, dtype=torch.float64)

    def value(self, keys: Sequence[str], event: int) -> torch.Tensor:
        """Return the values ``alpha_q / (alpha_q + beta_q)`` (float64, shape (B,)) at dispatch event ``event``."""
        event = self._check_event(event)
        values = []
        for key in keys:
            entry = self._fold(key, event)
            # The ratio is invariant to the common aging factor, so use the un-aged (never underflowing) counts.
            values.append(0.5 if entry is None else entry[0] / (entry[0] + entry[1]))
        return torch.tensor(values, dtype=torch.float64)

    def observe(self, keys: Sequence[str], rewards: Numbers, events: Sequence[int] | torch.Tensor | int) -> None:
        """Record outcomes: ``rewards[i]`` in [0, 1] for ``keys[i]``, generated at policy event ``events[i]``.

        ``events`` is a list/int tensor with one event per key, or one int for all. Outcomes may arrive in any
        order (late ones count exactly as if observed on time) once the key has entered (:meth:`enter` at its first
        dispatch); a key observed before entering enters at the earliest event of this call's outcomes for it.
        Inputs are validated before any state changes.
        """
        values = _validate_rewards(keys, rewards)
        if isinstance(events, torch.Tensor):
            if events.is_floating_point() or events.is_complex():
                raise ValueError(f"`events` must hold integers, got dtype {events.dtype}.")
            events = events.reshape(-1).tolist()
        if isinstance(events, int):
            events = [events] * len(keys)
        if len(events) != len(keys):
            raise ValueError(f"`events` has {len(events)} entries but `keys` has {len(keys)}; they must match.")
        events = [self._check_event(z) for z in events]
        entering: dict[str, int] = {}
        for key, z in zip(keys, events, strict=True):
            if key not in self._state:
                entering[key] = min(z, entering.get(key, z))
        for key, event in entering.items():
            self._entry(key, event)
        for key, r, z in zip(keys, values, events, strict=True):
            self._visits[key] = self._visits.get(key, 0) + 1
            entry = self._state[key]
            if z <= entry[2]:
                w = self.rho ** (entry[2] - z)
                entry[0] += w * r
                entry[1] += w * (1.0 - r)
            else:
                self._pending.setdefault(key, []).append([z, r])

    def init_from_counts(
        self,
        keys: Sequence[str],
        successes: Numbers,
        trials: Numbers,
        prior_strength: float = 8.0,
        event: int = 0,
    ) -> None:
        """Set each key's prior from ``s`` successes in ``n0`` samples, anchored at ``event`` (Jeffreys-smoothed).

        Replaces any state (prior and evidence) already held for those keys: meant for a pre-pass or a file of
        initial samples before training.
        """
        event = self._check_event(event)
        for key, (alpha, beta) in zip(keys, _jeffreys_prior(keys, successes, trials, prior_strength), strict=True):
            self._state[key] = [alpha, beta, event]
            self._pending.pop(key, None)

    def set_pseudo_counts(self, keys: Sequence[str], alphas: Numbers, betas: Numbers, event: int = 0) -> None:
        """Start each key at exactly Beta(alpha, beta) anchored at ``event`` (e.g. counts exported from a checkpoint
        by ``trl-aspo values``); replaces any state held for those keys."""
        event = self._check_event(event)
        for key, alpha, beta in zip(keys, *_validate_pseudo_counts(keys, alphas, betas), strict=True):
            self._state[key] = [alpha, beta, event]
            self._pending.pop(key, None)

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state (str keys, floats, ints, lists): storable with ``torch.save`` or ``json``."""
        return {
            "type": "EventValueTracker",
            "rho": self.rho,
            "state": {k: [v[0], v[1], int(v[2])] for k, v in self._state.items()},
            "pending": {k: [[int(z), r] for z, r in p] for k, p in self._pending.items()},
            "visits": dict(self._visits),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state produced by :meth:`state_dict` exactly (replacing the current state), after the checks of
        the tracker's own methods (ValueError naming the field and the prompt key)."""
        check_event_tracker_state(state_dict)
        self.rho = _validate_rho(state_dict["rho"])
        self._state = {k: [float(a), float(b), int(e)] for k, (a, b, e) in state_dict["state"].items()}
        self._pending = {k: [[int(z), float(r)] for z, r in p] for k, p in state_dict["pending"].items()}
        self._visits = {k: int(n) for k, n in state_dict.get("visits", {}).items()}


class VisitValueTracker:
    """SPO tracker: per observation ``alpha <- rho*alpha + R``, ``beta <- rho*beta + (1 - R)``.

    ``rho`` is given per call (a float, or one value per outcome e.g. from :func:`kl_adaptive_rho`). Keys that
    appear several times in one call are updated sequentially in the given order. Unseen keys start at
    Beta(0.5, 0.5).
    """

    # No policy event: nothing is anchored at a prompt's first dispatch.
    enters_at_dispatch = False

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
        values = _validate_rewards(keys, rewards)
        rhos = [_validate_rho(x) for x in _as_float_list(rho, len(keys), "rho")]
        for key, r, decay in zip(keys, values, rhos, strict=True):
            self._visits[key] = self._visits.get(key, 0) + 1
            entry = self._state.setdefault(key, [PRIOR_ALPHA, PRIOR_BETA])
            entry[0] = decay * entry[0] + r
            entry[1] = decay * entry[1] + (1.0 - r)

    def init_from_counts(
        self, keys: Sequence[str], successes: Numbers, trials: Numbers, prior_strength: float = 8.0
    ) -> None:
        """Set each key's prior from ``s`` successes in ``n0`` samples (Jeffreys-smoothed); replaces existing state."""
        for key, (alpha, beta) in zip(keys, _jeffreys_prior(keys, successes, trials, prior_strength), strict=True):
            self._state[key] = [alpha, beta]

    def set_pseudo_counts(self, keys: Sequence[str], alphas: Numbers, betas: Numbers) -> None:
        """Start each key at exactly Beta(alpha, beta) (e.g. counts exported from a checkpoint by ``trl-aspo
        values``); replaces any state held for those keys."""
        for key, alpha, beta in zip(keys, *_validate_pseudo_counts(keys, alphas, betas), strict=True):
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
