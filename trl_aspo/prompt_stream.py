"""Prioritized sampling on the asynchronous rollout worker's prompt stream (SPO++, arXiv 2608.24870; cf. SPO,
arXiv 2509.13232; DESIGN.md section 4).

TRL's rollout worker cycles through the dataset, one prompt group at a time, whenever a generation slot frees up.
With prioritized sampling each group's prompt is drawn instead, with probability proportional to the prompt's
priority under the trainer's value tracker (`trl_aspo.sampler.priority_weights`)::

    w_x = sqrt(v_x (1 - v_x)) + epsilon

so prompts the policy always or never solves (no learning signal) are drawn rarely but never starved.
`PromptPriorities.effective_prompts` is `trl_aspo.sampler.effective_num_prompts` of the weights, ``(sum w)^2 / sum
w^2``. Each group draws one row on its own (there are no rounds here), so a prompt may come back in the next group.

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
the urllib loop or the local worker's loop; module-level, so spawn pickles them by reference) and the weights.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker, _AsyncRolloutLoop

from .async_infra.http_transport import UrllibRolloutLoop
from .async_infra.local_worker import LocalRolloutWorker, _LocalRolloutLoop
from .sampler import _round_seed, effective_num_prompts, priority_weights


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

    def draw(self, group_index: int) -> int:
        """The dataset row of group ``group_index``, drawn in proportion to the current weights."""
        if isinstance(group_index, bool) or int(group_index) != group_index or group_index < 0:
            raise ValueError(f"`group_index` must be a non-negative integer, got {group_index!r}.")
        weights = self.weights.clone()  # one snapshot: the trainer may be writing
        generator = torch.Generator().manual_seed(_round_seed(self.seed, int(group_index)))
        return int(torch.multinomial(weights, 1, generator=generator))

    def effective_prompts(self) -> float:
        """Kish effective number of prompts of the current weights."""
        return effective_num_prompts(self.weights.clone()).item()


class PrioritizedPromptLoop:
    """Mixin for TRL's `_AsyncRolloutLoop` and its subclasses: each group's row is drawn from `prompt_priorities`
    instead of taken from the dataset in order. Everything else is the loop it is mixed into."""

    def __init__(self, *, prompt_priorities: PromptPriorities, **loop_kwargs: Any):
        super().__init__(**loop_kwargs)
        if len(prompt_priorities) != len(self.dataset):
            raise ValueError(
                f"prompt_priorities holds {len(prompt_priorities)} weights for a dataset of {len(self.dataset)} rows; "
                "build them from the rollout worker's dataset."
            )
        self._prompt_priorities = prompt_priorities
        self._first_group_index = int(loop_kwargs.get("dataset_start_index", 0))

    def _repeat_iterator(self) -> Iterator[tuple[int, dict[str, Any]]]:
        # TRL's layout: each group's row `num_generations` times, group ids from 0 in this run (TRL's checkpoint adds
        # `dataset_start_index` to them), so the draw's group index counts on from `dataset_start_index`.
        group_id = 0
        while True:
            row = self.dataset[self._prompt_priorities.draw(self._first_group_index + group_id)]
            for _ in range(self.num_generations):
                yield group_id, row
            group_id += 1


class PrioritizedAsyncRolloutLoop(PrioritizedPromptLoop, _AsyncRolloutLoop):
    """TRL's rollout loop (vLLM over aiohttp) drawing its prompts by priority."""


class PrioritizedUrllibRolloutLoop(PrioritizedPromptLoop, UrllibRolloutLoop):
    """`UrllibRolloutLoop` drawing its prompts by priority."""


class PrioritizedLocalRolloutLoop(PrioritizedPromptLoop, _LocalRolloutLoop):
    """The local worker's loop drawing its prompts by priority."""


PRIORITIZED_LOOPS = {
    _AsyncRolloutLoop: PrioritizedAsyncRolloutLoop,
    UrllibRolloutLoop: PrioritizedUrllibRolloutLoop,
    _LocalRolloutLoop: PrioritizedLocalRolloutLoop,
}


def attach_prompt_priorities(worker, priorities: PromptPriorities) -> None:
    """Make `worker` (not yet started) draw its prompts from `priorities`.

    Works for TRL's `AsyncRolloutWorker` and its subclasses, whose loop class is one of `PRIORITIZED_LOOPS` (or
    already a `PrioritizedPromptLoop`), and for `LocalRolloutWorker`: the worker's `_loop_cls` becomes the
    prioritized counterpart and `prompt_priorities` joins the kwargs its loop is built with."""
    if not isinstance(worker, AsyncRolloutWorker | LocalRolloutWorker):
        raise TypeError(
            f"prioritized_sampling=True draws prompts inside the rollout worker's loop, which only TRL's "
            f"AsyncRolloutWorker (and its subclasses) and trl_aspo's LocalRolloutWorker expose; got a "
            f"{type(worker).__name__}. Use one of those workers, or set prioritized_sampling=False."
        )
    loop_cls = worker._loop_cls
    if not issubclass(loop_cls, PrioritizedPromptLoop):
        if loop_cls not in PRIORITIZED_LOOPS:
            raise TypeError(
                f"prioritized_sampling=True: the worker's loop class {loop_cls.__qualname__} has no prioritized "
                "counterpart; define a module-level `class MyLoop(PrioritizedPromptLoop, "
                f"{loop_cls.__qualname__})` and set it as the worker's `_loop_cls`."
            )
        worker._loop_cls = PRIORITIZED_LOOPS[loop_cls]
    worker._loop_kwargs["prompt_priorities"] = priorities
