"""`ASPOTrainer`: TRL's `GRPOTrainer` conducting the pure functions of trl-aspo.

The trainer only gathers data across ranks, calls the functions of `losses`, `shaping`, `tool_metrics`, `tracker`,
`normalize` and `sampler`, and logs. Per generation round (see DESIGN.md, "Data flow"):

    prompts --(sampler)--> TRL generation and rewards --> baseline (group mean | tracker value frozen at dispatch)
      --> normalization (group | batch | token measure) --> tool-position shaping --> per-token loss (TRL | aspo)
      --> the tracker observes the round's outcomes before the next dispatch

With every switch of `ASPOConfig` at its default the trainer computes exactly what `GRPOTrainer` computes.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect
import math
import os

import torch
from accelerate.utils import gather_object
from datasets import IterableDataset
from tqdm.auto import tqdm
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOConfig, GRPOTrainer

from .config import SINGLE_STREAM_ESTIMATORS, ASPOConfig
from .losses import (
    aggregate_loss,
    asymmetric_policy_loss,
    entropy_split_mask,
    progressive_flip_threshold,
    repetition_rate,
    unflipped_sample_mask,
)
from .normalize import batch_normalize, token_measure_normalize
from .prompt_ids import prompt_key, prompt_keys
from .sampler import PrioritizedRepeatSampler, effective_num_prompts
from .shaping import CallablePenalty, InteractiveTurnBonus, shaping_stats, tool_position_bias
from .tool_metrics import (
    first_tool_call_positions,
    regex_tool_call_positions,
    resolve_call_token_ids,
    tool_call_metrics,
)
from .tracker import EventValueTracker, VisitValueTracker, kl_adaptive_rho
from .value_init import prepass_plan, read_init_counts

STATE_FILE = "aspo_state.pt"
# Keys of a TRL batch that `_get_per_token_logps_and_entropies` takes for multimodal models.
_FORWARD_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


def _as_aspo_config(args: GRPOConfig) -> GRPOConfig:
    """Give a plain `GRPOConfig` the ASPOConfig fields at their defaults (every new feature off)."""
    for config_field in dataclasses.fields(ASPOConfig):
        if not hasattr(args, config_field.name):
            setattr(args, config_field.name, config_field.default)
    if args.advantage_normalization is None:
        args.advantage_normalization = "group"
    return args


def _import_callable(dotted_path: str, field_name: str):
    module_name, _, attribute = dotted_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(f"ASPOConfig.{field_name}={dotted_path!r} could not be imported: {error}") from None


class ASPOTrainer(GRPOTrainer):
    """Drop-in replacement for `trl.GRPOTrainer` adding the asymmetric IS loss (`loss_type="aspo"`), tool-position
    advantage shaping (`tool_shaping=True`) and single-stream value tracking (`advantage_estimator="spo"|"spo++"`).

    Takes exactly `GRPOTrainer`'s arguments. `model` may also name a built-in model (`"builtin:tiny-calculator"`,
    `"builtin:tiny-random"`), loaded locally with its tokenizer.
    """

    _tag_names = ["trl", "grpo", "aspo"]
    _name = "ASPO"

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, *positional, **kwargs):
        if isinstance(model, str) and model.startswith("builtin:"):
            from .builtin import load_builtin

            model, tokenizer = load_builtin(model)
            if kwargs.get("processing_class") is None and len(positional) < 3:
                kwargs["processing_class"] = tokenizer
        if args is None:
            model_name = model if isinstance(model, str) else model.config._name_or_path or "model"
            args = ASPOConfig(f"{model_name.split('/')[-1]}-ASPO")
        args = _as_aspo_config(args)
        super().__init__(model, reward_funcs, args, *positional, **kwargs)

        if args.prioritized_sampling and isinstance(self.train_dataset, IterableDataset):
            raise ValueError(
                "ASPOConfig.prioritized_sampling needs a map-style `datasets.Dataset`: an iterable dataset streams "
                "its rows in order and cannot be drawn from by priority."
            )
        self._single_stream = args.advantage_estimator in SINGLE_STREAM_ESTIMATORS
        self._value_event = 0
        self._pending_visit = None
        if args.advantage_estimator == "spo++":
            self._value_tracker = EventValueTracker(rho=args.value_rho)
        elif args.advantage_estimator == "spo":
            self._value_tracker = VisitValueTracker()
        else:
            self._value_tracker = None
        if self._value_tracker is not None and args.value_init_file is not None:
            self._init_values_from_file(args.value_init_file)

        self._call_token_ids = resolve_call_token_ids(self.processing_class, args.tool_call_opener)
        self._shaping_hooks = []
        if args.tool_shaping_interactive_bonus > 0:
            self._shaping_hooks.append(InteractiveTurnBonus(bonus=args.tool_shaping_interactive_bonus))
        if args.tool_shaping_penalty is not None:
            self._shaping_hooks.append(
                CallablePenalty(_import_callable(args.tool_shaping_penalty, "tool_shaping_penalty"))
            )
        if (
            args.tool_shaping_correct_reward is not None
            and args.tool_shaping_correct_reward not in self.reward_func_names
        ):
            raise ValueError(
                f"ASPOConfig.tool_shaping_correct_reward={args.tool_shaping_correct_reward!r} names no reward "
                f"function; the reward functions are {self.reward_func_names}."
            )
        self._aspo_kl_coef = self.beta
        self._aspo_entropy_window = None

    # ---------------------------------------------------------------- sampling
    def _get_train_sampler(self, dataset=None):
        if not self.args.prioritized_sampling:
            return super()._get_train_sampler(dataset)
        dataset = self.train_dataset if dataset is None else dataset
        self._dataset_keys = self._keys_of_rows(dataset)
        self._priority_sampler = PrioritizedRepeatSampler(
            len(dataset),
            mini_repeat_count=self.num_generations,
            batch_size=self.args.generation_batch_size // self.num_generations,
            repeat_count=self.num_iterations * self.args.steps_per_generation,
            seed=self.args.seed,
            epsilon=self.args.priority_epsilon,
        )
        self._refresh_priorities()
        return self._priority_sampler

    def _keys_of_rows(self, dataset) -> list[str]:
        column = self.args.prompt_id_column
        if column is not None:
            if column not in dataset.column_names:
                raise ValueError(
                    f"ASPOConfig.prompt_id_column={column!r} is not a dataset column; columns: {dataset.column_names}."
                )
            return [str(value) for value in dataset[column]]
        return [prompt_key(prompt) for prompt in dataset["prompt"]]

    def _refresh_priorities(self) -> None:
        """Set the sampler's weights from the tracker's current values (identical on every rank: the tracker is)."""
        if getattr(self, "_priority_sampler", None) is None:
            return
        self._priority_sampler.set_values(self._tracker_values(self._dataset_keys))

    def _tracker_values(
        self, keys: list[str], tracker: EventValueTracker | VisitValueTracker | None = None
    ) -> torch.Tensor:
        """Values of `keys` at the current event, from the training tracker unless another `tracker` is given."""
        tracker = self._value_tracker if tracker is None else tracker
        if isinstance(tracker, EventValueTracker):
            return tracker.value(keys, self._value_event)
        return tracker.value(keys)

    # ---------------------------------------------------------------- advantages
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # Kept for the advantage step: TRL computes its group baseline inline and does not return the gathered rewards.
        self._gathered_rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        return self._gathered_rewards_per_func

    def _generate_and_score_completions(self, inputs):
        mode = "train" if self.model.training else "eval"
        if mode == "train" and self._single_stream:
            self._observe_pending_visit()
            keys = gather_object(prompt_keys(inputs, self.args.prompt_id_column))
            dispatch_values = self._tracker_values(keys).float()
        output = super()._generate_and_score_completions(inputs)
        if mode != "train":
            return output

        device = self.accelerator.device
        action_mask = output["completion_mask"] * output.get("tool_mask", 1)
        tool_stats = self._tool_statistics(output)  # (N, 4) gathered: position, length, calls, turns
        rewards_per_func = self._gathered_rewards_per_func
        rewards = (rewards_per_func * self.reward_weights.to(device)).nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
        scorable = ~torch.isnan(rewards)

        if self._single_stream:
            outcomes = self._rewards_for_tracker(rewards)
            centered = outcomes - dispatch_values.to(device)
            self._log_tracker_metrics(dispatch_values)
        else:
            grouped = rewards.view(-1, self.num_generations)
            centered = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)).view(-1)
        centered = torch.where(scorable, centered, torch.zeros_like(centered))

        rewrite = self._single_stream or self.args.advantage_normalization != "group" or self.args.tool_shaping
        # Completions without policy-gradient signal: zero advantage after baseline and normalization (TRL's own group
        # scaling is zero exactly where the centered reward is). Under the group baseline, all-equal groups; under the
        # tracker, completions whose R - v equals the batch mean (e.g. every reward 0 while every value is equal).
        unsignaled = centered
        if rewrite:
            advantages = self._normalize(centered, output, tool_stats[:, 1], scorable)
            unsignaled = torch.where(scorable, advantages, torch.zeros_like(advantages))
            if self.args.tool_shaping:
                advantages = self._shape(advantages, rewards_per_func, rewards, tool_stats, output)
            advantages = torch.where(scorable, advantages, torch.zeros_like(advantages))
            output["advantages"] = self._local_slice(advantages, inputs)
            # The deque holds one generation batch: extending replaces TRL's logged advantages with the final ones.
            self._logs["advantages"].extend(advantages.tolist())
        self._metrics[mode]["zero_advantage_share"].append(
            torch.isclose(unsignaled, torch.zeros_like(unsignaled), atol=1e-6).float().mean().item()
        )

        if self._single_stream:
            self._observe(keys, outcomes, scorable, output)
        if self.loss_type == "aspo" and self.args.aspo_unflipped_fraction > 0:
            generator = torch.Generator().manual_seed(self.args.seed * 1_000_003 + self._value_event)
            draw = unflipped_sample_mask(len(rewards), self.args.aspo_unflipped_fraction, generator)
            output["aspo_unflipped"] = self._local_slice(draw, inputs)
        completion_repeats = repetition_rate(output["completion_ids"], action_mask)
        self._metrics[mode]["repetition_rate"].append(self.accelerator.gather(completion_repeats).mean().item())
        self._value_event += 1
        return output

    def _local_slice(self, gathered: torch.Tensor, inputs) -> torch.Tensor:
        start = self.accelerator.process_index * len(inputs)
        return gathered[start : start + len(inputs)].to(self.accelerator.device)

    def _normalize(self, centered, output, lengths, scorable) -> torch.Tensor:
        """Scale the centered advantages; unscorable completions take no part in the statistics and stay at 0."""
        normalization = self.args.advantage_normalization
        if normalization == "group":
            return self.accelerator.gather(output["advantages"])
        normalized = torch.zeros_like(centered)
        if normalization == "batch":
            normalized[scorable] = batch_normalize(centered[scorable])
        else:
            normalized[scorable] = token_measure_normalize(centered[scorable], lengths[scorable])
        return normalized

    def _tool_statistics(self, output) -> torch.Tensor:
        if self.args.tool_call_pattern is not None:
            stats = regex_tool_call_positions(
                None,
                output["completion_ids"],
                self.processing_class,
                self.args.tool_call_pattern,
                output.get("tool_mask"),
                completion_mask=output["completion_mask"],
            )
        else:
            stats = first_tool_call_positions(
                output["completion_ids"], output.get("tool_mask"), output["completion_mask"], self._call_token_ids
            )
        gathered = self.accelerator.gather(torch.stack(stats, dim=1).to(self.accelerator.device))
        if self.tools or self.args.tool_call_pattern is not None or self.args.tool_shaping:
            for name, value in tool_call_metrics(*gathered.unbind(dim=1)).items():
                self._metrics["train"][f"tools/{name}"].append(value)
        return gathered

    def _shape(self, advantages, rewards_per_func, rewards, tool_stats, output) -> torch.Tensor:
        args = self.args
        if args.tool_shaping_correct_reward is None:
            score = rewards
        else:
            score = rewards_per_func[:, self.reward_func_names.index(args.tool_shaping_correct_reward)]
        positions, lengths, calls, turns = tool_stats.unbind(dim=1)
        eligible = (torch.nan_to_num(score, nan=-torch.inf) > args.tool_shaping_correct_threshold) & (positions >= 0)
        if self.num_generations > 1:
            groups = torch.arange(len(advantages), device=advantages.device) // self.num_generations
        else:
            groups = torch.zeros(len(advantages), dtype=torch.long, device=advantages.device)
        bias = tool_position_bias(
            advantages, positions, lengths, eligible, groups, delta=args.tool_shaping_delta, k=args.tool_shaping_k
        )
        if self._shaping_hooks:
            texts = gather_object(
                self.processing_class.batch_decode(output["completion_ids"], skip_special_tokens=True)
            )
            for hook in self._shaping_hooks:
                bias = bias + hook(texts, positions, lengths, calls, turns, advantages).to(bias)
        for name, value in shaping_stats(bias, eligible).items():
            self._metrics["train"][f"shaping/{name}"].append(value)
        return advantages + bias

    # ---------------------------------------------------------------- value tracker
    def _rewards_for_tracker(self, rewards: torch.Tensor) -> torch.Tensor:
        if self.args.value_reward_range is not None:
            low, high = self.args.value_reward_range
            rewards = (rewards - low) / (high - low)
        valid = rewards[~torch.isnan(rewards)]
        if valid.numel() and (valid.min() < 0 or valid.max() > 1):
            bad = valid[(valid < 0) | (valid > 1)][0].item()
            if self.args.value_reward_range is not None:
                raise ValueError(
                    f"advantage_estimator={self.args.advantage_estimator!r} needs total rewards in [0, 1]; after "
                    f"mapping ASPOConfig.value_reward_range={list(self.args.value_reward_range)} onto [0, 1] a reward "
                    f"is {bad}: the rewards leave the declared range."
                )
            raise ValueError(
                f"advantage_estimator={self.args.advantage_estimator!r} needs total rewards in [0, 1]; got {bad}. Set "
                "ASPOConfig.value_reward_range=[lo, hi] to map a known reward range onto [0, 1]."
            )
        return rewards

    def _observe(self, keys, outcomes, scorable, output) -> None:
        valid_keys = [key for key, ok in zip(keys, scorable.tolist(), strict=True) if ok]
        valid_outcomes = outcomes[scorable].double().cpu()
        if isinstance(self._value_tracker, EventValueTracker):
            self._value_tracker.observe(valid_keys, valid_outcomes, [self._value_event] * len(valid_keys))
        elif self.args.value_rho_mode == "constant":
            self._value_tracker.observe(valid_keys, valid_outcomes, self.args.value_rho)
        else:
            self._pending_visit = self._snapshot_for_kl_rho(output, valid_keys, valid_outcomes, scorable)
        self._refresh_priorities()

    @torch.no_grad()
    def _snapshot_for_kl_rho(self, output, keys, outcomes, scorable) -> dict:
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        logits_to_keep = output["completion_ids"].size(1)
        logps_before = output.get("old_per_token_logps")
        if logps_before is None:
            logps_before, _, _ = self._get_per_token_logps_and_entropies(
                self.model, input_ids, attention_mask, logits_to_keep, batch_size=self.args.per_device_train_batch_size
            )
        mask = output["completion_mask"] * output.get("tool_mask", 1)
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "logps_before": logps_before,
            "mask": mask,
            "keys": keys,
            "outcomes": outcomes,
            "scorable": scorable,
        }

    @torch.no_grad()
    def _pending_visit_rho(self, pending: dict) -> torch.Tensor:
        """KL-adaptive rho of a pending round's scorable outcomes, in the order of its keys (collective: gathers).

        Compares the log-probs stored at dispatch with those of the current model, i.e. after the updates that used
        the round."""
        logps_after, _, _ = self._get_per_token_logps_and_entropies(
            self.model,
            pending["input_ids"],
            pending["attention_mask"],
            pending["logps_before"].size(1),
            batch_size=self.args.per_device_train_batch_size,
        )
        rho_local = kl_adaptive_rho(
            pending["logps_before"],
            logps_after,
            pending["mask"],
            d_half=self.args.value_kl_half,
            rho_min=self.args.value_rho_min,
            rho_max=self.args.value_rho_max,
        )
        return self.accelerator.gather(rho_local)[pending["scorable"]].double().cpu()

    def _observe_pending_visit(self) -> None:
        """SPO's KL-adaptive rho: the last round's outcomes enter the tracker after the updates that used it."""
        pending, self._pending_visit = self._pending_visit, None
        if pending is None:
            return
        rho = self._pending_visit_rho(pending)
        self._value_tracker.observe(pending["keys"], pending["outcomes"], rho)
        if rho.numel():
            self._metrics["train"]["value/rho_mean"].append(rho.mean().item())
        self._refresh_priorities()

    def _log_tracker_metrics(self, dispatch_values: torch.Tensor) -> None:
        metrics = self._metrics["train"]
        metrics["value/mean"].append(dispatch_values.mean().item())
        metrics["value/tracked_prompts"].append(float(self._value_tracker.num_tracked))
        if self.args.value_rho_mode == "constant":
            metrics["value/rho_mean"].append(self.args.value_rho)
        if getattr(self, "_priority_sampler", None) is not None:
            metrics["value/effective_prompts"].append(effective_num_prompts(self._priority_sampler.weights).item())

    def _init_values_from_file(self, path: str) -> None:
        keys, successes, trials = read_init_counts(path, self.args.prompt_id_column)
        try:
            self._value_tracker.init_from_counts(
                keys, successes, trials, prior_strength=self.args.value_prior_strength
            )
        except ValueError as error:
            raise ValueError(f"ASPOConfig.value_init_file={path!r}: {error}") from None

    # ---------------------------------------------------------------- value pre-pass
    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial=None,
        ignore_keys_for_eval: list[str] | None = None,
    ):
        """`Trainer.train`, preceded on a fresh start by the value pre-pass when `value_init_samples > 0`.

        A resumed run restores its tracker from the checkpoint instead, and a trainer that has already dispatched
        (a second `train()` call) keeps the tracker it has."""
        if (
            self._value_tracker is not None
            and self.args.value_init_samples > 0
            and not resume_from_checkpoint
            and self._value_event == 0
        ):
            self._value_init_prepass()
        return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval)

    @torch.no_grad()
    def _value_init_prepass(self) -> None:
        """Initialize the tracker from `value_init_samples` completions per training prompt of the starting policy.

        Generation and scoring are TRL's own (`_generate`, `_calculate_rewards`) with the training sampling settings,
        one generation batch at a time: each rank takes its contiguous share of the batch, and the rewards come back
        gathered in process-major order, i.e. in plan order. A prompt's successes are its summed rewards (fractional
        rewards are fractional pseudo-counts) and its trials the number of its scorable samples; a prompt none of
        whose samples could be scored keeps the default prior. Runs before `accelerator.prepare`, on the model as
        given. TRL's metrics and pending reward-function logs of the pre-pass are discarded."""
        if self.environment_factories is not None:
            raise ValueError(
                "ASPOConfig.value_init_samples does not support `environment_factory` (environments own the rollout "
                "state); initialize the tracker with value_init_file instead."
            )
        dataset = self.train_dataset
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "column_names"):
            raise ValueError(
                "ASPOConfig.value_init_samples needs a map-style `datasets.Dataset` to enumerate prompts."
            )
        if {"image", "images"} & set(dataset.column_names):
            raise ValueError("ASPOConfig.value_init_samples does not support image datasets; use value_init_file.")
        keys = self._keys_of_rows(dataset)
        first_rows: dict[str, int] = {}
        for index, key in enumerate(keys):
            first_rows.setdefault(key, index)
        per_rank = self.args.per_device_train_batch_size * self.args.steps_per_generation
        span = per_rank * self.accelerator.num_processes
        plan = prepass_plan(list(first_rows.values()), self.args.value_init_samples, self.num_generations, span)
        successes = dict.fromkeys(first_rows, 0.0)
        trials = dict.fromkeys(first_rows, 0)

        saved_metrics = copy.deepcopy(self._metrics)
        was_training = self.model.training
        self.model.train()  # sample as training does (TRL picks the train-mode settings from `model.training`)
        rank = self.accelerator.process_index
        try:
            for start in tqdm(
                range(0, len(plan), span),
                desc="value pre-pass",
                unit="batch",
                disable=not self.accelerator.is_main_process,
            ):
                chunk = plan[start : start + span]
                local = chunk[rank * per_rank : (rank + 1) * per_rank]
                rewards = self._prepass_rewards([dataset[row] for row, _ in local])
                for (row, counted), reward in zip(chunk, rewards.tolist(), strict=True):
                    if counted and not math.isnan(reward):
                        successes[keys[row]] += reward
                        trials[keys[row]] += 1
        finally:
            self.model.train(was_training)
            self._metrics = saved_metrics
            self._pending_extra_logs.clear()
            self._pending_metrics.clear()

        scored = [key for key in first_rows if trials[key] > 0]
        counts = dict(prior_strength=self.args.value_prior_strength)
        if isinstance(self._value_tracker, EventValueTracker):
            counts["event"] = self._value_event
        self._value_tracker.init_from_counts(
            scored, [successes[key] for key in scored], [trials[key] for key in scored], **counts
        )
        self._refresh_priorities()

    def _prepass_rewards(self, inputs: list[dict]) -> torch.Tensor:
        """One completion per row of `inputs` with TRL's generation; total rewards gathered across ranks, mapped
        to [0, 1] as the tracker sees them (NaN where every reward function returned None)."""
        prompts = [row["prompt"] for row in inputs]
        if self.tools:
            # TRL's tool loop reads each rollout's tools from per-rollout dicts that `_generate_and_score_completions`
            # builds; without environments they hold the standalone tools.
            sync_tools = {
                tool.__name__: tool for tool in self._standalone_tools if not inspect.iscoroutinefunction(tool)
            }
            async_tools = {tool.__name__: tool for tool in self._standalone_tools if inspect.iscoroutinefunction(tool)}
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
        rewards = (rewards_per_func * self.reward_weights.to(rewards_per_func.device)).nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
        return self._rewards_for_tracker(rewards).cpu()

    # ---------------------------------------------------------------- loss
    def _compute_loss(self, model, inputs):
        if self.loss_type != "aspo":
            return super()._compute_loss(model, inputs)
        return self._compute_aspo_loss(model, inputs)

    def _compute_aspo_loss(self, model, inputs):
        """The aspo per-token term inside TRL's loss pipeline (masks, IS correction, KL, aggregation, metrics).

        GRPOTrainer picks its per-token term inline in `_compute_loss`, so the aspo branch must replace that method;
        everything around the term calls TRL's own helpers."""
        args = self.args
        mode = "train" if self.model.training else "eval"
        completion_mask = inputs["completion_mask"]
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
        per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            inputs["completion_ids"].size(1),
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            **{key: inputs.get(key) for key in _FORWARD_KEYS},
        )
        advantages = inputs["advantages"]
        old_per_token_logps = inputs.get("old_per_token_logps")
        old_per_token_logps = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps

        high_entropy = None
        if args.aspo_entropy_quantile is not None:
            high_entropy = entropy_split_mask(entropies, mask, args.aspo_entropy_quantile)
        flip_threshold = progressive_flip_threshold(
            self.state.global_step, args.aspo_flip_threshold_start, args.aspo_flip_decay_steps
        )
        per_token_loss, stats = asymmetric_policy_loss(
            per_token_logps,
            old_per_token_logps,
            advantages,
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            dual_clip=args.aspo_dual_clip,
            high_entropy_mask=high_entropy,
            epsilon_low_high_entropy=args.aspo_epsilon_high_entropy,
            epsilon_high_high_entropy=args.aspo_epsilon_high_entropy,
            flip_threshold=flip_threshold,
            unflipped_mask=inputs.get("aspo_unflipped"),
        )
        if self.off_policy_mask_threshold is not None:
            per_token_loss = per_token_loss * self.get_off_policy_mask(
                advantages=advantages if advantages.dim() == 2 else advantages.unsqueeze(1),
                per_token_logps=per_token_logps,
                sampling_per_token_logps=inputs.get("sampling_per_token_logps", old_per_token_logps),
                mask=mask,
                off_policy_threshold=self.off_policy_mask_threshold,
            )
        if self.top_entropy_quantile < 1.0:
            per_token_loss = per_token_loss * self.get_high_entropy_mask(
                entropies, mask, 1 - self.top_entropy_quantile
            )
        if self.use_vllm and self.vllm_importance_sampling_correction:
            per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]
        if self.beta != 0.0:
            log_ref_ratio = inputs["ref_per_token_logps"] - per_token_logps
            per_token_kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1
            if args.use_bias_correction_kl:
                per_token_kl = per_token_kl * torch.exp(per_token_logps - old_per_token_logps)
            per_token_loss = per_token_loss + self._aspo_kl_coef * per_token_kl

        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        if args.aspo_aggregation == "token":
            # `num_items_in_batch` spans the generation batch: rescale to one accumulation window, as TRL's dapo.
            normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                normalizer = normalizer * self.current_gradient_accumulation_steps / args.steps_per_generation
            loss = aggregate_loss(per_token_loss, mask, "token", normalizer)
            policy_loss = loss.detach()
        else:
            policy_loss = aggregate_loss(per_token_loss, mask, "sequence", None)
            loss = policy_loss / accumulation
            policy_loss = policy_loss.detach()
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation

        self._log_aspo_metrics(mode, stats, entropies, mask, per_token_kl if self.beta != 0.0 else None, policy_loss)
        return loss

    def _log_aspo_metrics(self, mode, stats, entropies, mask, per_token_kl, policy_loss) -> None:
        names = ("hard_clip_pos", "hard_clip_neg", "dual_clip_pos", "dual_clip_neg", "flipped")
        columns = [(stats[name].float() * mask).sum() for name in names]
        columns += [(stats["flip_weight"] * mask).sum(), (entropies.detach() * mask).sum(), mask.sum().float()]
        columns.append(policy_loss.float())
        if per_token_kl is not None:
            columns.append((per_token_kl.detach() * mask).sum())
        # One reduction and one device-to-host copy for every metric: each `.item()` would stall a GPU on its own.
        totals = self.accelerator.reduce(torch.stack(columns), reduction="sum").tolist()
        tokens = max(totals[7], 1.0)
        metrics = self._metrics[mode]
        for index, name in enumerate(names):
            metrics[f"aspo/{name}_frac"].append(totals[index] / tokens)
        metrics["aspo/flip_weight_mean"].append(totals[5] / max(totals[4], 1.0))
        metrics["entropy"].append(totals[6] / tokens)
        metrics["policy_loss"].append(totals[8] / self.accelerator.num_processes)
        if per_token_kl is not None:
            metrics["kl"].append(totals[9] / tokens)
            metrics["aspo/kl_coef"].append(self._aspo_kl_coef)
        if mode == "train" and self.args.aspo_adaptive_kl_beta is not None:
            self._update_adaptive_kl(totals[6], totals[7])

    def _update_adaptive_kl(self, entropy_sum: float, token_count: float) -> None:
        """Raise the KL coefficient for the next optimizer step while the step's mean entropy is below target."""
        window = (entropy_sum, token_count)
        if self._aspo_entropy_window is not None:
            window = (self._aspo_entropy_window[0] + entropy_sum, self._aspo_entropy_window[1] + token_count)
        self._aspo_entropy_window = window
        if not self.accelerator.sync_gradients:
            return
        mean_entropy = window[0] / max(window[1], 1.0)
        low = mean_entropy < self.args.aspo_adaptive_kl_entropy_target
        self._aspo_kl_coef = self.args.aspo_adaptive_kl_beta if low else self.beta
        self._aspo_entropy_window = None

    # ---------------------------------------------------------------- checkpoints
    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        # Collective when a KL-adaptive round is pending (rho is gathered): every rank computes, the main one writes.
        tracker = None if self._value_tracker is None else self._checkpoint_tracker()
        if not self.args.should_save:
            return
        checkpoint = os.path.join(
            self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        )
        state = {"value_event": self._value_event, "aspo_kl_coef": self._aspo_kl_coef}
        if tracker is not None:
            state["tracker"] = tracker.state_dict()
        if getattr(self, "_priority_sampler", None) is not None:
            # Weights of the checkpoint's tracker (which may have closed a pending round), so the file is consistent.
            sampler = copy.deepcopy(self._priority_sampler)
            sampler.set_values(self._tracker_values(self._dataset_keys, tracker))
            state["sampler"] = sampler.state_dict()
        torch.save(state, os.path.join(checkpoint, STATE_FILE))

    def _checkpoint_tracker(self) -> EventValueTracker | VisitValueTracker:
        """The tracker a run resumed from this checkpoint must start from.

        With KL-adaptive rho the last round's outcomes wait for the updates that use it. A resumed run starts with a
        fresh generation round, so the checkpoint closes the pending round with the current model: at a round
        boundary this is exactly the rho the next dispatch computes (the model does not change in between). It is
        done on a copy, so the running training is untouched."""
        if self._pending_visit is None:
            return self._value_tracker
        tracker = copy.deepcopy(self._value_tracker)
        tracker.observe(
            self._pending_visit["keys"], self._pending_visit["outcomes"], self._pending_visit_rho(self._pending_visit)
        )
        return tracker

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        path = None if checkpoint is None else os.path.join(checkpoint, STATE_FILE)
        if path is None or not os.path.exists(path):
            return
        state = torch.load(path, weights_only=False)
        self._value_event = state["value_event"]
        self._aspo_kl_coef = state["aspo_kl_coef"]
        self._pending_visit = None
        if self._value_tracker is not None and "tracker" in state:
            try:
                self._value_tracker.load_state_dict(state["tracker"])
            except ValueError as error:
                raise ValueError(
                    f"{path} holds a value tracker that advantage_estimator={self.args.advantage_estimator!r} cannot "
                    f"resume: {error}"
                ) from None
        if getattr(self, "_priority_sampler", None) is not None and "sampler" in state:
            self._priority_sampler.load_state_dict(state["sampler"])
        # A checkpoint without sampler state (saved without prioritized sampling) still sets weights from its tracker.
        self._refresh_priorities()
