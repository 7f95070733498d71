"""`AsyncASPOTrainer`: TRL's experimental `AsyncGRPOTrainer` with the asymmetric loss, single-stream value tracking
and tool shaping (DESIGN.md section 4).

The rollout worker sees one prompt group at a time, so everything that needs more than a group is done here, on the
main process, which holds every rank's samples (TRL dispatches batches from it):

- `StepScoringDataset` sits between TRL's `RolloutQueueDataset` (after its staleness drop) and its fixed-count
  batcher; it takes one optimizer step's samples and replaces their advantages with `single_stream.StepScorer`'s
  (baseline `R - v(x, z)` with `z` the sample's `model_version`, normalization over the step, tool shaping); with
  `filter_zero_variance_groups` it drops all-equal groups before they count.
- The value tracker is saved with every checkpoint (trl_aspo.trainers.checkpoint_state) and restored on resume under the
  synchronous trainer's rules (trl_aspo.values.single_stream).
- With `LocalRolloutWorker`, checkpoints record the first untrained prompt (`rollout_state.json`) and a resumed run
  restarts the worker there, as TRL does for its own worker (`LocalWorkerResumeMixin`).
- `prioritized_sampling`: the rollout worker draws each prompt group by priority from weights in shared memory
  (trl_aspo.infra.prompt_stream) that the trainer refreshes from the tracker after scoring each step.
- `compute_loss` computes `loss_type="aspo"` (trl_aspo.algorithms.losses) on the log-probs of TRL's own packed forward, with
  the generator's log-probs as the old policy, laid out per sample (trl_aspo.algorithms.packed) for the per-completion options.
- `log_weight_map` (trl_aspo.algorithms.weight_map, shared with ASPOTrainer by `WeightMapMixin`) bins every trained token by
  (generator probability, current probability) with its gradient weight in the ppo or aspo loss.

With every new field at its default the trainer is `AsyncGRPOTrainer`: no scoring layer, TRL's loss.
"""

from __future__ import annotations

import collections
import inspect
import logging
import math
from typing import NamedTuple

import torch
from datasets import Dataset
from trl.experimental.async_grpo import AsyncGRPOTrainer
from trl.experimental.async_grpo.async_grpo_trainer import StepIntervalCallback
from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker
from trl.trainer.utils import get_config_model_id

from trl_aspo.algorithms.advantage_checks import advantage_sources, check_finite_advantages
from trl_aspo.algorithms.aspo_metrics import aspo_metric_ratios, aspo_metric_sums
from trl_aspo.algorithms.filters import zero_variance_from_std
from trl_aspo.algorithms.losses import (
    aggregate_loss,
    asymmetric_policy_loss,
    entropy_split_mask,
    step_loss_normalizer,
    unflipped_sample_mask,
)
from trl_aspo.algorithms.packed import SegmentRows, packed_loss_units
from trl_aspo.algorithms.tool_metrics import (
    first_tool_call_positions,
    regex_tool_call_positions,
    resolve_call_token_ids,
    resolve_whitespace_token_ids,
    tool_call_metrics,
)
from trl_aspo.algorithms.weight_map import WeightMapMixin
from trl_aspo.config.async_config import AsyncASPOConfig
from trl_aspo.evaluation.report import generation_attention
from trl_aspo.evaluation.rewards import summed_rewards
from trl_aspo.evaluation.tool_use import evaluate_tool_use
from trl_aspo.infra.fallbacks import install_cpu_fallbacks
from trl_aspo.infra.local_worker import LocalRolloutWorker, LocalWorkerResumeMixin
from trl_aspo.infra.notices import dropped_log_messages
from trl_aspo.infra.prompt_stream import (
    PromptDispatches,
    PromptPriorities,
    attach_prompt_priorities,
    attach_rollout_tracking,
)
from trl_aspo.infra.vllm_cpu import CPUWeightTransfer, on_cpu, tied_parameter_aliases
from trl_aspo.trainers.checkpoint_state import (
    STATE_JSON,
    checkpoint_state_file,
    load_checkpoint_state,
    save_checkpoint_state,
)
from trl_aspo.trainers.resume import TiedWeightsCheckpointMixin
from trl_aspo.values.event_values import AsyncEventValues
from trl_aspo.values.prompt_ids import prompt_key
from trl_aspo.values.single_stream import (
    StepScorer,
    aspo_loss_options,
    check_resume_settings,
    dataset_prompt_keys,
    make_shaping_hooks,
    prompt_ids_by_content,
    require_state_or_reset,
    restore_tracker,
    resume_settings,
    tracker_rewards,
    warn_if_tool_shaping_runs_no_tools,
)

