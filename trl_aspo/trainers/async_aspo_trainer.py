"""`AsyncASPOTrainer`: TRL's experimental `AsyncGRPOTrainer` with the asymmetric loss, single-stream value tracking
and tool shaping (docs/async.md, docs/design.md).

The rollout worker sees one prompt group at a time, so everything that needs more than a group is done here, on the
main process, which holds every rank's samples (TRL dispatches batches from it): each optimizer step's samples are
taken together, with the members of its groups outside it (`trl_aspo.infra.step_batches`), and scored by `StepScorer`
(the registered group estimator on each group's raw rewards, or the tracker's `R - v(x, z)` with `z` the sample's
`model_version`) in front of the `AdvantagePipeline` the synchronous trainer calls too. A registered loss runs in the
shared `assembled_loss` on the log-probs of TRL's own packed forward, with the generator's log-probs as the old
policy; value tracking (tracker, pre-pass priors, priorities, checkpoint state) is the `ValueTracking` collaborator
the synchronous trainer holds too.

With every new field at its default the trainer is `AsyncGRPOTrainer`: no scoring layer, TRL's loss.
"""

from __future__ import annotations

import inspect
import logging
import time

import torch
from accelerate import PartialState
from datasets import Dataset
from trl.experimental.async_grpo import AsyncGRPOTrainer
from trl.experimental.async_grpo.async_grpo_trainer import StepIntervalCallback
from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker
from trl.trainer.utils import get_config_model_id

from trl_aspo.algorithms.context_length import generation_context
from trl_aspo.algorithms.filters import zero_variance_from_std
from trl_aspo.algorithms.tool_metrics import ToolCallCounter, tool_call_metrics
from trl_aspo.config.async_config import AsyncASPOConfig, check_sampling_logprobs
from trl_aspo.evaluation.rewards import summed_rewards
from trl_aspo.evaluation.tool_use import evaluate_tool_use, generation_attention
from trl_aspo.infra.dispatch_control import DispatchControl
from trl_aspo.infra.fallbacks import install_cpu_fallbacks
from trl_aspo.infra.local_worker import LocalRolloutWorker
from trl_aspo.infra.notices import dropped_log_messages
from trl_aspo.infra.prompt_stream import (
    PromptPriorities,
    attach_dispatch_control,
    attach_prompt_priorities,
    attach_rollout_tracking,
    attach_served_context_check,
)
from trl_aspo.infra.sample_checks import CheckedRolloutQueue
from trl_aspo.infra.step_batches import (
    RecordingQueue,
    StepCallbackDataset,
    StepScoringDataset,
    completion_batch,
    completion_texts,
)
from trl_aspo.infra.vllm_cpu import CPUWeightTransfer, on_cpu, tied_parameter_aliases
from trl_aspo.infra.worker_stop import attach_safe_stop
from trl_aspo.trainers.async_grpo_loss import AsyncGRPOLossMixin
from trl_aspo.trainers.graceful_stop import GracefulStopMixin
from trl_aspo.trainers.local_worker_resume import LocalWorkerResumeMixin
from trl_aspo.trainers.project_state import save_project_state
from trl_aspo.trainers.resume import TiedWeightsCheckpointMixin
from trl_aspo.trainers.rollout_batches import RolloutBatchMixin
from trl_aspo.trainers.step_guard import NonFiniteStepGuardMixin
from trl_aspo.trainers.step_timing import ADVANTAGES, StepTimingMixin
from trl_aspo.trainers.value_tracking import ValueTracking
from trl_aspo.values.scoring import StepScorer, check_correct_reward_name, warn_if_tool_shaping_runs_no_tools
from trl_aspo.values.single_stream import dataset_prompt_keys, prepass_prompts, train_rows

logger = logging.getLogger(__name__)


def _runtime_fields(args) -> str:
    """The runtime switches set, as the config spells them (for errors)."""
    names = [f"max_inflight_per_prompt={args.max_inflight_per_prompt!r}"] * (args.max_inflight_per_prompt is not None)
    return " and ".join(names + ["drain_on_publish=True"] * bool(args.drain_on_publish))


def _conversation_id(sample) -> tuple[int, str] | object:
    """The rollout a row comes from: its group and TRL's `rollout_id`, which the rows one conversation forks into
    share and independent rollouts never do (even when they wrote the same text), as the tracked loop stamps it
    (trl_aspo.infra.prompt_stream). A row without one (a worker that does not stamp it) is its own rollout."""
    rollout_id = getattr(sample, "rollout_id", None)
    return object() if rollout_id is None else (sample.group_id, rollout_id)


