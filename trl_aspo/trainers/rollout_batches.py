"""Rollout batches and the proximal policy of `AsyncASPOTrainer` (`steps_per_rollout_batch`, `proximal_policy`;
docs/async.md, trl_aspo.algorithms.proximal_policy).

A rollout batch is k = `steps_per_rollout_batch` optimizer steps' worth of micro-batches, fetched from TRL's data
loader (and scored there, one optimizer step at a time) before the batch's first update and trained in k optimizer
steps. The clock is the optimizer step: the batch starts at global step ``s_prox``, its j-th step is ``s_theta =
s_prox + j``, and each published model version is recorded with the global step at which it was published
(``s_b`` of its samples). With the decoupled objective the proximal log-probs are, at j = 0, the step's own forward
(detached); at j >= 1 either recorded before the first update (`recompute`) or interpolated (`loglinear`).
"""

from __future__ import annotations

import collections
import logging
import os

import torch

from trl_aspo.algorithms.packed import SegmentRows
from trl_aspo.algorithms.proximal_policy import loglinear_alpha, loglinear_proximal_log_probs
from trl_aspo.infra.json_files import read_json, write_json_atomic
from trl_aspo.infra.packed_forward import packed_log_probs
from trl_aspo.trainers.step_timing import OFFPOLICY_CORRECTION

logger = logging.getLogger(__name__)

ROLLOUT_BATCH_STATE_FILE = "rollout_batches.json"
# Per-sample behaviour steps of a collated micro-batch: (num_processes, samples per row), -1 past a row's samples.
SEGMENT_STEP_KEY = "segment_behaviour_step"
PROXIMAL_KEY = "proximal_log_probs"


class SegmentStepCollator:
    """TRL's rollout collator, adding each sample's behaviour step (`SEGMENT_STEP_KEY`), indexed as the row's
    `segment_id` indexes its samples, so every rank gets its own row's with the batch TRL dispatches."""

    def __init__(self, collate):
        self.collate = collate

    def __call__(self, examples):
        batch = self.collate(examples)
        (rows,) = examples
        width = max(1, max(len(row.samples) for row in rows))
        steps = torch.full((len(rows), width), -1, dtype=torch.long)
        for index, row in enumerate(rows):
            steps[index, : len(row.samples)] = torch.tensor([sample["behaviour_step"] for sample in row.samples])
        batch[SEGMENT_STEP_KEY] = steps
        return batch


class StampedItems(torch.utils.data.IterableDataset):
    """TRL's rollout items, each with `stamp(sample)` merged in: `recorder.last` is the sample behind the item TRL's
    dataset has just yielded (trl_aspo.infra.step_batches.RecordingQueue)."""

    def __init__(self, dataset, recorder, stamp):
        self.dataset, self.recorder, self.stamp = dataset, recorder, stamp

    def __iter__(self):
        for item in self.dataset:
            yield {**item, **self.stamp(self.recorder.last)}


