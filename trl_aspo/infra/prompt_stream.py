"""Prioritized sampling on the asynchronous rollout worker's prompt stream (SPO++, arXiv 2608.24870; cf. SPO,
arXiv 2509.13232; docs/design.md section 4).

TRL's rollout worker cycles through the dataset, one prompt group at a time, whenever a generation slot frees up.
With prioritized sampling each group's prompt is drawn instead, with probability proportional to the prompt's
priority under the trainer's value tracker (`trl_aspo.values.sampler.priority_weights`)::

    w_x = sqrt(v_x (1 - v_x)) + epsilon

so prompts the policy always or never solves (no learning signal) are drawn rarely but never starved.
`PromptPriorities.effective_prompts` is `trl_aspo.values.sampler.effective_num_prompts` of the weights,
``(sum w)^2 / sum w^2``. Each group draws one row on its own (there are no rounds here), so a prompt may come back
in the next group.

The draw of group ``g`` is a pure function of ``(seed, g, w)``: a generator seeded from ``(seed, g)`` picks one row
by ``torch.multinomial`` on the weights at that moment. Group indices count from TRL's ``dataset_start_index`` (the
first untrained group of the checkpoint a run resumes from), so a resumed worker draws what the uninterrupted one
would have drawn given the same weights. A run is still not reproducible from run to run: the trainer rewrites the
weights while the worker reads them, so which weights a draw sees depends on timing. Groups already in flight or
queued when the weights change keep their prompts: priorities act with a lag of the worker's lead over training.

Crossing the process boundary: the weights live in a tensor in shared memory (`Tensor.share_memory_`). TRL's
`AsyncRolloutWorker` spawns its child with `loop_kwargs` as arguments; torch's multiprocessing reductions hand the
child the tensor's storage, not a copy, so every weight the trainer writes after the spawn is what the child's loop
reads. (`pickle.dumps`, TRL's up-front picklability check, copies the values, which is all that check needs.)
`attach_prompt_priorities` gives a worker a prioritized loop class (`PrioritizedPromptLoop` mixed into TRL's loop,
or the local worker's loop; module-level, so spawn pickles them by reference) and the weights.

What the value tracker needs from the worker (`TrackedRolloutLoop`, attached by `attach_rollout_tracking`; every
prioritized loop is one too), stamped on each row it emits as a `TrackedRolloutSample`:

- `prompt_dispatch_version`: the model version at which the row's prompt was first dispatched for generation, the
  SPO++ prior's event ``z0`` (docs/design.md section 4). The worker records it when it hands a group to generation,
  in a shared-memory table per tracker key (`PromptDispatches`, crossing the spawn like the weights), so it is fixed
  before any sample of the prompt can arrive: the anchor never depends on which samples have arrived. The trainer
  checkpoints the table and restores it before the worker starts.
- `rollout_id`: TRL's id of the conversation a row comes from (`TrainingSequence.rollout_id`, a fresh uuid per
  rollout), which TRL's `RolloutSample` drops. A conversation whose re-tokenization drifts is split into several
  rows (forks) that share it; independent rollouts never do, even when they wrote the same text.

SPO++'s runtime (`attach_dispatch_control`): with a `DispatchControl` the tracked loop dispatches only rows whose
prompt has fewer than `max_inflight_per_prompt` requests in flight (TRL's cycle passes over the others; the
prioritized draw is among eligible rows, i.e. the priority distribution conditioned on eligibility:
``P(x) = w_x / sum_{y eligible} w_y`` for an eligible x, 0 for a prompt in flight), and nothing while the trainer
holds dispatch for a publish. A slot with nothing to dispatch is parked in a hold (no request, no sample).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

import datasets
import numpy as np
import torch
from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker, RolloutSample, _AsyncRolloutLoop

from trl_aspo.infra.dispatch_control import DispatchControl
from trl_aspo.infra.local_worker import LocalRolloutWorker, _LocalRolloutLoop
from trl_aspo.infra.served_context import ServedContextLoop
from trl_aspo.values.sampler import _round_seed, effective_num_prompts, priority_weights


class PromptPriorities:
    """Priority weights of a map-style dataset's rows, in shared memory: the trainer updates, the worker draws.

    Args:
        values: tracker value in [0, 1] of every row, in dataset order.
        seed: base seed; the draw of group ``g`` depends only on ``(seed, g)`` and the weights.
        epsilon: the priority floor (> 0).
    """

    def __init__(self, values: torch.Tensor, seed: int = 0, epsilon: float = 0.05):
        if not epsilon > 0:
            raise ValueError(f"`epsilon` must be > 0 (no prompt may starve), got {epsilon!r}.")
        values = torch.as_tensor(values, dtype=torch.float64)
        if values.dim() != 1 or len(values) == 0:
            raise ValueError(f"`values` must hold one value per dataset row, got shape {tuple(values.shape)}.")
        self.seed = int(seed)
        self.epsilon = float(epsilon)
        self.weights = priority_weights(values, self.epsilon).share_memory_()

    def __len__(self) -> int:
        return len(self.weights)

    def update(self, rows: Sequence[int] | torch.Tensor, values: torch.Tensor) -> None:
        """Set the weights of ``rows`` from their tracker ``values``; the other rows keep theirs."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        values = torch.as_tensor(values, dtype=torch.float64)
        if rows.dim() != 1 or rows.shape != values.shape:
            raise ValueError(f"`rows` ({tuple(rows.shape)}) and `values` ({tuple(values.shape)}) must match.")
        if len(rows) and not (int(rows.min()) >= 0 and int(rows.max()) < len(self)):
            raise ValueError(f"`rows` must lie in [0, {len(self)}).")
        # Each new weight is >= epsilon > 0, so a reader that sees some rows old and some new still draws validly.
        self.weights[rows] = priority_weights(values, self.epsilon)

    def draw(self, group_index: int, eligible: torch.Tensor | None = None) -> int:
        """The dataset row of group ``group_index``, drawn in proportion to the current weights; with `eligible` (a
        boolean mask with at least one row set), among those rows only: the weights conditioned on eligibility."""
        if isinstance(group_index, bool) or int(group_index) != group_index or group_index < 0:
            raise ValueError(f"`group_index` must be a non-negative integer, got {group_index!r}.")
        weights = self.weights.clone()  # one snapshot: the trainer may be writing
        if eligible is not None:
            weights = weights * eligible
        generator = torch.Generator().manual_seed(_round_seed(self.seed, int(group_index)))
        return int(torch.multinomial(weights, 1, generator=generator))

    def effective_prompts(self) -> float:
        """Kish effective number of prompts of the current weights."""
        return effective_num_prompts(self.weights.clone()).item()


