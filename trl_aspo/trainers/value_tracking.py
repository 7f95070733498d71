"""`ValueTracking`: the one value-tracking collaborator both trainers hold (docs/design.md sections 3 and 4; SPO, Xu &
Ding 2025, arXiv 2509.13232; SPO++, arXiv 2608.24870). The trainers only call it:

- lifecycle: the tracker of the run's estimator (its registration's factory), its priors from `value_init_file` or
  the value pre-pass (`prepass_due`, `init_from_prepass`; each trainer generates the pre-pass samples its own way);
- prompt identity: `dataset_keys`, `sample_key` (a rollout sample's prompt back to its key);
- the tracker at a policy event, whatever its kind: `values`, `enter`, `observe_round`, `round_metrics`;
- priorities: prioritized sampling's weights follow the tracker (`follow_priorities`; every observation refreshes the
  rows of the prompts it changed);
- checkpoint state: the tracker's part of the trainer's state and its restore under one policy
  (trl_aspo.trainers.project_state): the synchronous trainer's stored visits, the asynchronous one's tracker of the
  trained steps (`step_scored`, `step_trained`) and first-dispatch versions (`record_dispatches`);
- SPO's KL-adaptive forgetting (`value_rho_mode='kl'`, synchronous): a round's outcomes wait for the updates that use
  it (`VisitDrift`), and enter the tracker at the next dispatch (`close_pending_round`).

`ValueTracking.start` returns None under a group estimator: nothing of this exists then.
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Callable
from typing import Any

import torch

from trl_aspo.algorithms.advantage_estimators import get_advantage_estimator
from trl_aspo.infra.prompt_stream import PromptDispatches
from trl_aspo.trainers.checkpoint_state import checkpoint_state_file
from trl_aspo.trainers.project_state import restore_project_state
from trl_aspo.trainers.visit_drift import VisitDrift
from trl_aspo.values.event_values import AsyncEventValues
from trl_aspo.values.prompt_ids import prompt_key
from trl_aspo.values.single_stream import (
    PromptRows,
    dataset_prompt_keys,
    init_values_from_file,
    init_values_from_samples,
    prompt_ids_by_content,
    tracker_rewards,
    tracker_values,
    train_rows,
)


class ValueTracking:
    """The tracker of a run and everything around it (module docstring). `visit_drift`: SPO's KL-adaptive rho, which
    holds each round until the updates that use it (synchronous trainer, `value_rho_mode='kl'`), or None."""

    def __init__(
        self, args, tracker, train_dataset, visit_drift: VisitDrift | None = None, asynchronous: bool = False
    ) -> None:
        self.args = args
        self.tracker = tracker
        self.train_dataset = train_dataset
        self.visit_drift = visit_drift
        # KL-adaptive rho: the round waiting for its updates, and per prompt the completion of its last visit with its
        # post-update log-probs (CPU).
        self.pending_visit: dict | None = None
        self.visit_store: dict[str, dict[str, torch.Tensor]] = {}
        # Asynchronous spo++: each prompt's first dispatch version, recorded by the rollout worker.
        self.prompt_dispatches: PromptDispatches | None = None
        # Asynchronous: the tracker states before each scored step not trained yet, oldest first.
        self._untrained_states: collections.deque[dict] = collections.deque()
        self._dataset_keys: list[str] | None = None
        self._prompt_rows: PromptRows | None = None
        # Asynchronous samples carry their prompt, not their row: `prompt_id_column`'s ids by content, checked now.
        self._ids_by_prompt: dict[str, str] | None = None
        if asynchronous and args.prompt_id_column is not None:
            self._ids_by_prompt = prompt_ids_by_content(train_dataset, args)
        self._update_weights: Callable[[list[int], torch.Tensor], None] | None = None
        self._priority_event: Callable[[], int] | None = None

    @classmethod
    def start(
        cls, args, train_dataset, *, asynchronous: bool, accelerator=None, forward: Callable | None = None
    ) -> ValueTracking | None:
        """The run's value tracking, or None when its estimator tracks no values. `accelerator`, `forward`: the
        synchronous trainer's, for KL-adaptive rho's log-prob pass (`VisitDrift`)."""
        estimator = get_advantage_estimator(args.advantage_estimator)
        if not estimator.tracks_values:
            return None
        tracker = estimator.make_tracker(args, asynchronous)
        if args.value_init_file is not None:
            init_values_from_file(tracker, args, train_dataset)
        visit_drift = VisitDrift(args, accelerator, forward) if args.value_rho_mode == "kl" else None
        return cls(args, tracker, train_dataset, visit_drift, asynchronous)

    # ---------------------------------------------------------------- prompt identity
    @property
    def dataset_keys(self) -> list[str]:
        """The tracker key of every training row (`dataset_prompt_keys`), computed once."""
        if self._dataset_keys is None:
            self._dataset_keys = dataset_prompt_keys(self.train_dataset, self.args)
        return self._dataset_keys

    @property
    def prompt_rows(self) -> PromptRows:
        if self._prompt_rows is None:
            self._prompt_rows = PromptRows(self.dataset_keys)
        return self._prompt_rows

    def sample_key(self, sample) -> str:
        """The tracker key of a rollout sample, which carries its prompt but not its row: the prompt's content hash,
        or its `prompt_id_column` id looked up by that hash."""
        content = prompt_key(sample.prompt)
        if self._ids_by_prompt is None:
            return content
        if content not in self._ids_by_prompt:
            raise ValueError(
                f"{type(self.args).__name__}.prompt_id_column={self.args.prompt_id_column!r}: a sample's prompt "
                "matches no train_dataset row, so its id is unknown (did the rollout worker or an environment change "
                "the prompt?). Leave prompt_id_column unset to key prompts by their content."
            )
        return self._ids_by_prompt[content]

    # ---------------------------------------------------------------- the tracker at a policy event
    def values(self, keys: list[str], event: int) -> torch.Tensor:
        """The values of `keys` (float64) at policy event `event` (a tracker without events: its current values)."""
        return tracker_values(self.tracker, keys, event)

    def enter(self, keys: list[str], event: int) -> None:
        """Anchor the priors of prompts not tracked yet at `event`, their first dispatch (trackers aging by events)."""
        if self.tracker.ages_by_event:
            self.tracker.enter(keys, event)

    def observe_round(
        self, keys: list[str], outcomes: torch.Tensor, scorable: torch.Tensor, event: int, output
    ) -> None:
        """A generation round's outcomes (synchronous trainer; event: the round), the unscorable ones left out. With
        KL-adaptive rho the round is held (`output`: its completions) until `close_pending_round`."""
        if self.visit_drift is not None:
            self.pending_visit = self.visit_drift.snapshot(output, keys, outcomes, scorable)
            return
        observed = [key for key, ok in zip(keys, scorable.tolist(), strict=True) if ok]
        observed_outcomes = outcomes[scorable].double().cpu()
        if self.tracker.ages_by_event:
            self.tracker.observe(observed, observed_outcomes, [event] * len(observed))
        else:
            self.tracker.observe(observed, observed_outcomes, self.args.value_rho)
        self.refresh_priorities(observed)

    def close_pending_round(self) -> dict[str, float]:
        """SPO's KL-adaptive rho: the held round's outcomes enter the tracker after the updates that used it
        (collective: every rank runs the log-prob pass). Returns the round's `value/*` drift metrics."""
        pending, self.pending_visit = self.pending_visit, None
        if pending is None:
            return {}
        closed = self.visit_drift.close(pending, self.tracker, self.visit_store)
        self.refresh_priorities(
            [key for key, ok in zip(pending["keys"], pending["scorable"].tolist(), strict=True) if ok]
        )
        if not closed["rho"].numel():
            return {}
        unclipped = torch.exp2(-closed["drift"] / self.args.value_kl_half)
        return {
            "value/rho_mean": closed["rho"].mean().item(),
            "value/kl_drift": closed["drift"].mean().item(),
            "value/rho_clip_frac": (unclipped != closed["rho"]).double().mean().item(),
            "value/first_visit_frac": closed["first_visit"].double().mean().item(),
        }

    def round_metrics(self, keys: list[str], dispatch_values: torch.Tensor, event: int) -> dict[str, float]:
        """Per round: the dispatched prompts' mean value, effective evidence alpha + beta (the reference's
        `spo/Neff`) and visits so far, the tracker's size, and a constant rho."""
        if self.tracker.ages_by_event:
            alpha, beta = self.tracker.pseudo_counts(keys, event)
        else:
            alpha, beta = self.tracker.pseudo_counts(keys)
        metrics = {
            "value/mean": dispatch_values.mean().item(),
            "value/alpha_plus_beta": (alpha + beta).mean().item(),
            "value/visits_per_prompt": self.tracker.visits(keys).double().mean().item(),
            "value/tracked_prompts": float(self.tracker.num_tracked),
        }
        if self.args.value_rho_mode == "constant":
            metrics["value/rho_mean"] = self.args.value_rho
        return metrics

    # ---------------------------------------------------------------- priors from the value pre-pass
    def prepass_due(self, resume_from_checkpoint, started: bool) -> bool:
        """Whether `train` runs the pre-pass (`value_init_samples > 0`): on a fresh start only; a resumed run restores
        its tracker from the checkpoint, and a trainer that has already trained keeps the tracker it has."""
        return self.args.value_init_samples > 0 and not resume_from_checkpoint and not started

    def init_from_prepass(self, prompts: list[str], sample_keys: list[str], rewards: torch.Tensor) -> None:
        """Set the priors of `prompts` from the pre-pass samples (`sample_keys[i]` the prompt of sample `i`, `rewards`
        its total reward, NaN where no function scored it), anchored at the start of training, as both trainers
        count them (`init_values_from_samples`)."""
        outcomes = tracker_rewards(rewards.double().cpu(), self.args).tolist()
        event = 0 if self.tracker.ages_by_event else None
        init_values_from_samples(self.tracker, prompts, sample_keys, outcomes, self.args, event)
        self.refresh_priorities()

    # ---------------------------------------------------------------- priorities
    def priority_values(self, event: int, tracker=None) -> torch.Tensor:
        """Every training row's value at `event` (of `tracker`, this run's by default)."""
        rows = list(range(len(self.dataset_keys)))
        return self.prompt_rows.values(self.tracker if tracker is None else tracker, rows, event)

    def follow_priorities(
        self, update_weights: Callable[[list[int], torch.Tensor], None], event: Callable[[], int]
    ) -> None:
        """From now on, `update_weights(rows, values)` receives the values at `event()` of the rows whose prompts got
        an outcome (a value changes only then: trl_aspo.values.sampler), and of every row on `refresh_priorities()`."""
        self._update_weights, self._priority_event = update_weights, event

    def refresh_priorities(self, keys: list[str] | None = None) -> None:
        """Update the followed weights of the rows of `keys` (every row when None)."""
        if self._update_weights is None:
            return
        rows = list(range(len(self.dataset_keys))) if keys is None else self.prompt_rows.rows(keys)
        self._update_weights(rows, self.prompt_rows.values(self.tracker, rows, self._priority_event()))

    # ---------------------------------------------------------------- the asynchronous trainer's steps
    def record_dispatches(self) -> PromptDispatches | None:
        """The table in which the rollout worker records each prompt's first dispatch version, for a tracker that
        anchors priors there (spo++) on a map-style dataset; None otherwise."""
        if self.tracker.ages_by_event and train_rows(self.train_dataset) is not None:
            self.prompt_dispatches = PromptDispatches(self.dataset_keys)
        return self.prompt_dispatches

    def step_scored(self) -> None:
        """Before a step's samples are scored (and observed): keep the tracker state of the steps trained so far."""
        self._untrained_states.append(self.tracker.state_dict())

    def step_observed(self, keys: list[str], horizon: int) -> None:
        """After a step's samples were scored and observed: refresh the priorities of their prompts, and fold the
        outcomes older than `horizon` (the oldest version a later sample can have: TRL drops staler ones) into one
        aggregate per prompt (trl_aspo.values.event_values)."""
        self.refresh_priorities(keys)
        if isinstance(self.tracker, AsyncEventValues):
            self.tracker.advance(max(0, horizon))

    def step_trained(self) -> None:
        """After an optimizer step: the oldest scored step is trained."""
        if self._untrained_states:
            self._untrained_states.popleft()

    # ---------------------------------------------------------------- checkpoints
    def checkpoint_entries(self) -> tuple[Any, dict[str, Any]]:
        """The tracker a run resumed from a checkpoint written now must start from (None where only its state is
        kept: asynchronous, a step scored ahead), and its entries of the checkpoint's state (`tracker`, and
        `visit_store` or `prompt_dispatches`).

        Asynchronous: the data loader fetches (and scores) one step ahead of training, so the checkpoint gets the
        tracker state from before the untrained step's scoring; the resumed worker regenerates that step, whose
        outcomes are then observed once (one state dict is kept per scored step not yet trained).

        Synchronous, KL-adaptive rho: the last round's outcomes wait for the updates that use it. A resumed run starts
        with a fresh generation round, so the checkpoint closes the pending round with the current model (collective:
        every rank calls this): at a round boundary this is exactly what the next dispatch computes. It is done on
        copies (the visits dict shallowly: closing replaces entries, never mutates them), so training is untouched."""
        if self._untrained_states:
            return None, {"tracker": self._untrained_states[0], "prompt_dispatches": self._dispatch_state()}
        tracker, visit_store = self.tracker, self.visit_store
        if self.pending_visit is not None:
            tracker, visit_store = copy.deepcopy(self.tracker), dict(self.visit_store)
            self.visit_drift.close(self.pending_visit, tracker, visit_store)
        entries = {"tracker": tracker.state_dict(), "visit_store": visit_store}
        entries["prompt_dispatches"] = self._dispatch_state()
        return tracker, entries

    def _dispatch_state(self) -> dict[str, int] | None:
        # Every dispatch so far, also of groups still in flight: the uninterrupted run keeps those too.
        return None if self.prompt_dispatches is None else self.prompt_dispatches.state_dict()

    def restore(self, checkpoint: str, global_step: int | None = None) -> dict | None:
        """Read `checkpoint`'s state, check it against this run and load the tracker (`restore_project_state`; with
        `global_step`, the synchronous trainer's bound on its event counter), then what else value tracking saved.
        Returns the state (None when the checkpoint has none, which only `value_reset_on_resume` allows); the trainer
        refreshes the priorities once it has set its own event counter from it."""
        state, fresh = restore_project_state(
            checkpoint, self.args, train_rows(self.train_dataset), self.tracker, global_step
        )
        self.pending_visit = None
        self._untrained_states.clear()
        if state is None:
            return None
        self.visit_store = {} if fresh else dict(state.get("visit_store", {}))
        if not fresh and self.prompt_dispatches is not None and "prompt_dispatches" in state:
            try:
                self.prompt_dispatches.load_state_dict(state["prompt_dispatches"])
            except ValueError as error:
                raise ValueError(f"checkpoint state {checkpoint_state_file(checkpoint)}: {error}") from None
        return state
