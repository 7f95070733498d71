"""SPO++'s tracker for the synchronous trainer (SPO++, arXiv 2608.24870; docs/design.md section 3): evidence ages by
*policy events* (generation rounds ``q = 0, 1, 2, ...``). An outcome generated at event ``z_i`` has weight
``rho^(q - z_i)`` at dispatch ``q`` and the prior, initialized at event ``z0``, ages the same way::

    alpha_q = rho^(q - z0) * alpha_0 + sum_{i: z_i <= q} rho^(q - z_i) * R_i
    beta_q  = rho^(q - z0) * beta_0  + sum_{i: z_i <= q} rho^(q - z_i) * (1 - R_i)

The sum does not depend on the order in which outcomes arrive, which matters once rollouts are asynchronous. The
value ``v_x = alpha_q / (alpha_q + beta_q)`` is read (and frozen) when the prompt is dispatched.

A prompt's prior is anchored at the event at which the prompt enters the tracker (:meth:`EventValueTracker.enter` at
its first dispatch, or the ``event`` of ``init_from_counts`` for a pre-pass or file), so a prompt first drawn at a
late round starts from its full prior, not from one already aged by ``rho^q``. Pseudo-counts and their
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
    jeffreys_prior,
    validate_pseudo_counts,
    validate_rewards,
    validate_rho,
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


def check_event_tracker_state(state_dict: dict[str, Any], where: str = "tracker", max_event: int = MAX_COUNT) -> None:
    """Validate an `EventValueTracker.state_dict()` before it is restored, with the checks its methods apply on the
    way in: rho in (0, 1]; per key `[alpha, beta, event]` with pseudo-counts as `set_pseudo_counts` accepts and an
    integer event <= `max_event` (the trainer's event counter); pending outcomes `[event, reward]` with a reward in
    [0, 1] and an event after the key's reference event (the representation; an earlier one would age by rho^-k)
    and <= `max_event`; visits integers in [0, 2**53]. Raises ValueError naming `where`, the field and the key."""
    if state_dict.get("type") != "EventValueTracker":
        raise ValueError(f"{where} is not an EventValueTracker state (type={state_dict.get('type')!r}).")
    check_rho(state_dict, where)
    entries = state_mapping(state_dict, "state", where)
    for key, entry in entries.items():
        alpha, beta, event = check_entry(entry, f"{where}.state", key, ("alpha", "beta", "event"))
        check_pseudo_counts(alpha, beta, f"{where}.state", key)
        check_event(event, f"{where}.state", key, maximum=max_event)
    for key, outcomes in state_mapping(state_dict, "pending", where).items():
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

    # Evidence ages by policy events: `enter`, `value`, `observe` and `pseudo_counts` take the event, and a prompt's
    # prior is anchored at its first dispatch (`enter`, which the trainer calls when it dispatches).
    ages_by_event = True

    def __init__(self, rho: float = 0.875) -> None:
        self.rho = validate_rho(rho)
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
        values = validate_rewards(keys, rewards)
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
        for key, (alpha, beta) in zip(keys, jeffreys_prior(keys, successes, trials, prior_strength), strict=True):
            self._state[key] = [alpha, beta, event]
            self._pending.pop(key, None)

    def set_pseudo_counts(self, keys: Sequence[str], alphas: Numbers, betas: Numbers, event: int = 0) -> None:
        """Start each key at exactly Beta(alpha, beta) anchored at ``event`` (e.g. counts exported from a checkpoint
        by ``trl-aspo values``); replaces any state held for those keys."""
        event = self._check_event(event)
        for key, alpha, beta in zip(keys, *validate_pseudo_counts(keys, alphas, betas), strict=True):
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
        self.rho = validate_rho(state_dict["rho"])
        self._state = {k: [float(a), float(b), int(e)] for k, (a, b, e) in state_dict["state"].items()}
        self._pending = {k: [[int(z), float(r)] for z, r in p] for k, p in state_dict["pending"].items()}
        self._visits = {k: int(n) for k, n in state_dict.get("visits", {}).items()}