@dataclass(slots=True)
class TrackedRolloutSample(RolloutSample):
    """TRL's `RolloutSample` with what the trainer's value tracker needs (module docstring): the conversation the row
    comes from (`rollout_id`, shared by the rows one conversation forks into) and the model version at which its
    prompt was first dispatched (`prompt_dispatch_version`; None where the worker records no dispatches)."""

    rollout_id: str | None = None
    prompt_dispatch_version: int | None = None


_SAMPLE_FIELDS = tuple(field.name for field in fields(RolloutSample))
# How often a hold checks whether dispatch may go on (a hold costs no request, only this wake-up).
HOLD_POLL_S = 0.01


class PromptDispatches:
    """The model version at which each tracker key of a map-style dataset was first dispatched, in shared memory:
    the rollout worker records (`record`), the trainer checkpoints and restores (`state_dict`, `load_state_dict`).

    Args:
        row_keys: the tracker key of every dataset row, in dataset order (rows sharing a key share one entry).
    """

    def __init__(self, row_keys: Sequence[str]):
        if len(row_keys) == 0:
            raise ValueError("`row_keys` must hold one tracker key per dataset row, got none.")
        self.keys = list(dict.fromkeys(row_keys))
        index = {key: position for position, key in enumerate(self.keys)}
        self.key_of_row = torch.tensor([index[key] for key in row_keys], dtype=torch.long)
        self.versions = torch.full((len(self.keys),), -1, dtype=torch.long).share_memory_()  # -1: never dispatched

    def __len__(self) -> int:
        return len(self.key_of_row)

    def record(self, row: int, version: int) -> int:
        """Record a dispatch of dataset row `row` at model `version`; returns the first dispatch version of its key.
        (One writer, the worker's loop; the first dispatch is kept.)"""
        entry = int(self.key_of_row[row])
        first = int(self.versions[entry])
        if first < 0:
            self.versions[entry] = int(version)
            return int(version)
        return first

    def state_dict(self) -> dict[str, int]:
        """`{key: first dispatch version}` of every key dispatched so far."""
        return {self.keys[i]: int(v) for i, v in enumerate(self.versions.tolist()) if v >= 0}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore `state_dict()`'s record (keys no row of this dataset has are ignored); refuses anything but
        non-negative integer versions by key."""
        if not isinstance(state, dict):
            raise ValueError(f"prompt dispatches must be an object of versions by key, got {type(state).__name__}.")
        for key, version in state.items():
            if isinstance(version, bool) or not isinstance(version, int) or version < 0:
                raise ValueError(
                    f"prompt dispatches: key {key!r} has version {version!r}; a dispatch version is an integer >= 0."
                )
        index = {key: position for position, key in enumerate(self.keys)}
        self.versions.fill_(-1)
        for key, version in state.items():
            if key in index:
                self.versions[index[key]] = version


class TrackedRolloutLoop:
    """Mixin for TRL's `_AsyncRolloutLoop` and its subclasses: records each group's first prompt dispatch in
    `prompt_dispatches` (optional) and emits `TrackedRolloutSample`s carrying it and TRL's `rollout_id`. Which row
    each group takes is the loop's own choice (TRL's cycle here, `PrioritizedPromptLoop`'s draw), among the rows
    `dispatch_control` (optional; trl_aspo.infra.dispatch_control) lets it dispatch. It counts the turns whose
    generation started under one model version and ended under another (`rollout/turns_across_publish_total`, their
    tokens `rollout/tokens_across_publish_total`)."""

    def __init__(
        self,
        *,
        prompt_dispatches: PromptDispatches | None = None,
        dispatch_control: DispatchControl | None = None,
        **loop_kwargs: Any,
    ):
        super().__init__(**loop_kwargs)
        for name, table in (("prompt_dispatches", prompt_dispatches), ("dispatch_control", dispatch_control)):
            if table is not None and len(table) != len(self.dataset):
                raise ValueError(
                    f"{name} covers {len(table)} rows for a dataset of {len(self.dataset)} rows; build it from the "
                    "rollout worker's dataset."
                )
        self._prompt_dispatches = prompt_dispatches
        self._dispatch_control = dispatch_control
        self._first_group_index = int(loop_kwargs.get("dataset_start_index", 0))
        self._group_dispatch: dict[int, int | None] = {}  # group id -> its prompt's first dispatch version
        self._group_row: dict[int, int] = {}  # group id -> its dataset row, while in flight under dispatch_control
        self._hold_ids = itertools.count(-1, -1)  # holds take negative group ids, which no dispatched group has

    def _eligible_rows(self) -> torch.Tensor | None:
        """The rows `dispatch_control` lets the loop dispatch now (None: every row)."""
        return None if self._dispatch_control is None else self._dispatch_control.eligible_rows()

    def _group_rows(self) -> Iterator[tuple[int, int | None, dict[str, Any]]]:
        """(group id, dataset row index or None, row) of each group: TRL's cycle from `dataset_start_index`,
        passing over the rows that are not eligible (their group ids are spent, so group g stays row start + g)."""
        repeats = super()._repeat_iterator()
        mapped = isinstance(self.dataset, datasets.Dataset)
        for group_id, row in repeats:
            for _ in range(self.num_generations - 1):
                next(repeats)
            index = (self._first_group_index % len(self.dataset) + group_id) % len(self.dataset) if mapped else None
            if self._dispatch_control is None or self._dispatch_control.row_eligible(index):
                yield group_id, index, row

    def _repeat_iterator(self) -> Iterator[tuple[int, dict[str, Any]]]:
        # TRL's generate loop starts a group's first rollout right after taking its first item, at this version.
        groups = self._group_rows()
        control = self._dispatch_control
        waiting = None  # a group drawn while dispatch was open, announced only once it still is
        while True:
            if control is not None:
                if waiting is None and control.may_dispatch():
                    waiting = next(groups)
                if waiting is None or not control.try_dispatch(waiting[1], self.num_generations):
                    yield from self._hold()
                    continue
                self._group_row[waiting[0]] = waiting[1]
            group_id, index, row = waiting if waiting is not None else next(groups)
            waiting = None
            dispatch = None
            if self._prompt_dispatches is not None and index is not None:
                dispatch = self._prompt_dispatches.record(index, self.model_version)
            self._group_dispatch[group_id] = dispatch
            for _ in range(self.num_generations):
                yield group_id, row

    def _hold(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """A hold: a group that parks the free slot TRL's loop fills until dispatch may go on (`_generate_one`),
        then ends with no conversation and no sample. Its row is the dataset's first (TRL's loop builds a group
        from a row, and resets an environment with it where there are environments)."""
        hold_id = next(self._hold_ids)
        for _ in range(self.num_generations):
            yield hold_id, self.dataset[0]

    async def _generate_one(self, prompt, tool_dict, tools, group_id: int = 0):
        if group_id < 0:
            # A stopping loop scores nothing more, so no prompt would be released: TRL's loop waits for its tasks.
            while not self._dispatch_control.may_dispatch() and not self._stop_event.is_set():
                await asyncio.sleep(HOLD_POLL_S)
            return [], [], [], 0, 0, None
        try:
            return await super()._generate_one(prompt, tool_dict, tools, group_id)
        finally:
            if self._dispatch_control is not None:
                self._dispatch_control.finished()

    async def _generate_one_turn(self, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
        version = self.model_version
        turn_ids, turn_logprobs = await super()._generate_one_turn(prompt_ids)
        across = self.model_version != version
        # Pushed for every turn (0 too), so a run where no turn spans a publish logs 0 rather than nothing.
        self._counters["rollout/turns_across_publish_total"] += float(across)
        self._counters["rollout/tokens_across_publish_total"] += float(across * len(turn_ids))
        return turn_ids, turn_logprobs

    async def _score_group(self, group) -> list[TrackedRolloutSample]:
        if group.group_id < 0:
            return []
        samples = await super()._score_group(group)
        row = self._group_row.pop(group.group_id, None)
        if row is not None:
            self._dispatch_control.scored(row, self.num_generations)
        # TRL emits one sample per training row, conversation by conversation, rows in order.
        rows = [sequence for sequences in group.completions_sequences for sequence in sequences]
        if len(rows) != len(samples) or any(
            not np.array_equal(sample.input_ids, row.input_ids) for sample, row in zip(samples, rows, strict=False)
        ):
            raise RuntimeError(
                "TrackedRolloutLoop: TRL's _score_group no longer emits one sample per training row in order, so "
                "rows cannot be matched to their conversations; trl_aspo needs updating for this TRL version."
            )
        dispatch = self._group_dispatch.pop(group.group_id, None)
        return [
            TrackedRolloutSample(
                **{name: getattr(sample, name) for name in _SAMPLE_FIELDS},
                rollout_id=row.rollout_id,
                prompt_dispatch_version=dispatch,
            )
            for sample, row in zip(samples, rows, strict=True)
        ]


class PrioritizedPromptLoop(TrackedRolloutLoop):
    """Mixin for TRL's `_AsyncRolloutLoop` and its subclasses: each group's row is drawn from `prompt_priorities`
    instead of taken from the dataset in order. Everything else is the loop it is mixed into (and
    `TrackedRolloutLoop`)."""

    def __init__(self, *, prompt_priorities: PromptPriorities, **loop_kwargs: Any):
        super().__init__(**loop_kwargs)
        if len(prompt_priorities) != len(self.dataset):
            raise ValueError(
                f"prompt_priorities holds {len(prompt_priorities)} weights for a dataset of {len(self.dataset)} rows; "
                "build them from the rollout worker's dataset."
            )
        self._prompt_priorities = prompt_priorities

    def _group_rows(self) -> Iterator[tuple[int, int | None, dict[str, Any]]]:
        # Group ids from 0 in this run (TRL's checkpoint adds `dataset_start_index` to them), so the draw's group
        # index counts on from `dataset_start_index`.
        group_id = 0
        while True:
            index = self._prompt_priorities.draw(self._first_group_index + group_id, self._eligible_rows())
            yield group_id, index, self.dataset[index]
            group_id += 1


class TrackedAsyncRolloutLoop(TrackedRolloutLoop, ServedContextLoop, _AsyncRolloutLoop):
    """TRL's rollout loop (vLLM over aiohttp) emitting `TrackedRolloutSample`s, each turn checked against the
    server's context (`ServedContextLoop`)."""