logger = logging.getLogger(__name__)


def _conversation_id(sample) -> tuple[int, str] | object:
    """The rollout a row comes from: its group and TRL's `rollout_id`, which the rows one conversation forks into
    share and independent rollouts never do (even when they wrote the same text), as the tracked loop stamps it
    (trl_aspo.infra.prompt_stream). A row without one (a worker that does not stamp it) is its own rollout."""
    rollout_id = getattr(sample, "rollout_id", None)
    return object() if rollout_id is None else (sample.group_id, rollout_id)


class _RecordingQueue:
    """The rollout queue, remembering the last sample taken: TRL's dataset yields each kept sample right after
    taking it, so the sample behind a yielded item (its prompt, reward, `model_version`) is the last one taken."""

    def __init__(self, queue):
        self.queue = queue
        self.last = None

    def get(self, *args, **kwargs):
        self.last = self.queue.get(*args, **kwargs)
        return self.last

    def qsize(self) -> int:
        return self.queue.qsize()


class StepScoringDataset(torch.utils.data.IterableDataset):
    """Yields TRL's rollout items one optimizer step (`step_size` samples) at a time, with the trainer's advantages.

    The step's samples are taken together, so TRL's staleness check sees them all at the same model version. With
    `filter_zero_variance_groups`, samples of groups whose rewards are all equal are dropped before they count, so
    the step fills with samples that carry a signal (DAPO's dynamic sampling)."""

    def __init__(self, dataset, recorder: _RecordingQueue, trainer: AsyncASPOTrainer, step_size: int):
        self.dataset = dataset
        self.recorder = recorder
        self.trainer = trainer
        self.step_size = step_size

    def __iter__(self):
        pending, dropped = [], 0
        for item in self.dataset:
            sample = self.recorder.last
            if self.trainer._filtered_out(sample):
                dropped += 1
                continue
            pending.append((item, sample))
            if len(pending) < self.step_size:
                continue
            if self.trainer.args.filter_zero_variance_groups:
                share = dropped / (dropped + self.step_size)
                self.trainer._metrics["train"]["filter/zero_variance_dropped_share"].append(share)
            advantages = self.trainer._score_step([sample for _, sample in pending])
            check_finite_advantages(advantages, self.trainer._advantage_sources([sample for _, sample in pending]))
            for (item, _), advantage in zip(pending, advantages.tolist(), strict=True):
                yield {**item, "advantage": advantage}
            pending, dropped = [], 0


class _RolloutTokens(NamedTuple):
    """The fields of a rollout item that `AsyncASPOTrainer._tool_statistics` reads (a `RolloutSample` has them)."""

    input_ids: object
    completion_mask: object


class ToolMetricsDataset(torch.utils.data.IterableDataset):
    """Yields the rollout items unchanged and logs the synchronous trainer's `tools/*` metrics
    (`trl_aspo.algorithms.tool_metrics.tool_call_metrics`) over every `step_size` items (one optimizer step's with fixed-count
    batches), as that trainer does over each generation round."""

    def __init__(self, dataset, trainer: AsyncASPOTrainer, step_size: int):
        self.dataset = dataset
        self.trainer = trainer
        self.step_size = step_size

    def __iter__(self):
        pending = []
        for item in self.dataset:
            pending.append(_RolloutTokens(item["input_ids"], item["completion_mask"]))
            if len(pending) == self.step_size:
                statistics, _ = self.trainer._tool_statistics(pending)
                for name, value in tool_call_metrics(*statistics.unbind(dim=1)).items():
                    self.trainer._metrics["train"][f"tools/{name}"].append(value)
                pending = []
            yield item