class AsyncASPOTrainer(
    TiedWeightsCheckpointMixin,
    GracefulStopMixin,
    NonFiniteStepGuardMixin,
    LocalWorkerResumeMixin,
    AsyncGRPOLossMixin,
    RolloutBatchMixin,
    StepTimingMixin,
    AsyncGRPOTrainer,
):
    """[`AsyncGRPOTrainer`] configured by [`AsyncASPOConfig`]: same arguments; `args=None` gives the defaults.

    TRL methods overridden, each the smallest hook available:

    - `train`: runs the value pre-pass before TRL's loop on a fresh start.
    - `get_train_dataloader`: TRL builds the rollout dataset and its batcher inside it; scoring sits between them.
    - `get_batch_samples`: counts one optimizer step's action tokens and completions for `aspo_aggregation`; with
      `steps_per_rollout_batch` > 1 fetches a whole rollout batch at its first step (`RolloutBatchMixin`).
    - `_sync_weight`: records the global step at which each model version is published (the loglinear clock); with
      `drain_on_publish`, holds dispatch and waits for the old weights' conversations around the publish.
    - `_get_grad_norm`: `skip_nonfinite_grad_steps` drops a step's gradients when their norm is not finite.
    - `compute_loss`: TRL's PPO loss is inlined in it; the aspo loss runs on the same packed forward.
    - `training_step`: marks the end of an optimizer step for the checkpointed tracker state (`ValueTracking`).
    - `log`: closes the weight map's logging window.
    - `_save_rng_state`: the hook every rank runs inside a new checkpoint before it is marked complete.
    - `_load_optimizer_and_scheduler`: the hook of a resume after the model is loaded, before training.
    """

    # Defaults for a trainer built without this __init__, as TRL's own tests build one (TrainingArguments only).
    _micro_batches_of_step = 0
    _values: ValueTracking | None = None
    _logprob_dropped_groups: int | None = None  # counted where samples are read (the main process)

    def __init__(self, model: str, reward_funcs=None, args: AsyncASPOConfig | None = None, *positional, **kwargs):
        if args is None:
            args = AsyncASPOConfig(f"{model.split('/')[-1]}-AsyncASPO")
        if not isinstance(args, AsyncASPOConfig):
            raise TypeError(
                f"AsyncASPOTrainer needs an AsyncASPOConfig as `args`, got {type(args).__name__}; AsyncASPOConfig "
                "takes every AsyncGRPOConfig field."
            )
        bound = inspect.signature(AsyncGRPOTrainer.__init__).bind(
            None, model, reward_funcs, args, *positional, **kwargs
        )
        # Kept for the value pre-pass, which rolls out on the trainer (the worker owns the rollouts otherwise).
        self._prepass_inputs = {
            name: bound.arguments.get(name) for name in ("reward_funcs", "tools", "environment_factory")
        }
        cpu_server = (
            on_cpu(args.device)
            and bound.arguments.get("rollout_worker") is None
            and bound.arguments.get("weight_transfer") is None
        )
        if on_cpu(args.device):
            install_cpu_fallbacks()
        if cpu_server:
            kwargs["weight_transfer"] = CPUWeightTransfer(
                args.vllm_server_base_url, server_timeout=args.vllm_server_timeout
            )
        # Before any model loads. TRL's worker reports vLLM's processed log-probs; a worker that does not say is taken
        # to do the same.
        worker = bound.arguments.get("rollout_worker")
        check_sampling_logprobs(args, True if worker is None else getattr(worker, "reports_processed_logprobs", True))
        # token_budget=None means the vLLM server's max_model_len, which TRL asks its server for at train start: a
        # worker without one (the local worker) answers itself, where TRL would wait for a server that never comes.
        if args.token_budget is None and getattr(worker, "max_model_len", None) is not None:
            args.token_budget = worker.max_model_len
        if args.max_inflight_tasks < 0 and args.steps_per_rollout_batch > 1:
            # TRL's automatic size (max_staleness x samples per step), for a rollout batch of k steps' samples.
            samples_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps
            samples_per_step *= PartialState().num_processes
            args.max_inflight_tasks = max(args.max_staleness, 1) * samples_per_step * args.steps_per_rollout_batch
        # TRL adds two StepIntervalCallbacks (weight sync, step metrics) on purpose; transformers warns on any repeat.
        with dropped_log_messages("transformers.trainer_callback", f"You are adding a {StepIntervalCallback}"):
            super().__init__(model, reward_funcs, args, *positional, **kwargs)
        # The generator's context (a worker's max_model_len, else the policy's positions) must leave room for a prompt.
        served = getattr(self.rollout_worker, "max_model_len", None)
        config = self.accelerator.unwrap_model(self.model).config
        generation_context(self.args.max_completion_length, served, "the rollout worker's max_model_len", config)
        if cpu_server and self.accelerator.is_main_process:
            policy = self.accelerator.unwrap_model(self.model)
            self.weight_transfer.aliases = tied_parameter_aliases(policy)
            self.weight_transfer.trained_dtype = str(policy.dtype).removeprefix("torch.")
            self.weight_transfer.model_name = get_config_model_id(policy.config)
        # The rollout worker runs the tools of these arguments (TRL's worker; the CLI hands the same to its local one).
        runs_tools = bool(self._prepass_inputs["tools"]) or self._prepass_inputs["environment_factory"] is not None
        warn_if_tool_shaping_runs_no_tools(self.args, "tools= or environment_factory=", runs_tools)
        self._values = ValueTracking.start(self.args, self.train_dataset, asynchronous=True)
        self._scorer = StepScorer(self.args, None if self._values is None else self._values.tracker)
        # As the synchronous trainer: tool metrics when tools run, a pattern detects calls, or shaping reads them.
        self._tool_calls = None
        if runs_tools or self.args.tool_shaping or self.args.tool_call_pattern is not None:
            self._tool_calls = ToolCallCounter(
                self.processing_class, self.args.tool_call_opener, self.args.tool_call_pattern, tools_run=runs_tools
            )
        self._prompt_priorities = self._start_prompt_priorities() if self.args.prioritized_sampling else None
        if self.args.scores_on_trainer:
            self._start_rollout_tracking()
        self._dispatch_control = self._start_dispatch_control()
        attach_served_context_check(self.rollout_worker)
        attach_safe_stop(self.rollout_worker)
        self._warned_untracked_samples = False
        self._micro_batches_of_step = 0
        # Every sample read (from either worker) has its generator log-probs checked; a bad one drops its group.
        if self.rollout_queue is not None:
            self._logprob_dropped_groups = 0
            self.rollout_queue = CheckedRolloutQueue(
                self.rollout_queue, self._drop_group_for_logprobs, self.args.num_generations, _conversation_id
            )
        self._start_weight_map()
        self._start_step_timing()

    @property
    def epoch_stop_groups(self) -> int | None:
        """The prompt groups after which an epoch-driven run stops (TRL's count; None when `max_steps` drives)."""
        return self._epoch_stop_groups

    # ---------------------------------------------------------------- value pre-pass
    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """`Trainer.train`, preceded on a fresh start by the value pre-pass when `value_init_samples > 0` (as in
        ASPOTrainer: a resumed run restores its tracker from the checkpoint instead)."""
        if (
            self._values is not None
            and self._values.prepass_due(resume_from_checkpoint, self.state.global_step > 0)
            and self.accelerator.is_main_process
        ):
            with self._timed_prepass():  # `timing/value_prepass_s`, logged with the first step
                self._value_init_prepass()
        return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)

    def _value_init_prepass(self) -> None:
        """Initialize the tracker from `value_init_samples` completions per training prompt of the starting policy
        (`ValueTracking.init_from_prepass`, as ASPOTrainer's; priors anchored at version 0, the start of training).

        The rollouts run on the trainer's policy with the tool loop of `trl_aspo.evaluation.tool_use` (TRL's, at the
        training temperature, `max_completion_length` and `max_tool_calling_iterations`), scored by the sum of the
        reward functions as the rollout worker scores (weight 1 each; NaN where every function abstains)."""
        dataset = self.train_dataset
        has_environments = self._prepass_inputs["environment_factory"] is not None
        _, first_rows = prepass_prompts(dataset, self.args, has_environments)
        funcs = self._prepass_inputs["reward_funcs"]
        funcs = [] if funcs is None else list(funcs) if isinstance(funcs, list | tuple) else [funcs]
        with generation_attention(self.model) as model:
            result = evaluate_tool_use(
                model,
                self.processing_class,
                dataset.select(list(first_rows.values())),
                summed_rewards(funcs),
                list(self._prepass_inputs["tools"] or []),
                num_samples=self.args.value_init_samples,
                temperature=self.args.temperature,
                max_completion_length=self.args.max_completion_length,
                max_tool_calls=self.args.max_tool_calling_iterations,
                seed=self.args.seed,
            )
        prompts = list(first_rows)
        rewards = torch.tensor([record["reward"] for record in result["records"]], dtype=torch.float64)
        sample_keys = [prompts[record["problem"]] for record in result["records"]]
        self._values.init_from_prepass(prompts, sample_keys, rewards)

    # ---------------------------------------------------------------- what the worker records for the tracker
    def _start_rollout_tracking(self) -> None:
        """Make TRL's or the local rollout worker stamp each row with its conversation (a forked conversation is one
        outcome, and one member of its group) and, for a tracker that anchors priors at a prompt's first dispatch
        (spo++) on a map-style dataset, that dispatch's version, recorded where value tracking keeps it
        (`ValueTracking.record_dispatches`). Any other worker's rows are scored without them (`_score_step` says so
        once)."""
        if not isinstance(self.rollout_worker, AsyncRolloutWorker | LocalRolloutWorker):
            return
        dispatches = None if self._values is None else self._values.record_dispatches()
        attach_rollout_tracking(self.rollout_worker, dispatches)

    # ---------------------------------------------------------------- prioritized prompt stream
    def _start_prompt_priorities(self) -> PromptPriorities:
        """Per-row priorities of `train_dataset` from the tracker, handed to the rollout worker's loop."""
        dataset = self.train_dataset
        if not isinstance(dataset, Dataset):
            raise ValueError(
                "AsyncASPOConfig.prioritized_sampling=True needs train_dataset to be a map-style datasets.Dataset "
                f"(the worker draws rows by index), got {type(dataset).__name__}."
            )
        # spo++ reads values at the next model version, so every outcome received so far is visible.
        priorities = PromptPriorities(
            self._values.priority_values(self.model_version + 1),
            seed=self.args.seed,
            epsilon=self.args.priority_epsilon,
        )
        self._values.follow_priorities(priorities.update, lambda: self.model_version + 1)
        if self.rollout_worker is not None:
            attach_prompt_priorities(self.rollout_worker, priorities)
        return priorities

    # ---------------------------------------------------------------- SPO++'s runtime
    def _start_dispatch_control(self) -> DispatchControl | None:
        """With `max_inflight_per_prompt` or `drain_on_publish`, the `DispatchControl` the worker's loop asks
        before each dispatch, keyed per row as the value tracker keys prompts (`dataset_prompt_keys`)."""
        if self.args.max_inflight_per_prompt is None and not self.args.drain_on_publish:
            return None
        if self.rollout_worker is None:  # not the main process: the worker and its dispatches live there
            return None
        dataset = self.train_dataset
        if train_rows(dataset) is None:
            raise ValueError(
                f"AsyncASPOConfig.{_runtime_fields(self.args)} needs train_dataset to be a map-style "
                f"datasets.Dataset (prompts are counted per dataset row), got {type(dataset).__name__}."
            )
        keys = self._values.dataset_keys if self._values is not None else dataset_prompt_keys(dataset, self.args)
        control = DispatchControl(keys, self.args.max_inflight_per_prompt)
        attach_dispatch_control(self.rollout_worker, control)
        return control

    def _sync_weight(self):
        """TRL's publish; with `drain_on_publish`, dispatch is held first, every conversation dispatched under the
        old weights finishes (every turn) before they are replaced, and dispatch goes on only once TRL has bumped
        the worker's model version (it resumes generation before it bumps it)."""
        control = self._dispatch_control
        if control is None or not self.args.drain_on_publish:
            return super()._sync_weight()
        control.hold()
        try:
            started = time.monotonic()
            control.drain(self.args.weight_sync_timeout)
            # TRL's perf/weight_sync_s starts after this wait: the publish's cost of draining, logged apart.
            self._metrics["train"]["perf/publish_drain_s"].append(time.monotonic() - started)
            return super()._sync_weight()
        finally:
            control.release()

    # ---------------------------------------------------------------- trainer-side scoring
    def get_train_dataloader(self):
        """TRL's dataloader; with trainer-side scoring, its fixed-count batcher reads `StepScoringDataset`; with the
        loglinear proximal policy, its items and batches carry each sample's behaviour step."""
        self._rollout_batch = None
        if not self.accelerator.is_main_process:
            return super().get_train_dataloader()
        step_size = self.args.per_device_train_batch_size * self.accelerator.num_processes
        step_size *= self.args.gradient_accumulation_steps
        if not self.args.scores_on_trainer and not self._interpolates_proximal:
            dataloader = super().get_train_dataloader()
            self._log_tool_metrics_of(dataloader.dataset, step_size)
            return dataloader
        recorder = RecordingQueue(self.rollout_queue)
        self.rollout_queue = recorder
        try:
            dataloader = super().get_train_dataloader()
        finally:
            self.rollout_queue = recorder.queue
        batcher = dataloader.dataset
        if self._interpolates_proximal:
            self._stamp_behaviour_steps(dataloader, recorder)
        if not self.args.scores_on_trainer:
            self._log_tool_metrics_of(batcher, step_size)
            return dataloader
        dropped_share = None
        if self.args.filter_zero_variance_groups:

            def dropped_share(share: float) -> None:
                self._metrics["train"]["filter/zero_variance_dropped_share"].append(share)

        batcher.dataset = StepScoringDataset(
            batcher.dataset,
            recorder,
            step_size,
            self._score_step,
            self._filtered_out,
            dropped_share,
            group_size=self.args.num_generations,
            conversation=_conversation_id,
        )
        self._log_tool_metrics_of(batcher, step_size)
        return dataloader

    def _log_tool_metrics_of(self, batcher, step_size: int) -> None:
        """Have the batcher's source log `tools/*` per optimizer step (after trainer-side scoring, so on the trained
        samples) when tool metrics apply."""
        if self._tool_calls is not None:
            batcher.dataset = StepCallbackDataset(batcher.dataset, step_size, self._log_tool_metrics)

    def _log_tool_metrics(self, items: list[dict]) -> None:
        statistics = self._tool_statistics([(item["input_ids"], item["completion_mask"]) for item in items])
        for name, value in tool_call_metrics(*statistics.unbind(dim=1)).items():
            self._metrics["train"][f"tools/{name}"].append(value)

    def _score_step(self, samples, context=()) -> torch.Tensor:
        """Advantages (float64, (B,)) of one optimizer step's `RolloutSample`s, in arrival order. `context`: the
        members of the step's groups outside the step (`StepScoringDataset`), which only the group statistics read."""
        # On CPU tensors, on the main process: timed by the host clock.
        with self._timed(ADVANTAGES, "cpu"):
            rows = [*samples, *context]
            masks = [torch.as_tensor(sample.completion_mask) for sample in rows]
            keys = None
            if self._values is not None:
                keys = [self._values.sample_key(sample) for sample in rows]
                self._values.step_scored()
            tool_stats = None
            if self.args.tool_shaping:
                tool_stats = self._tool_statistics([(sample.input_ids, sample.completion_mask) for sample in rows])
            scored = self._scorer.score(
                keys=keys,
                rewards=torch.tensor([sample.metrics["reward"] for sample in rows], dtype=torch.float64),
                versions=[sample.model_version for sample in rows],
                token_counts=torch.stack([mask.sum() for mask in masks]),
                group_ids=torch.tensor([sample.group_id for sample in rows]),
                worker_advantages=torch.tensor([sample.advantage for sample in rows], dtype=torch.float64),
                tool_stats=tool_stats,
                conversations=[_conversation_id(sample) for sample in rows],
                correctness_scores=self._correctness_scores(rows),
                texts=lambda: completion_texts(self.processing_class, rows),
                entry_versions=self._entry_versions(rows),
                in_step=torch.arange(len(rows)) < len(samples),
            )
            if self._values is not None:
                self._values.step_observed(keys[: len(samples)], self.model_version - self.args.max_staleness)
            if self._prompt_priorities is not None:
                scored.metrics["value/effective_prompts"] = self._prompt_priorities.effective_prompts()
            for name, value in scored.metrics.items():
                self._metrics["train"][name].append(value)
            return scored.advantages

    def _entry_versions(self, samples) -> list[int] | None:
        """For a tracker that anchors priors at a prompt's first dispatch (spo++): the version each sample's prior is
        anchored at, as the worker stamped it (None for the other estimators). What a worker did not stamp is said
        once: without conversation ids every row counts as its own outcome; without dispatch versions (another rollout
        worker, a dataset that is not map-style) spo++ anchors at the earliest version scored, which depends on
        arrival order."""
        anchored = self._values is not None and self._values.tracker.ages_by_event
        stamped = [getattr(sample, "prompt_dispatch_version", None) for sample in samples]
        missing = []
        if any(getattr(sample, "rollout_id", None) is None for sample in samples):
            missing.append("which conversation each row comes from (so every row counts as its own outcome)")
        if anchored and None in stamped:
            missing.append(
                "when its prompt was first dispatched (so spo++ anchors a prompt's prior at its earliest scored "
                "version, which depends on the order in which samples arrive)"
            )
        if missing and not self._warned_untracked_samples:
            logger.warning(
                f"The rollout worker's samples do not say {' nor '.join(missing)}; trl_aspo.infra.prompt_stream "
                "stamps both for TRL's and the local rollout worker on a map-style dataset."
            )
            self._warned_untracked_samples = True
        if not anchored:
            return None
        return [
            sample.model_version if first is None else first for first, sample in zip(stamped, samples, strict=True)
        ]

    def _filtered_out(self, sample) -> bool:
        """Whether `filter_zero_variance_groups` drops the sample: its group's rewards are all equal. The group counts
        as consumed, so a resume does not regenerate it (TRL resumes at the first group it has not trained)."""
        if not self.args.filter_zero_variance_groups or self.args.num_generations < 2:
            return False
        if not bool(zero_variance_from_std(torch.tensor(sample.metrics["reward_std"]))):
            return False
        self._trained_groups.add(sample.group_id)
        return True

    def _drop_group_for_logprobs(self, group_id: int) -> None:
        """A group `CheckedRolloutQueue` dropped for its generator log-probs: consumed for resume, as a zero-variance
        group is (`_filtered_out`), and counted in `offpolicy/dropped_groups`."""
        self._trained_groups.add(group_id)
        self._logprob_dropped_groups += 1

    def _correctness_scores(self, samples) -> torch.Tensor | None:
        """The `tool_shaping_correct_reward` function's reward of each sample (the worker logs each function's)."""
        name = self.args.tool_shaping_correct_reward
        if not self.args.tool_shaping or name is None:
            return None
        scored_with = sorted(
            metric[len("rewards/") :] for metric in samples[0].metrics if metric.startswith("rewards/")
        )
        check_correct_reward_name(self.args, scored_with, "the rollout worker scores with")
        return torch.tensor([sample.metrics[f"rewards/{name}"] for sample in samples], dtype=torch.float64)

    def _tool_statistics(self, rows) -> torch.Tensor:
        """(B, 4) `ToolCallCounter` statistics of `(input_ids, completion_mask)` rows (`completion_batch`)."""
        return self._tool_calls(*completion_batch(rows))

    # ---------------------------------------------------------------- checkpoints
    def training_step(self, model, inputs, num_items_in_batch=None):
        """TRL's step; after an optimizer step's last micro-batch, the tracker state before that step's scoring is
        no longer an untrained step's (`ValueTracking.checkpoint_entries`)."""
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._micro_batches_of_step += 1
        if self._micro_batches_of_step == self.args.gradient_accumulation_steps:
            self._micro_batches_of_step = 0
            if self._logprob_dropped_groups is not None:
                self._metrics["train"]["offpolicy/dropped_groups"].append(float(self._logprob_dropped_groups))
                self._logprob_dropped_groups = 0
            if self._values is not None:
                self._values.step_trained()
        return loss

    def _save_rng_state(self, output_dir: str) -> None:
        # The tracker lives on the main process, which scores every rank's samples.
        super()._save_rng_state(output_dir)
        self._save_weight_map(output_dir)
        self._save_rollout_batch_state(output_dir)
        if self._values is not None and self.accelerator.is_main_process:
            _, entries = self._values.checkpoint_entries()
            save_project_state(
                output_dir,
                self.args,
                train_rows(self.train_dataset),
                self.model_version,
                0.0,
                entries.pop("tracker"),
                **entries,
            )

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        self._restore_weight_map(checkpoint)
        self._restore_rollout_batch_state(checkpoint)
        if self._values is not None and self._values.restore(checkpoint) is not None:
            self._values.refresh_priorities()
