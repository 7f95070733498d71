"""`ASPOTrainer`'s value pre-pass (`value_init_samples`): the tracker's priors from completions of the starting
policy, generated and scored by GRPOTrainer's own `_generate` and `_calculate_rewards`, handed to the value-tracking
collaborator both trainers hold (`ValueTracking.init_from_prepass`)."""

from __future__ import annotations

import copy
import inspect

import torch
from tqdm.auto import tqdm

from trl_aspo.values.scoring import total_rewards
from trl_aspo.values.single_stream import prepass_prompts
from trl_aspo.values.value_init import prepass_plan


class GRPOValuePrepassMixin:
    """`train` (runs the pre-pass before TRL's loop on a fresh start) and the pre-pass itself."""

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None):
        """`Trainer.train`, preceded on a fresh start by the value pre-pass when `value_init_samples > 0`.

        A resumed run restores its tracker from the checkpoint instead, and a trainer that has already dispatched
        (a second `train()` call) keeps the tracker it has."""
        if self._values is not None and self._values.prepass_due(resume_from_checkpoint, self._value_event > 0):
            with self._timed_prepass():  # `timing/value_prepass_s`, logged with the first step
                self._value_init_prepass()
        return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval)

    @torch.no_grad()
    def _value_init_prepass(self) -> None:
        """Initialize the tracker from `value_init_samples` completions per training prompt of the starting policy
        (`ValueTracking.init_from_prepass`, as AsyncASPOTrainer's).

        Generation and scoring are TRL's own (`_generate`, `_calculate_rewards`) with the training sampling settings,
        one generation batch at a time: each rank takes its contiguous share of the batch, and the rewards come back
        gathered in process-major order, i.e. in plan order. Runs before `accelerator.prepare`, on the model as
        given. TRL's metrics and pending reward-function logs of the pre-pass are discarded."""
        dataset = self.train_dataset
        keys, first_rows = prepass_prompts(dataset, self.args, self.environment_factories is not None)
        per_rank = self.args.per_device_train_batch_size * self.args.steps_per_generation
        span = per_rank * self.accelerator.num_processes
        plan = prepass_plan(list(first_rows.values()), self.args.value_init_samples, self.num_generations, span)
        sample_keys, rewards = [], []
        saved_metrics = copy.deepcopy(self._metrics)
        was_training = self.model.training
        self.model.train()  # sample as training does (TRL picks the train-mode settings from `model.training`)
        rank = self.accelerator.process_index
        try:
            batches = range(0, len(plan), span)
            for start in tqdm(
                batches, desc="value pre-pass", unit="batch", disable=not self.accelerator.is_main_process
            ):
                chunk = plan[start : start + span]
                chunk_rewards = self._prepass_rewards(
                    [dataset[row] for row, _ in chunk[rank * per_rank : (rank + 1) * per_rank]]
                )
                for (row, counted), reward in zip(chunk, chunk_rewards.tolist(), strict=True):
                    if counted:
                        sample_keys.append(keys[row])
                        rewards.append(reward)
        finally:
            self.model.train(was_training)
            self._metrics = saved_metrics
            self._pending_extra_logs.clear()
            self._pending_metrics.clear()
        self._values.init_from_prepass(list(first_rows), sample_keys, torch.tensor(rewards, dtype=torch.float64))

    def _prepass_rewards(self, inputs: list[dict]) -> torch.Tensor:
        """One completion per row of `inputs` with TRL's generation; total rewards gathered across ranks (NaN where
        every reward function returned None)."""
        prompts = [row["prompt"] for row in inputs]
        if self.tools:
            # TRL's tool loop reads each rollout's tools from per-rollout dicts that `_generate_and_score_completions`
            # builds; without environments they hold the standalone tools.
            standalone = self._standalone_tools
            sync_tools = {tool.__name__: tool for tool in standalone if not inspect.iscoroutinefunction(tool)}
            async_tools = {tool.__name__: tool for tool in standalone if inspect.iscoroutinefunction(tool)}
            self._sync_tool_dicts = [sync_tools] * len(inputs)
            self._async_tool_dicts = [async_tools] * len(inputs)
        _, completion_ids, _, completions, _, extra_fields, _, _ = self._generate(prompts)
        # As TRL does before scoring: a rollout function's extra fields become reward-function columns.
        for index, row in enumerate(inputs):
            for name, values in extra_fields.items():
                if not isinstance(values, list):
                    row[name] = values
                elif index < len(values):
                    row[name] = values[index]
        rewards_per_func = self._calculate_rewards(inputs, prompts, completions, completion_ids)
        return total_rewards(rewards_per_func, self.reward_weights).cpu()