class AsyncASPOTrainer(TiedWeightsCheckpointMixin, LocalWorkerResumeMixin, WeightMapMixin, AsyncGRPOTrainer):
    """[`AsyncGRPOTrainer`] configured by [`AsyncASPOConfig`]: same arguments; `args=None` gives the defaults."""

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
        # TRL adds two StepIntervalCallbacks (weight sync, step metrics) on purpose; transformers warns on any repeat.
        with dropped_log_messages("transformers.trainer_callback", f"You are adding a {StepIntervalCallback}"):
            super().__init__(model, reward_funcs, args, *positional, **kwargs)
        if cpu_server and self.accelerator.is_main_process:
            policy = self.accelerator.unwrap_model(self.model)
            self.weight_transfer.aliases = tied_parameter_aliases(policy)
            self.weight_transfer.trained_dtype = str(policy.dtype).removeprefix("torch.")
            self.weight_transfer.model_name = get_config_model_id(policy.config)
        # The rollout worker runs the tools of these arguments (TRL's worker; the CLI hands the same to its local one).
        runs_tools = bool(self._prepass_inputs["tools"]) or self._prepass_inputs["environment_factory"] is not None
        warn_if_tool_shaping_runs_no_tools(self.args, "tools= or environment_factory=", runs_tools)
        self._scorer = StepScorer(self.args, self.train_dataset)
        # As the synchronous trainer: tool metrics when tools run, a pattern detects calls, or shaping reads them.
        self._logs_tool_metrics = runs_tools or self.args.tool_shaping or self.args.tool_call_pattern is not None
        self._call_token_ids = self._whitespace_token_ids = []
        if self._logs_tool_metrics and self.args.tool_call_pattern is None:
            self._call_token_ids = resolve_call_token_ids(self.processing_class, self.args.tool_call_opener)
            self._whitespace_token_ids = resolve_whitespace_token_ids(self.processing_class)
        self._shaping_hooks = make_shaping_hooks(self.args)
        self._aspo_micro_batches = 0  # seeds the per-micro-batch draw of aspo_unflipped_fraction
        self._ids_by_prompt = None
        if self.args.prompt_id_column is not None:
            self._ids_by_prompt = prompt_ids_by_content(self.train_dataset, self.args)
        self._prompt_priorities = self._start_prompt_priorities() if self.args.prioritized_sampling else None
        self._prompt_dispatches = self._start_rollout_tracking() if self._scorer.tracker is not None else None
        self._warned_untracked_samples = False
        # Tracker states before each scored step that is not trained yet, oldest first (see `_trained_tracker_state`).
        self._untrained_tracker_states: collections.deque[dict] = collections.deque()
        self._micro_batches_of_step = 0
        self._start_weight_map()

    # ---------------------------------------------------------------- value pre-pass
    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """`Trainer.train`, preceded on a fresh start by the value pre-pass when `value_init_samples > 0` (as in
        ASPOTrainer: a resumed run restores its tracker from the checkpoint instead)."""
        if (
            self._scorer.tracker is not None
            and self.args.value_init_samples > 0
            and not resume_from_checkpoint
            and self.state.global_step == 0
            and self.accelerator.is_main_process
        ):
            self._value_init_prepass()
        return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)

    def _value_init_prepass(self) -> None:
        """Initialize the tracker from `value_init_samples` completions per training prompt of the starting policy.

        The rollouts run on the trainer's policy with the tool loop of `trl_aspo.evaluation.tool_use` (TRL's, at the training
        temperature, `max_completion_length` and `max_tool_calling_iterations`), scored by the sum of the reward
        functions as the rollout worker scores (weight 1 each; NaN where every function abstains). A prompt's
        successes are its summed rewards mapped to [0, 1] and its trials its scorable samples; priors are anchored at
        version 0, the start of training."""
        if self._prepass_inputs["environment_factory"] is not None:
            raise ValueError(
                "AsyncASPOConfig.value_init_samples does not support `environment_factory` (environments own the "
                "rollout state); initialize the tracker with value_init_file instead."
            )
        dataset = self.train_dataset
        if not isinstance(dataset, Dataset):
            raise ValueError("AsyncASPOConfig.value_init_samples needs a map-style `datasets.Dataset` of prompts.")
        keys = dataset_prompt_keys(dataset, self.args)
        first_rows: dict[str, int] = {}
        for row, key in enumerate(keys):
            first_rows.setdefault(key, row)
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
        prompt_keys = list(first_rows)
        rewards = torch.tensor([record["reward"] for record in result["records"]], dtype=torch.float64)
        outcomes = tracker_rewards(rewards, self.args)
        successes, trials = [0.0] * len(prompt_keys), [0] * len(prompt_keys)
        for record, outcome in zip(result["records"], outcomes.tolist(), strict=True):
            if not math.isnan(outcome):
                successes[record["problem"]] += outcome
                trials[record["problem"]] += 1
        scored = [index for index, count in enumerate(trials) if count > 0]
        self._scorer.tracker.init_from_counts(
            [prompt_keys[i] for i in scored],
            [successes[i] for i in scored],
            [trials[i] for i in scored],
            prior_strength=self.args.value_prior_strength,
        )
        if self._prompt_priorities is not None:
            self._refresh_priorities(self._dataset_keys)

    # ---------------------------------------------------------------- what the worker records for the tracker
    def _start_rollout_tracking(self) -> PromptDispatches | None:
        """Make TRL's or the local rollout worker stamp each row with its conversation and (spo++, map-style
        dataset) its prompt's first dispatch version, recorded in a shared table this returns (None otherwise). Any
        other worker's rows are scored without them (`_score_step` says so once)."""
        if not isinstance(self.rollout_worker, AsyncRolloutWorker | LocalRolloutWorker):
            return None
        dispatches = None
        if self.args.advantage_estimator == "spo++" and isinstance(self.train_dataset, Dataset):
            if not hasattr(self, "_dataset_keys"):
                self._dataset_keys = dataset_prompt_keys(self.train_dataset, self.args)
            dispatches = PromptDispatches(self._dataset_keys)
        attach_rollout_tracking(self.rollout_worker, dispatches)
        return dispatches

    # ---------------------------------------------------------------- prioritized prompt stream
    def _start_prompt_priorities(self) -> PromptPriorities:
        """Per-row priorities of `train_dataset` from the tracker, handed to the rollout worker's loop."""
        dataset = self.train_dataset
        if not isinstance(dataset, Dataset):
            raise ValueError(
                "AsyncASPOConfig.prioritized_sampling=True needs train_dataset to be a map-style datasets.Dataset "
                f"(the worker draws rows by index), got {type(dataset).__name__}."
            )
        # The key `_score_step` gives a sample (its prompt's content hash), so scored prompts map back to rows.
        self._dataset_keys = dataset_prompt_keys(dataset, self.args)
        self._rows_of_key: dict[str, list[int]] = {}
        for row, key in enumerate(self._dataset_keys):
            self._rows_of_key.setdefault(key, []).append(row)
        self._warned_unknown_prompts = False
        priorities = PromptPriorities(
            self._priority_values(self._dataset_keys), seed=self.args.seed, epsilon=self.args.priority_epsilon
        )
        if self.rollout_worker is not None:
            attach_prompt_priorities(self.rollout_worker, priorities)
        return priorities

    def _priority_values(self, keys: list[str]) -> torch.Tensor:
        """Tracker values of `keys` for the next samples: spo++ reads them at the next model version, so every
        outcome received so far is visible."""
        if isinstance(self._scorer.tracker, AsyncEventValues):
            return self._scorer.tracker.value(keys, self.model_version + 1)
        return self._scorer.tracker.value(keys)

    def _refresh_priorities(self, keys: list[str]) -> None:
        """Recompute the weights of the rows of `keys` (a value changes only when its prompt gets an outcome)."""
        unknown = [key for key in dict.fromkeys(keys) if key not in self._rows_of_key]
        if unknown and not self._warned_unknown_prompts:
            logger.warning(
                f"prioritized_sampling: {len(unknown)} scored prompt(s) match no train_dataset prompt (the worker "
                "changed them?), so no dataset row's weight follows their values."
            )
            self._warned_unknown_prompts = True
        rows = [row for key in dict.fromkeys(keys) for row in self._rows_of_key.get(key, ())]
        self._prompt_priorities.update(rows, self._priority_values([self._dataset_keys[row] for row in rows]))
        self._metrics["train"]["value/effective_prompts"].append(self._prompt_priorities.effective_prompts())

    def _after_tracker_restored(self) -> None:
        """After a resume replaced the tracker: every row's weight from it."""
        if self._prompt_priorities is not None:
            self._refresh_priorities(self._dataset_keys)

    # ---------------------------------------------------------------- trainer-side scoring
    def get_train_dataloader(self):
        """TRL's dataloader; with trainer-side scoring, its fixed-count batcher reads `StepScoringDataset` (the
        only hook: TRL builds the rollout dataset and the batcher inside this method)."""
        if not self.accelerator.is_main_process:
            return super().get_train_dataloader()
        step_size = self.args.per_device_train_batch_size * self.accelerator.num_processes
        step_size *= self.args.gradient_accumulation_steps
        if not self.args.scores_on_trainer:
            dataloader = super().get_train_dataloader()
            self._log_tool_metrics_of(dataloader.dataset, step_size)
            return dataloader
        recorder = _RecordingQueue(self.rollout_queue)
        self.rollout_queue = recorder
        try:
            dataloader = super().get_train_dataloader()
        finally:
            self.rollout_queue = recorder.queue
        batcher = dataloader.dataset
        batcher.dataset = StepScoringDataset(batcher.dataset, recorder, self, step_size)
        self._log_tool_metrics_of(batcher, step_size)
        return dataloader

    def _log_tool_metrics_of(self, batcher, step_size: int) -> None:
        """Have the batcher's source log `tools/*` per optimizer step (after trainer-side scoring, so on the trained
        samples) when tool metrics apply."""
        if self._logs_tool_metrics:
            batcher.dataset = ToolMetricsDataset(batcher.dataset, self, step_size)

    def _score_step(self, samples) -> torch.Tensor:
        """Advantages (float64, (B,)) of one optimizer step's `RolloutSample`s, in arrival order."""
        masks = [torch.as_tensor(sample.completion_mask) for sample in samples]
        keys = [self._sample_key(sample) for sample in samples]
        if self._scorer.tracker is not None:
            self._untrained_tracker_states.append(self._scorer.tracker.state_dict())
        tool_positions = extras = None
        if self.args.tool_shaping:
            statistics, texts = self._tool_statistics(samples)
            tool_positions, extras = statistics[:, 0], self._shaping_extras(statistics, texts)
        scored = self._scorer.score(
            keys=keys,
            rewards=torch.tensor([sample.metrics["reward"] for sample in samples], dtype=torch.float64),
            versions=[sample.model_version for sample in samples],
            token_counts=torch.stack([mask.sum() for mask in masks]),
            group_ids=torch.tensor([sample.group_id for sample in samples]),
            worker_advantages=torch.tensor([sample.advantage for sample in samples], dtype=torch.float64),
            worker_reward_std=torch.tensor([sample.metrics["reward_std"] for sample in samples], dtype=torch.float64),
            tool_positions=tool_positions,
            conversations=[_conversation_id(sample) for sample in samples],
            correctness_scores=self._correctness_scores(samples),
            shaping_extras=extras,
            entry_versions=self._entry_versions(samples),
        )
        if hasattr(self._scorer.tracker, "advance"):
            self._scorer.tracker.advance(max(0, self.model_version - self.args.max_staleness))
        for name, value in scored.metrics.items():
            self._metrics["train"][name].append(value)
        if self._prompt_priorities is not None:
            self._refresh_priorities(keys)
        return scored.advantages

    def _entry_versions(self, samples) -> list[int] | None:
        """spo++: the version each sample's prior is anchored at, its prompt's first dispatch as the worker stamped
        it (None for the other estimators). What a worker did not stamp is said once: without conversation ids every
        row counts as its own outcome; without dispatch versions (another rollout worker, a dataset that is not
        map-style) spo++ anchors at the earliest version scored, which depends on arrival order."""
        spo_plus_plus = self.args.advantage_estimator == "spo++"
        stamped = [getattr(sample, "prompt_dispatch_version", None) for sample in samples]
        missing = []
        if any(getattr(sample, "rollout_id", None) is None for sample in samples):
            missing.append("which conversation each row comes from (so every row counts as its own outcome)")
        if spo_plus_plus and None in stamped:
            missing.append(
                "when its prompt was first dispatched (so spo++ anchors a prompt's prior at its earliest scored "
                "version, which depends on the order in which samples arrive)"
            )
        if missing and not self._warned_untracked_samples:
            logger.warning(
                f"The rollout worker's samples do not say {' nor '.join(missing)}; trl_aspo.infra.prompt_stream stamps both "
                "for TRL's and the local rollout worker on a map-style dataset."
            )
            self._warned_untracked_samples = True
        if not spo_plus_plus:
            return None
        return [
            sample.model_version if first is None else first for first, sample in zip(stamped, samples, strict=True)
        ]

    def _advantage_sources(self, samples) -> dict:
        """What fed one optimizer step's advantages (per sample), named for `check_finite_advantages`."""
        rewards = torch.tensor([sample.metrics["reward"] for sample in samples], dtype=torch.float64)
        return advantage_sources(self.args, {"reward": rewards})

    def _filtered_out(self, sample) -> bool:
        """Whether `filter_zero_variance_groups` drops the sample: its group's rewards are all equal. The group counts
        as consumed, so a resume does not regenerate it (TRL resumes at the first group it has not trained)."""
        if not self.args.filter_zero_variance_groups or self.args.num_generations < 2:
            return False
        if not bool(zero_variance_from_std(torch.tensor(sample.metrics["reward_std"]))):
            return False
        self._trained_groups.add(sample.group_id)
        return True

    def _sample_key(self, sample) -> str:
        """The tracker key of a sample: its prompt's content hash, or its `prompt_id_column` id."""
        content = prompt_key(sample.prompt)
        if self._ids_by_prompt is None:
            return content
        if content not in self._ids_by_prompt:
            raise ValueError(
                f"AsyncASPOConfig.prompt_id_column={self.args.prompt_id_column!r}: a sample's prompt matches no "
                "train_dataset row, so its id is unknown (did the rollout worker or an environment change the "
                "prompt?). Leave prompt_id_column unset to key prompts by their content."
            )
        return self._ids_by_prompt[content]

    def _correctness_scores(self, samples) -> torch.Tensor | None:
        """The `tool_shaping_correct_reward` function's reward of each sample (the worker logs each function's)."""
        name = self.args.tool_shaping_correct_reward
        if not self.args.tool_shaping or name is None:
            return None
        key = f"rewards/{name}"
        if key not in samples[0].metrics:
            names = sorted(metric[len("rewards/") :] for metric in samples[0].metrics if metric.startswith("rewards/"))
            raise ValueError(
                f"AsyncASPOConfig.tool_shaping_correct_reward={name!r} names no reward function; the rollout worker "
                f"scores with {names}."
            )
        return torch.tensor([sample.metrics[key] for sample in samples], dtype=torch.float64)

    def _tool_statistics(self, samples) -> tuple[torch.Tensor, list[str]]:
        """Per sample, (B, 4) long: action tokens before the first tool call (-1 for none), action tokens, calls and
        interactive turns, counted from its first completion token (by `tool_call_pattern` on the decoded text when
        set, else by `tool_call_opener`'s tokens), and the decoded completions (tool outputs included) when the
        pattern or a shaping extra reads them (empty otherwise: decoding every sample costs time on each step)."""
        rows, texts = [], []
        decode = self.args.tool_call_pattern is not None or bool(self._shaping_hooks)
        for sample in samples:
            mask = torch.as_tensor(sample.completion_mask)
            start = int(mask.nonzero()[0]) if bool(mask.any()) else mask.numel()
            ids = torch.as_tensor(sample.input_ids)[start:].unsqueeze(0)
            action = mask[start:].unsqueeze(0)
            if decode:
                texts.append(self.processing_class.decode(ids[0], skip_special_tokens=True))
            if self.args.tool_call_pattern is not None:
                stats = regex_tool_call_positions(
                    texts[-1:], ids, self.processing_class, self.args.tool_call_pattern, action
                )
            else:
                stats = first_tool_call_positions(
                    ids, action, torch.ones_like(action), self._call_token_ids, self._whitespace_token_ids
                )
            rows.append(torch.stack([value[0] for value in stats]))
        return torch.stack(rows), texts

    def _shaping_extras(self, statistics: torch.Tensor, texts: list[str]):
        """The optional shaping extras (trl_aspo.values.single_stream.make_shaping_hooks) as a function of the advantages
        they are added to, or None without any."""
        if not self._shaping_hooks:
            return None
        positions, lengths, calls, turns = statistics.unbind(dim=1)

        def extras(advantages: torch.Tensor) -> torch.Tensor:
            bias = torch.zeros_like(advantages)
            for hook in self._shaping_hooks:
                bias = bias + hook(texts, positions, lengths, calls, turns, advantages).to(bias)
            return bias

        return extras

    # ---------------------------------------------------------------- checkpoints
    def training_step(self, model, inputs, num_items_in_batch=None):
        """TRL's step; after an optimizer step's last micro-batch, the tracker state before that step's scoring is
        no longer an untrained step's (`_trained_tracker_state`)."""
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._micro_batches_of_step += 1
        if self._micro_batches_of_step == self.args.gradient_accumulation_steps:
            self._micro_batches_of_step = 0
            if self._untrained_tracker_states:
                self._untrained_tracker_states.popleft()
        return loss

    def _trained_tracker_state(self) -> dict:
        """The tracker state of the trained steps: the data loader fetches (and `_score_step` scores) one step ahead
        of training, so when a checkpoint is written the next step's outcomes are already observed. The checkpoint
        gets the state from before that step's scoring, the tracker of its weights: the resumed worker starts at
        the first untrained prompt and regenerates that step, whose outcomes are then observed once. (One state
        dict is kept per scored step not yet trained: O(tracked prompts) per step.)"""
        if self._untrained_tracker_states:
            return self._untrained_tracker_states[0]
        return self._scorer.tracker.state_dict()

    def _save_rng_state(self, output_dir: str) -> None:
        # The smallest hook of `Trainer._save_checkpoint` run inside the new checkpoint before trainer_state.json
        # marks it complete (as ASPOTrainer). The tracker lives on the main process, which scores every rank's samples.
        super()._save_rng_state(output_dir)
        self._save_weight_map(output_dir)
        if self._scorer.tracker is not None and self.accelerator.is_main_process:
            state = {
                "value_event": int(self.model_version),
                "aspo_kl_coef": 0.0,
                "tracker": self._trained_tracker_state(),
                "config": self._resume_config(),
            }
            if self._prompt_dispatches is not None:
                # Every dispatch so far, also of groups still in flight: the uninterrupted run keeps those too.
                state["prompt_dispatches"] = self._prompt_dispatches.state_dict()
            save_checkpoint_state(output_dir, state)

    def _resume_config(self) -> dict:
        train_rows = len(self.train_dataset) if isinstance(self.train_dataset, Dataset) else None
        return resume_settings(self.args, train_rows)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        self._restore_weight_map(checkpoint)
        if self._scorer.tracker is None:
            return
        path = checkpoint_state_file(checkpoint)
        if path is None:
            require_state_or_reset(self.args, checkpoint, STATE_JSON)
            return
        state = load_checkpoint_state(checkpoint)
        fresh = check_resume_settings(
            self.args, state.get("config"), self._resume_config(), path, has_tracker="tracker" in state
        )
        if not fresh:
            restore_tracker(self._scorer.tracker, state, path, self.args)
            if self._prompt_dispatches is not None and "prompt_dispatches" in state:
                try:
                    self._prompt_dispatches.load_state_dict(state["prompt_dispatches"])
                except ValueError as error:
                    raise ValueError(f"checkpoint state {path}: {error}") from None
        self._untrained_tracker_states.clear()
        self._after_tracker_restored()

    # ---------------------------------------------------------------- asymmetric loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """loss_type='aspo': TRL's packed forward and accounting run unchanged (its PPO loss is inlined there, so
        there is no smaller method to override); the returned loss is the asymmetric one on the same log-probs.

        With `log_weight_map`, every trained token enters the map, old probability = the generator's: unlike the
        synchronous trainer's on-policy passes (where TRL passes no old log-probs and r = 1 exactly), every sample
        here carries the rollout's log-probs, from a policy up to `max_staleness` versions behind and computed by
        another engine, and each sample trains once, so there is no pass to skip. With loss_type='ppo' the weight
        is TRL's clipped surrogate's, `clipped_ratio_weight` without `delta`."""
        collects_weight_map = self._weight_map is not None and self.model.training
        if self.args.loss_type != "aspo" and not collects_weight_map:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        captured = {}

        def forward(**kwargs):
            captured["outputs"] = model(**kwargs)
            return captured["outputs"]

        ppo_loss = super().compute_loss(forward, inputs, return_outputs, num_items_in_batch)
        outputs = captured["outputs"]
        selected = inputs["token_index"] >= 0
        token_index = inputs["token_index"][selected]
        if self.args.loss_type == "ppo":
            # TRL's loss runs on the flat (M,) targets: one (1, M) row of action tokens.
            old_log_probs, advantages = inputs["old_log_probs"][selected][None], inputs["advantages"][selected][None]
            log_probs = outputs.log_probs.flatten()[token_index][None].detach()
            self._add_clipped_ratio_weight_map(old_log_probs, log_probs, advantages, torch.ones_like(log_probs))
            return ppo_loss
        rows = SegmentRows(inputs["segment_id"][selected])
        log_probs = rows.to_rows(outputs.log_probs.flatten()[token_index])
        old_log_probs = rows.to_rows(inputs["old_log_probs"][selected])
        advantages = rows.to_rows(inputs["advantages"][selected])
        args = self.args
        high_entropy = None
        if args.aspo_entropy_quantile is not None:
            entropies = rows.to_rows(outputs.entropy.flatten()[token_index].detach())
            high_entropy = entropy_split_mask(entropies, rows.mask, args.aspo_entropy_quantile)
        unflipped = None
        if args.aspo_unflipped_fraction > 0:
            # Drawn among this micro-batch's positive-advantage samples (the synchronous trainer draws per round).
            generator = torch.Generator().manual_seed(args.seed * 1_000_003 + self._aspo_micro_batches)
            unflipped = unflipped_sample_mask(advantages[:, 0], args.aspo_unflipped_fraction, generator)
        self._aspo_micro_batches += 1
        per_token_loss, stats = asymmetric_policy_loss(
            log_probs,
            old_log_probs,
            advantages,
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            high_entropy_mask=high_entropy,
            unflipped_mask=unflipped,
            **aspo_loss_options(args, self.state.global_step),
        )
        # Every action token (or completion) of the optimizer step weighs the same across ranks and micro-batches.
        units = self._aspo_step_units[0 if args.aspo_aggregation == "token" else 1]
        normalizer = step_loss_normalizer(units, self.accelerator.num_processes).to(per_token_loss)
        loss = aggregate_loss(per_token_loss, rows.mask, args.aspo_aggregation, normalizer)
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * outputs.aux_loss / self.current_gradient_accumulation_steps
        if collects_weight_map:
            self._add_aspo_weight_map(old_log_probs, log_probs, advantages, rows.mask, stats)
        self._log_aspo_metrics(stats, rows.mask, per_token_loss.detach())
        return loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """AsyncGRPOTrainer's log; in training it also closes the weight map's logging window (every rank logs)."""
        if self._weight_map is not None and self.model.training:
            self._log_weight_map()
        super().log(logs, start_time)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """`Trainer.get_batch_samples` (one optimizer step's micro-batches), also counting the step's action tokens
        and completions over all its micro-batches and ranks for `aspo_aggregation` (`_aspo_step_units`)."""
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self.args.loss_type == "aspo":
            local = [packed_loss_units(batch["segment_id"][batch["token_index"] >= 0]) for batch in batch_samples]
            local = torch.stack(local).sum(0) if local else torch.zeros(2)
            self._aspo_step_units = self.accelerator.reduce(local.to(self.accelerator.device), reduction="sum")
        return batch_samples, num_items_in_batch

    def _log_aspo_metrics(self, stats: dict[str, torch.Tensor], mask: torch.Tensor, per_token_loss: torch.Tensor):
        """The synchronous trainer's `aspo/*` ratios over the logging window (trl_aspo.algorithms.aspo_metrics), and
        `policy_loss`, the token mean of the per-token loss, summed over ranks (TRL reduces the pairs)."""
        columns = torch.cat([aspo_metric_sums(stats, mask), (per_token_loss * mask).sum().float().view(1)])
        totals = self.accelerator.reduce(columns, reduction="sum").tolist()
        metrics = self._metrics["train"]
        for name, pair in aspo_metric_ratios(totals[:-1]).items():
            metrics[name].append(pair)
        if totals[-2] > 0:
            metrics["policy_loss"].append((totals[-1], totals[-2]))