class RolloutBatchMixin:
    """For `AsyncASPOTrainer` (before `AsyncGRPOTrainer` in its bases):

    - `get_batch_samples`: at a batch boundary, fetches the whole rollout batch (and, under `recompute` with the
      decoupled objective, records the proximal log-probs of its later mini-batches), then hands out one optimizer
      step's micro-batches per call. The last batch of a run holds only the steps left before `max_steps`.
    - `_sync_weight`: records the global step at which each model version is published.
    """

    _rollout_batch: collections.deque | None = None
    _batch_start_step = 0
    _step_in_batch = 0

    @property
    def steps_per_rollout_batch(self) -> int:
        return getattr(self.args, "steps_per_rollout_batch", 1)

    @property
    def _interpolates_proximal(self) -> bool:
        """Whether `loglinear` proximal log-probs are formed (they need each sample's behaviour step)."""
        return (
            self.steps_per_rollout_batch > 1
            and bool(getattr(self.args, "vllm_importance_sampling_correction", False))
            and self.args.proximal_policy == "loglinear"
        )

    @property
    def _records_proximal(self) -> bool:
        return (
            self.steps_per_rollout_batch > 1
            and bool(getattr(self.args, "vllm_importance_sampling_correction", False))
            and self.args.proximal_policy == "recompute"
        )

    # ---------------------------------------------------------------- the batch
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        k = self.steps_per_rollout_batch
        if k == 1:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        step = self.state.global_step
        if not self._rollout_batch:
            steps = max(1, min(k, self.state.max_steps - step)) if self.state.max_steps > 0 else k
            fetched = []
            for _ in range(steps):
                fetched.append(super().get_batch_samples(epoch_iterator, num_batches, device))
            self._batch_start_step = step
            if self._records_proximal:
                with self._timed(OFFPOLICY_CORRECTION, device):
                    self._record_proximal_log_probs([micro for samples, _ in fetched[1:] for micro in samples])
            self._rollout_batch = collections.deque(fetched)
        self._step_in_batch = step - self._batch_start_step
        return self._rollout_batch.popleft()

    def _record_proximal_log_probs(self, micro_batches: list[dict]) -> None:
        """`recompute`: each micro-batch's log-probs under the parameters at the batch start, by the forward its
        training step runs (`packed_log_probs`), in the model's training mode and the loss's autocast context, stored
        in the micro-batch as `PROXIMAL_KEY` (laid out as its `old_log_probs`)."""
        model = self.model_wrapped
        with torch.no_grad(), self.compute_loss_context_manager():
            for inputs in micro_batches:
                selected = inputs["token_index"] >= 0
                proximal = torch.zeros_like(inputs["old_log_probs"])
                proximal[selected] = packed_log_probs(model, inputs).to(proximal.dtype)
                inputs[PROXIMAL_KEY] = proximal

    def proximal_log_probs(self, inputs, rows: SegmentRows, selected, log_probs, behaviour_log_probs):
        """(S, T) proximal log-probs of a micro-batch at the current step of its rollout batch, and the per-sample
        loglinear alpha ((S,) float64; None under `recompute`). `log_probs`: the step's own (S, T) log-probs;
        `behaviour_log_probs`: the generator's."""
        if self._step_in_batch == 0:
            alpha = torch.ones(rows.shape[0], dtype=torch.float64) if self._interpolates_proximal else None
            return log_probs.detach(), alpha
        if self._records_proximal:
            return rows.to_rows(inputs[PROXIMAL_KEY][selected]).to(log_probs.dtype), None
        steps = inputs[SEGMENT_STEP_KEY][0][: rows.shape[0]]
        alpha = loglinear_alpha(steps, self._batch_start_step, self._step_in_batch).to(log_probs.device)
        return loglinear_proximal_log_probs(behaviour_log_probs, log_probs, alpha[:, None]), alpha

    # ---------------------------------------------------------------- what a loglinear sample carries
    def _behaviour_step(self, sample) -> dict[str, int]:
        """The global step at which the sample's behaviour version was published (`s_b`)."""
        version = sample.model_version
        if version not in self._publish_steps:
            raise RuntimeError(
                f"proximal_policy='loglinear' needs the global step at which model version {version} was published, "
                f"and this run recorded only versions {sorted(self._publish_steps)}: a rollout worker produced a "
                "sample of a version the trainer never published."
            )
        return {"behaviour_step": self._publish_steps[version]}

    def _stamp_behaviour_steps(self, dataloader, recorder) -> None:
        """Have the data loader's items carry their behaviour step and its batches `SEGMENT_STEP_KEY` (main process:
        TRL dispatches every rank's rows from it)."""
        batcher = dataloader.dataset
        batcher.dataset = StampedItems(batcher.dataset, recorder, self._behaviour_step)
        # accelerate's dispatcher iterates the data loader it wraps (`base_dataloader`), with that one's collate_fn.
        loader = getattr(dataloader, "base_dataloader", dataloader)
        loader.collate_fn = SegmentStepCollator(loader.collate_fn)

    # ---------------------------------------------------------------- publications and checkpoints
    @property
    def _publish_steps(self) -> dict[int, int]:
        """Model version -> the global step at which it was published (main process; the last max_staleness + 1).
        Version 0, the starting weights TRL's counter begins at, is those of step 0."""
        return self.__dict__.setdefault("_published_at", {0: 0})

    def _sync_weight(self):
        super()._sync_weight()
        if self.accelerator.is_main_process:
            self._publish_steps[self.model_version] = self.state.global_step
            # A version more than max_staleness behind is never trained again (TRL drops its samples when fetched).
            oldest = self.model_version - self.args.max_staleness
            for version in [v for v in self._publish_steps if v < oldest]:
                del self._publish_steps[version]

    def _save_rollout_batch_state(self, output_dir: str) -> None:
        if self.accelerator.is_main_process and self.steps_per_rollout_batch > 1:
            state = {"publish_steps": {str(v): s for v, s in self._publish_steps.items()}}
            write_json_atomic(os.path.join(output_dir, ROLLOUT_BATCH_STATE_FILE), state)

    def _restore_rollout_batch_state(self, checkpoint: str) -> None:
        path = os.path.join(checkpoint, ROLLOUT_BATCH_STATE_FILE)
        if not os.path.lexists(path):
            return
        state = read_json(path)
        steps = state.get("publish_steps") if isinstance(state, dict) else None
        if not isinstance(steps, dict) or not all(
            key.isdigit() and isinstance(value, int) and value >= 0 for key, value in steps.items()
        ):
            raise ValueError(
                f"{path}: 'publish_steps' must map model versions to non-negative global steps, got {steps!r}."
            )
        self._publish_steps.update({int(key): value for key, value in steps.items()})