class TrackedLocalRolloutLoop(TrackedRolloutLoop, _LocalRolloutLoop):
    """The local worker's loop emitting `TrackedRolloutSample`s."""


class PrioritizedAsyncRolloutLoop(PrioritizedPromptLoop, ServedContextLoop, _AsyncRolloutLoop):
    """TRL's rollout loop (vLLM over aiohttp) drawing its prompts by priority, each turn checked against the
    server's context (`ServedContextLoop`)."""


class PrioritizedLocalRolloutLoop(PrioritizedPromptLoop, _LocalRolloutLoop):
    """The local worker's loop drawing its prompts by priority."""


class ContextCheckedAsyncRolloutLoop(ServedContextLoop, _AsyncRolloutLoop):
    """TRL's rollout loop (vLLM over aiohttp), each turn checked against the server's context."""


def attach_served_context_check(worker) -> None:
    """Give TRL's `AsyncRolloutWorker` with TRL's own loop the served-context check (`ServedContextLoop`); the
    tracked and prioritized loops have it already, and a user's own loop class is left as it is."""
    if isinstance(worker, AsyncRolloutWorker) and worker._loop_cls is _AsyncRolloutLoop:
        worker._loop_cls = ContextCheckedAsyncRolloutLoop


TRACKED_LOOPS = {
    _AsyncRolloutLoop: TrackedAsyncRolloutLoop,
    _LocalRolloutLoop: TrackedLocalRolloutLoop,
}
PRIORITIZED_LOOPS = {
    _AsyncRolloutLoop: PrioritizedAsyncRolloutLoop,
    _LocalRolloutLoop: PrioritizedLocalRolloutLoop,
}
# A tracked loop becomes the prioritized loop of the same base (both attachments may apply, in either order).
PRIORITIZED_LOOPS.update({TRACKED_LOOPS[base]: prioritized for base, prioritized in list(PRIORITIZED_LOOPS.items())})


