"""`LocalWorkerResumeMixin`: the resume of an `AsyncGRPOTrainer` subclass at its first untrained prompt.

For a trainer (listed before `AsyncGRPOTrainer` in its bases; `AsyncASPOTrainer` has it), it saves and restores the
local worker's (`trl_aspo.infra.local_worker.LocalRolloutWorker`) prompt position and model version with each
checkpoint (`rollout_state.json`, trl_aspo.infra.rollout_state), as `AsyncGRPOTrainer` does for its own worker only;
for either worker it counts a group as trained when its micro-batch is trained (not when the data loader fetches it,
one micro-batch ahead) and checks the checkpoint's `rollout_state.json` before either reads it. Resumed, the local
worker's versions continue the uninterrupted run's; TRL's worker numbers as under `AsyncGRPOTrainer`.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os

import datasets
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

from trl_aspo.infra.checkpoint_files import ROLLOUT_STATE_FILE
from trl_aspo.infra.json_files import write_json_atomic
from trl_aspo.infra.local_worker import LocalRolloutWorker
from trl_aspo.infra.rollout_state import checkpoint_global_step, read_rollout_state, rollout_state_bounds

logger = logging.getLogger(__name__)


class _CollatedGroups:
    """Stands in for the trained-group set TRL's collator updates: keeps each micro-batch's groups, in order, until
    that micro-batch is trained."""

    def __init__(self):
        self.pending: collections.deque[set[int]] = collections.deque()

    def update(self, groups) -> None:
        self.pending.append(set(groups))


class LocalWorkerResumeMixin:
    """For a subclass of `AsyncGRPOTrainer` (listed before it): checkpoints record the `LocalRolloutWorker`'s first
    untrained prompt and the model version (`rollout_state.json`), and a resumed run restarts the worker there.

    `AsyncGRPOTrainer` does exactly this in `_save_checkpoint` / `_inner_training_loop`, but only for an instance of
    its own worker class, so these two methods add the same for the local worker. With another worker they only call
    TRL's (after checking TRL's worker's `rollout_state.json`). Two things make a resumed run continue as the
    uninterrupted one:

    - For every worker: TRL's collator marks a micro-batch's groups trained when the data loader fetches it, which is
      one micro-batch ahead of training, so a checkpoint's first untrained prompt would skip the fetched, untrained
      step. Here the groups join `_trained_groups` when their micro-batch is trained (`training_step`).
    - For the local worker: the cold weight sync at train begin counts a version; on resume it republishes the
      checkpoint's weights, so it restores the checkpoint's version instead of minting a new one (not with TRL's
      adapter-only sync, whose adapter names must not be reused). TRL's own worker keeps TRL's numbering, in which
      that sync publishes the checkpoint's version + 1 (docs/resuming.md)."""

    def get_train_dataloader(self):
        trained, self._trained_groups = self._trained_groups, _CollatedGroups()
        try:
            dataloader = super().get_train_dataloader()
        finally:
            self._collated_groups, self._trained_groups = self._trained_groups, trained
        return dataloader

    def training_step(self, model, inputs, num_items_in_batch=None):
        output = super().training_step(model, inputs, num_items_in_batch)
        collated = getattr(self, "_collated_groups", None)
        if collated is not None and collated.pending:
            self._trained_groups.update(collated.pending.popleft())
        return output

    def _sync_weight(self):
        # The first sync of a resumed local-worker run: TRL's bumps the version after publishing, so step back first.
        if getattr(self, "_republish_checkpoint_version", False):
            self._republish_checkpoint_version = False
            if self.accelerator.is_main_process:
                self.model_version -= 1
        super()._sync_weight()

    def _save_checkpoint(self, model, trial):
        if self.accelerator.is_main_process and isinstance(self.rollout_worker, LocalRolloutWorker):
            checkpoint_dir = os.path.join(
                self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            )
            os.makedirs(checkpoint_dir, exist_ok=True)
            first_untrained = next(group for group in itertools.count() if group not in self._trained_groups)
            prompt_index = self.rollout_worker._loop_kwargs["dataset_start_index"] + first_untrained
            state = {"prompt_index": prompt_index, "model_version": self.model_version}
            write_json_atomic(os.path.join(checkpoint_dir, ROLLOUT_STATE_FILE), state)
        super()._save_checkpoint(model, trial)

    def _inner_training_loop(self, *args, **kwargs):
        # Before TRL's train-begin callback starts the worker, which builds its loop from `_loop_kwargs`.
        checkpoint = kwargs.get("resume_from_checkpoint")
        self._republish_checkpoint_version = False
        if isinstance(self.rollout_worker, LocalRolloutWorker):
            self._restore_local_prompt_position(checkpoint)
        elif checkpoint is not None and isinstance(self.rollout_worker, AsyncRolloutWorker):
            self._read_rollout_state(checkpoint)  # refuses a bad file before TRL reads it
        return super()._inner_training_loop(*args, **kwargs)

    def _read_rollout_state(self, checkpoint: str) -> dict | None:
        """The checkpoint's `rollout_state.json`, checked (`read_rollout_state`) against the bounds of this run and
        of the checkpoint's `global_step`; None when there is none or the dataset is not map-style (TRL's rules).
        TRL's own worker reads the file again after this check, so a bad file is refused before either reads it."""
        state_file = os.path.join(checkpoint, ROLLOUT_STATE_FILE)
        # `lexists`, not TRL's `isfile`: a link to a device or a folder in its place is refused, not skipped.
        if not os.path.lexists(state_file) or not isinstance(self.train_dataset, datasets.Dataset):
            return None
        args = self.args
        per_row = (
            args.token_budget if (getattr(args, "token_budget", None) or 0) > 0 else args.per_device_train_batch_size
        )
        local = isinstance(self.rollout_worker, LocalRolloutWorker)
        bounds = rollout_state_bounds(
            checkpoint_global_step(checkpoint),
            samples_per_step=per_row * args.gradient_accumulation_steps * self.accelerator.num_processes,
            drops_groups=bool(getattr(args, "filter_zero_variance_groups", False)),
            republishes=local,
        )
        return read_rollout_state(state_file, bounds)

    def _restore_local_prompt_position(self, checkpoint: str | None) -> None:
        self.rollout_worker._loop_kwargs["dataset_start_index"] = 0
        self._groups_before_resume = 0
        if checkpoint is None:
            return
        state = self._read_rollout_state(checkpoint)
        if state is None:
            logger.warning(
                f"{checkpoint} records no prompt position (rollout_state.json) or the dataset is not a map-style "
                "datasets.Dataset: the local rollout worker restarts from prompt 0."
            )
            return
        self.rollout_worker._loop_kwargs["dataset_start_index"] = state["prompt_index"]
        self._groups_before_resume = state["prompt_index"]
        self.model_version = state.get("model_version", 0)
        self.rollout_worker.update_model_version(self.model_version)
        self._republish_checkpoint_version = self.model_version > 0 and not getattr(self, "_lora_sync", False)