def _swap_loop(worker, base: type, counterparts: dict[type, type], wrong_worker: str, no_counterpart: str) -> None:
    """Give `worker` (TRL's `AsyncRolloutWorker`, a subclass, or `LocalRolloutWorker`; not yet started) the
    counterpart of its loop class that derives from `base` (kept when it already does). `wrong_worker` is the error
    for another worker, `no_counterpart` for a loop class without a counterpart (`{loop}` is its name)."""
    if not isinstance(worker, AsyncRolloutWorker | LocalRolloutWorker):
        raise TypeError(wrong_worker.format(worker=type(worker).__name__))
    loop_cls = worker._loop_cls
    if not issubclass(loop_cls, base):
        if loop_cls not in counterparts:
            raise TypeError(no_counterpart.format(loop=loop_cls.__qualname__))
        worker._loop_cls = counterparts[loop_cls]


def attach_prompt_priorities(worker, priorities: PromptPriorities) -> None:
    """Make `worker` (not yet started) draw its prompts from `priorities`.

    Works for TRL's `AsyncRolloutWorker` and its subclasses, whose loop class is one of `PRIORITIZED_LOOPS` (or
    already a `PrioritizedPromptLoop`), and for `LocalRolloutWorker`: the worker's `_loop_cls` becomes the
    prioritized counterpart and `prompt_priorities` joins the kwargs its loop is built with."""
    _swap_loop(
        worker,
        PrioritizedPromptLoop,
        PRIORITIZED_LOOPS,
        "prioritized_sampling=True draws prompts inside the rollout worker's loop, which only TRL's "
        "AsyncRolloutWorker (and its subclasses) and trl_aspo's LocalRolloutWorker expose; got a "
        "{worker}. Use one of those workers, or set prioritized_sampling=False.",
        "prioritized_sampling=True: the worker's loop class {loop} has no prioritized "
        "counterpart; define a module-level `class MyLoop(PrioritizedPromptLoop, "
        "{loop})` and set it as the worker's `_loop_cls`.",
    )
    worker._loop_kwargs["prompt_priorities"] = priorities


def attach_rollout_tracking(worker, dispatches: PromptDispatches | None) -> None:
    """Make `worker` (not yet started) emit `TrackedRolloutSample`s and, with `dispatches`, record each prompt's
    first dispatch there. Works for the workers and loop classes `attach_prompt_priorities` takes (a prioritized
    loop already is a tracked one)."""
    _swap_loop(
        worker,
        TrackedRolloutLoop,
        TRACKED_LOOPS,
        "attach_rollout_tracking works inside the rollout worker's loop, which only TRL's AsyncRolloutWorker (and "
        "its subclasses) and trl_aspo's LocalRolloutWorker expose; got a {worker}.",
        "trainer-side scoring: the worker's loop class {loop} has no tracked "
        "counterpart; define a module-level `class MyLoop(TrackedRolloutLoop, "
        "{loop})` and set it as the worker's `_loop_cls`.",
    )
    worker._loop_kwargs["prompt_dispatches"] = dispatches


def attach_dispatch_control(worker, control: DispatchControl) -> None:
    """Make `worker` (not yet started) dispatch only what `control` lets it (one request in flight per prompt, hold
    and drain at publish; trl_aspo.infra.dispatch_control). Works for the workers and loop classes
    `attach_rollout_tracking` takes (the control acts in the tracked loop)."""
    _swap_loop(
        worker,
        TrackedRolloutLoop,
        TRACKED_LOOPS,
        "max_inflight_per_prompt and drain_on_publish act inside the rollout worker's loop, which only TRL's "
        "AsyncRolloutWorker (and its subclasses) and trl_aspo's LocalRolloutWorker expose; got a {worker}.",
        "max_inflight_per_prompt / drain_on_publish: the worker's loop class {loop} has no tracked counterpart; "
        "define a module-level `class MyLoop(TrackedRolloutLoop, {loop})` and set it as the worker's `_loop_cls`.",
    )
    worker._loop_kwargs["dispatch_control"] = control
