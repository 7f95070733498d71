"""`ASPOTrainer`: TRL's `GRPOTrainer` conducting the pure functions of trl-aspo.

The trainer only gathers data across ranks, calls the functions of `single_stream` (tracker lifecycle, rewards for
the tracker, normalization, shaping, resume policy: shared with `AsyncASPOTrainer`), `losses`, `tool_metrics`,
`tracker` and `sampler`, and logs. Per generation round (see DESIGN.md, "Data flow"):

    prompts --(sampler)--> TRL generation and rewards --> baseline (group mean | tracker value frozen at dispatch)
      --> normalization (group | batch | token measure) --> tool-position shaping --> per-token loss (TRL | aspo)
      --> the tracker observes the round's outcomes before the next dispatch

With every switch of `ASPOConfig` at its default the trainer computes exactly what `GRPOTrainer` computes.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import inspect
import math

import torch
from accelerate.utils import gather_object
from datasets import IterableDataset
from tqdm.auto import tqdm
from transformers.utils import logging
from trl import GRPOConfig, GRPOTrainer

from trl_aspo.algorithms.advantage_checks import advantage_sources, check_finite_advantages
from trl_aspo.algorithms.aspo_metrics import (
    ASPO_TOKEN_STATS,
    aspo_metric_ratios,
    aspo_metric_sums,
    reduce_ratio_metrics,
)
from trl_aspo.algorithms.filters import zero_variance_groups
from trl_aspo.algorithms.kl import k3_kl
from trl_aspo.algorithms.losses import (
    aggregate_loss,
    asymmetric_policy_loss,
    entropy_split_mask,
    repetition_rate,
    unflipped_sample_mask,
)
from trl_aspo.algorithms.lr_schedule import per_generation_lr_lambda
from trl_aspo.algorithms.shaping import shaping_stats
from trl_aspo.algorithms.tool_metrics import (
    first_tool_call_positions,
    regex_tool_call_positions,
    resolve_call_token_ids,
    resolve_whitespace_token_ids,
    tool_call_metrics,
)
from trl_aspo.algorithms.weight_map import WeightMapMixin
from trl_aspo.config.aspo_config import SINGLE_STREAM_ESTIMATORS, ASPOConfig
from trl_aspo.infra.vllm_cpu import cpu_weight_sync
from trl_aspo.trainers.checkpoint_state import (
    STATE_JSON,
    checkpoint_state_file,
    load_checkpoint_state,
    save_checkpoint_state,
)
from trl_aspo.trainers.citations import model_card_paper
from trl_aspo.trainers.multimodal_visits import batch_multimodal_inputs, split_multimodal_inputs
from trl_aspo.trainers.resume import TiedWeightsCheckpointMixin
from trl_aspo.values.prompt_ids import prompt_keys
from trl_aspo.values.sampler import PrioritizedRepeatSampler, effective_num_prompts
from trl_aspo.values.single_stream import (
    aspo_loss_options,
    check_resume_settings,
    dataset_prompt_keys,
    init_values_from_file,
    make_shaping_hooks,
    make_value_tracker,
    normalize_advantages,
    require_state_or_reset,
    restore_tracker,
    resume_settings,
    tool_shaping_bias,
    tracker_rewards,
    warn_if_tool_shaping_runs_no_tools,
)
from trl_aspo.values.tracker import EventValueTracker, VisitValueTracker, kl_adaptive_rho, logprob_drift
from trl_aspo.values.value_init import prepass_plan

logger = logging.get_logger(__name__)

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


def _action_mask(inputs) -> torch.Tensor:
    """(B, T) the tokens the loss trains on: completion tokens the model wrote (tool outputs masked out)."""
    completion_mask = inputs["completion_mask"]
    return completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]


def _as_aspo_config(args: GRPOConfig) -> GRPOConfig:
    """Give a plain `GRPOConfig` the ASPOConfig fields at their defaults (every new feature off)."""
    for config_field in dataclasses.fields(ASPOConfig):
        if not hasattr(args, config_field.name):
            setattr(args, config_field.name, config_field.default)
    if args.advantage_normalization is None:
        args.advantage_normalization = "group"
    return args


def _with_overlong_penalty(reward_funcs, args: GRPOConfig):
    """Append TRL's soft overlong punishment (DAPO) as a reward function weighted by `overlong_penalty_factor`.

    Works on a copy of `args`, so a config reused for a second trainer does not collect a second penalty weight."""
    from trl.rewards import get_soft_overlong_punishment

    funcs = list(reward_funcs) if isinstance(reward_funcs, list | tuple) else [reward_funcs]
    penalty = get_soft_overlong_punishment(args.max_completion_length, args.overlong_buffer_length)
    args = copy.copy(args)
    weights = [1.0] * len(funcs) if args.reward_weights is None else list(args.reward_weights)
    args.reward_weights = [*weights, args.overlong_penalty_factor]
    return [*funcs, penalty], args


class ASPOTrainer(TiedWeightsCheckpointMixin, WeightMapMixin, GRPOTrainer):
    """Drop-in replacement for `trl.GRPOTrainer` adding the asymmetric IS loss (`loss_type="aspo"`), tool-position
    advantage shaping (`tool_shaping=True`) and single-stream value tracking (`advantage_estimator="spo"|"spo++"`).

    Takes exactly `GRPOTrainer`'s arguments. `model` may also name a built-in model (`"builtin:tiny-calculator"`,
    `"builtin:tiny-multicall"`, `"builtin:tiny-random"`), loaded locally with its tokenizer.
    """

    _tag_names = ["trl", "grpo", "aspo"]
    _name = "ASPO"
    # While TRL's own loss runs with log_weight_map: the current log-probs its forward pass computes.
    _weight_map_logps: list[torch.Tensor] | None = None

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, *positional, **kwargs):
        if isinstance(model, str) and model.startswith("builtin:"):
            from trl_aspo.builtin import load_builtin

            model, tokenizer = load_builtin(model)
            if kwargs.get("processing_class") is None and len(positional) < 3:
                kwargs["processing_class"] = tokenizer
        if args is None:
            model_name = model if isinstance(model, str) else model.config._name_or_path or "model"
            args = ASPOConfig(f"{model_name.split('/')[-1]}-ASPO")
        args = _as_aspo_config(args)
        if args.overlong_buffer_length is not None:
            reward_funcs, args = _with_overlong_penalty(reward_funcs, args)
        with cpu_weight_sync(args.use_vllm):
            super().__init__(model, reward_funcs, args, *positional, **kwargs)
        warn_if_tool_shaping_runs_no_tools(
            args,
            "tools=, environment_factory= or rollout_func",
            bool(self.tools) or self.environment_factories is not None or self.rollout_func is not None,
        )

        if args.prioritized_sampling and isinstance(self.train_dataset, IterableDataset):
            raise ValueError(
                "ASPOConfig.prioritized_sampling needs a map-style `datasets.Dataset`: an iterable dataset streams "
                "its rows in order and cannot be drawn from by priority."
            )
        if args.prompt_id_column is not None and hasattr(self.train_dataset, "column_names"):
            # Every row's id, checked now (as the asynchronous trainer does), not when a bad row is first drawn.
            dataset_prompt_keys(self.train_dataset, args)
        self._single_stream = args.advantage_estimator in SINGLE_STREAM_ESTIMATORS
        self._value_event = 0
        self._pending_visit = None
        # KL-adaptive rho: per prompt, the completion of its last visit with its post-update log-probs (CPU).
        self._visit_store: dict[str, dict[str, torch.Tensor]] = {}
        self._value_tracker = make_value_tracker(args)
        if self._value_tracker is not None and args.value_init_file is not None:
            init_values_from_file(self._value_tracker, args, self.train_dataset)

        self._call_token_ids = resolve_call_token_ids(self._tokenizer, args.tool_call_opener)
        # Whitespace-only text before a call is not model text (as in evaluation): resolved on first use.
        self._whitespace_token_ids: set[int] | None = None
        self._shaping_hooks = make_shaping_hooks(args)
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
        self._start_weight_map()
        paper = model_card_paper(args, GRPOTrainer._paper)
        if paper is not None:
            # TRL's model card reads `_paper`: cite the methods this run uses, not only GRPO.
            self._paper = paper

    # ---------------------------------------------------------------- sampling
    def _get_train_sampler(self, dataset=None):
        if not self.args.prioritized_sampling:
            return super()._get_train_sampler(dataset)
        dataset = self.train_dataset if dataset is None else dataset
        self._sampling_dataset = dataset
        self._dataset_keys = dataset_prompt_keys(dataset, self.args)
        self._rows_of_key: dict[str, list[int]] = {}
        for row, key in enumerate(self._dataset_keys):
            self._rows_of_key.setdefault(key, []).append(row)
        # Rows of the last two draws: the only prompts whose values can change before the next refresh (a round's
        # outcomes reach the tracker in its own round, or at the next dispatch under KL-adaptive rho).
        self._recent_draws: collections.deque[list[int]] = collections.deque(maxlen=2)
        # Deferred: the loader's rows are placeholders; `_draw_prioritized_round` picks the prompts at dispatch.
        self._priority_sampler = PrioritizedRepeatSampler(
            len(dataset),
            mini_repeat_count=self.num_generations,
            batch_size=self.args.generation_batch_size // self.num_generations,
            repeat_count=self.num_iterations * self.args.steps_per_generation,
            seed=self.args.seed,
            epsilon=self.args.priority_epsilon,
            deferred=True,
        )
        self._refresh_priorities(full=True)
        return self._priority_sampler

    def _draw_prioritized_round(self, inputs: list[dict]) -> list[dict]:
        """This rank's rows of the round being dispatched, drawn now from the tracker's current values.

        Drawing at dispatch rather than when the data loader reads ahead (prefetch, accumulation windows, workers)
        lets every outcome already in the tracker act on this draw, and makes the draw a pure function of the seed,
        the round index and the tracker, so a resumed run draws what the uninterrupted one drew. Rows are laid out
        as the loader lays them (each prompt `num_generations` times, rank `k` taking the `k`-th contiguous share)."""
        drawn = self._priority_sampler.draw(self._value_event)
        self._recent_draws.append(drawn)
        repeated = [row for row in drawn for _ in range(self.num_generations)]
        start = self.accelerator.process_index * len(inputs)
        return [self._sampling_dataset[row] for row in repeated[start : start + len(inputs)]]

    def _refresh_priorities(self, full: bool = False) -> None:
        """Set the sampler's weights from the tracker's values (identical on every rank: the tracker is).

        Only the prompts of the last two draws are recomputed unless `full` (needed after the tracker is replaced,
        e.g. on resume): a value changes only when an outcome of its prompt is observed (see `sampler`)."""
        if getattr(self, "_priority_sampler", None) is None:
            return
        if full:
            self._priority_sampler.set_values(self._tracker_values(self._dataset_keys))
            return
        keys = {self._dataset_keys[row] for drawn in self._recent_draws for row in drawn}
        rows = [row for key in keys for row in self._rows_of_key[key]]
        self._priority_sampler.update_values(rows, self._tracker_values([self._dataset_keys[row] for row in rows]))

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
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._gathered_rewards_per_func = self._unscorable_if_infinite(rewards_per_func)
        return self._gathered_rewards_per_func

    def _unscorable_if_infinite(self, rewards_per_func: torch.Tensor) -> torch.Tensor:
        """Turn infinite rewards into NaN, TRL's "this function returned None", before any baseline sees them.

        A +-inf reward (or a weighted total that overflows float32) would make every weight that shares a mean or a
        standard deviation with it NaN; as None it only leaves that completion unscored by that function."""
        infinite = torch.isinf(rewards_per_func)
        totals = (rewards_per_func * self.reward_weights.to(rewards_per_func.device)).nansum(dim=1)
        overflowing = torch.isinf(totals) & ~infinite.any(dim=1)
        if not (infinite.any() or overflowing.any()):
            return rewards_per_func
        names = [name for name, bad in zip(self.reward_func_names, infinite.any(dim=0).tolist(), strict=True) if bad]
        logger.warning(
            f"{int(infinite.sum())} infinite reward(s) from {names} and {int(overflowing.sum())} weighted total(s) "
            "beyond float32 in this round are treated as None (that completion unscored by that function)."
        )
        rewards_per_func = rewards_per_func.masked_fill(infinite, torch.nan)
        return torch.where(overflowing.unsqueeze(1), torch.full_like(rewards_per_func, torch.nan), rewards_per_func)

    def _generate_and_score_completions(self, inputs):
        mode = "train" if self.model.training else "eval"
        if mode == "train" and self._single_stream:
            self._observe_pending_visit()
            if self.args.prioritized_sampling:
                inputs = self._draw_prioritized_round(inputs)
            keys = gather_object(prompt_keys(inputs, self.args.prompt_id_column))
            if isinstance(self._value_tracker, EventValueTracker):
                self._value_tracker.enter(keys, self._value_event)
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
            outcomes = tracker_rewards(rewards, self.args)
            centered = outcomes - dispatch_values.to(device)
            self._log_tracker_metrics(keys, dispatch_values)
        else:
            grouped = rewards.view(-1, self.num_generations)
            centered = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)).view(-1)
            if self.args.filter_zero_variance_groups:
                scorable = scorable & ~self._drop_zero_variance_groups(rewards, output, inputs)
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
        else:
            advantages = self.accelerator.gather(output["advantages"])
        check_finite_advantages(advantages, self._advantage_sources(rewards_per_func, rewards))
        self._log_advantage_quantiles(unsignaled if rewrite else advantages, scorable)
        self._metrics[mode]["zero_advantage_share"].append(
            torch.isclose(unsignaled, torch.zeros_like(unsignaled), atol=1e-6).float().mean().item()
        )

        if self._single_stream:
            self._observe(keys, outcomes, scorable, output)
        if self.loss_type == "aspo" and self.args.aspo_unflipped_fraction > 0:
            generator = torch.Generator().manual_seed(self.args.seed * 1_000_003 + self._value_event)
            draw = unflipped_sample_mask(advantages.cpu(), self.args.aspo_unflipped_fraction, generator)
            output["aspo_unflipped"] = self._local_slice(draw, inputs)
        completion_repeats = repetition_rate(output["completion_ids"], action_mask)
        self._metrics[mode]["repetition_rate"].append(self.accelerator.gather(completion_repeats).mean().item())
        self._value_event += 1
        return output

    def _advantage_sources(self, rewards_per_func, rewards) -> dict:
        """What fed this round's advantages (gathered, per completion), named for `check_finite_advantages`."""
        per_func = {
            f"rewards/{name}": column for name, column in zip(self.reward_func_names, rewards_per_func.T, strict=True)
        }
        return advantage_sources(self.args, {"reward": rewards, **per_func})

    def _drop_zero_variance_groups(self, rewards, output, inputs) -> torch.Tensor:
        """Take groups whose rewards are all equal out of the loss: their tokens leave the completion mask and the
        token count TRL normalizes by (the reference rejects them from the batch). Returns the gathered (N,) dropped
        flags, so the caller also leaves them out of the advantage statistics."""
        dropped = zero_variance_groups(rewards, self.num_generations)
        keep = (~self._local_slice(dropped, inputs)).unsqueeze(1).to(output["completion_mask"].dtype)
        output["completion_mask"] = output["completion_mask"] * keep
        loss_mask = output["completion_mask"] * output.get("tool_mask", 1)
        output["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()
        self._metrics["train"]["filter/zero_variance_dropped_share"].append(dropped.float().mean().item())
        return dropped.to(rewards.device)

    def _log_advantage_quantiles(self, advantages: torch.Tensor, scorable: torch.Tensor) -> None:
        """Quantiles p10, p30, p50, p70, p90 of the scorable completions' advantages after normalization, before tool
        shaping (the reference's `spo/adv_after_norm/p*`)."""
        scored = advantages[scorable.to(advantages.device)].double()
        if not scored.numel():
            return
        levels = torch.tensor([0.1, 0.3, 0.5, 0.7, 0.9], dtype=torch.float64, device=scored.device)
        for level, value in zip((10, 30, 50, 70, 90), torch.quantile(scored, levels).tolist(), strict=True):
            self._metrics["train"][f"advantage/p{level}"].append(value)

    def _local_slice(self, gathered: torch.Tensor, inputs) -> torch.Tensor:
        start = self.accelerator.process_index * len(inputs)
        return gathered[start : start + len(inputs)].to(self.accelerator.device)

    def _normalize(self, centered, output, lengths, scorable) -> torch.Tensor:
        if self.args.advantage_normalization == "group":
            return self.accelerator.gather(output["advantages"])
        return normalize_advantages(centered, lengths, scorable, self.args.advantage_normalization)

    def _tool_statistics(self, output) -> torch.Tensor:
        if self.args.tool_call_pattern is not None:
            stats = regex_tool_call_positions(
                None,
                output["completion_ids"],
                self._tokenizer,
                self.args.tool_call_pattern,
                output.get("tool_mask"),
                completion_mask=output["completion_mask"],
            )
        else:
            if self._whitespace_token_ids is None:
                self._whitespace_token_ids = resolve_whitespace_token_ids(self._tokenizer)
            stats = first_tool_call_positions(
                output["completion_ids"],
                output.get("tool_mask"),
                output["completion_mask"],
                self._call_token_ids,
                self._whitespace_token_ids,
            )
        gathered = self.accelerator.gather(torch.stack(stats, dim=1).to(self.accelerator.device))
        if self.tools or self.args.tool_call_pattern is not None or self.args.tool_shaping:
            for name, value in tool_call_metrics(*gathered.unbind(dim=1)).items():
                self._metrics["train"][f"tools/{name}"].append(value)
        return gathered

    def _shape(self, advantages, rewards_per_func, rewards, tool_stats, output) -> torch.Tensor:
        args = self.args
        if args.tool_shaping_correct_reward is None:
            scores = rewards
        else:
            scores = rewards_per_func[:, self.reward_func_names.index(args.tool_shaping_correct_reward)]
        positions, lengths, calls, turns = tool_stats.unbind(dim=1)
        # TRL lays each prompt's completions out consecutively, `num_generations` at a time.
        group_ids = torch.arange(len(advantages), device=advantages.device) // self.num_generations
        bias, eligible = tool_shaping_bias(advantages, scores, positions, lengths, group_ids, args)
        if self._shaping_hooks:
            texts = gather_object(self._tokenizer.batch_decode(output["completion_ids"], skip_special_tokens=True))
            for hook in self._shaping_hooks:
                bias = bias + hook(texts, positions, lengths, calls, turns, advantages).to(bias)
        for name, value in shaping_stats(bias, eligible).items():
            self._metrics["train"][f"shaping/{name}"].append(value)
        return advantages + bias

    # ---------------------------------------------------------------- value tracker
    def _observe(self, keys, outcomes, scorable, output) -> None:
        if self.args.value_rho_mode == "kl":
            self._pending_visit = self._snapshot_for_kl_rho(output, keys, outcomes, scorable)
            return
        valid_keys = [key for key, ok in zip(keys, scorable.tolist(), strict=True) if ok]
        valid_outcomes = outcomes[scorable].double().cpu()
        if isinstance(self._value_tracker, EventValueTracker):
            self._value_tracker.observe(valid_keys, valid_outcomes, [self._value_event] * len(valid_keys))
        else:
            self._value_tracker.observe(valid_keys, valid_outcomes, self.args.value_rho)
        self._refresh_priorities()

    def _snapshot_for_kl_rho(self, output, keys, outcomes, scorable) -> dict:
        """This round's visit, held until the updates that use it are done: the gathered keys, outcomes and scorable
        flags, and each local completion trimmed to its own tokens (prompt without padding, completion up to its
        last token, action mask) on CPU, with its own multimodal inputs under `multimodal` for a vision-language
        model (the whole round's images would not match the rows of a later, mixed batch)."""
        completion_mask = output["completion_mask"]
        action_mask = completion_mask * output.get("tool_mask", 1)
        lengths = [
            int(row_mask.nonzero().max()) + 1 if row_mask.any() else 0 for row_mask in completion_mask.unbind(0)
        ]
        multimodal = split_multimodal_inputs(output, output["prompt_mask"], lengths)
        completions = []
        for row, length in enumerate(lengths):
            completion = {
                "prompt_ids": output["prompt_ids"][row][output["prompt_mask"][row].bool()].to("cpu", torch.int32),
                "completion_ids": output["completion_ids"][row, :length].to("cpu", torch.int32),
                "action_mask": action_mask[row, :length].to("cpu", torch.bool),
            }
            if multimodal[row]:
                completion["multimodal"] = multimodal[row]
            completions.append(completion)
        start = self.accelerator.process_index * len(completions)
        return {
            "keys": list(keys),
            "local_keys": list(keys[start : start + len(completions)]),
            "outcomes": outcomes.double().cpu(),
            "scorable": scorable.cpu(),
            "completions": completions,
        }

    @torch.no_grad()
    def _visit_logps(self, visits: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        """Current-policy log-probs of stored visits' completion tokens, (n, T) float32 on CPU, and their action masks.

        Each row is prompt + completion from position 0, right-padded: the log-probs do not depend on which other
        visits share the batch (left padding would shift the positions). Each visit brings its own multimodal inputs,
        batched in row order."""
        lengths = [len(v["prompt_ids"]) + len(v["completion_ids"]) for v in visits]
        width = max(lengths)
        input_ids = torch.zeros(len(visits), width, dtype=torch.long)
        attention_mask = torch.zeros(len(visits), width, dtype=torch.long)
        for row, visit in enumerate(visits):
            input_ids[row, : lengths[row]] = torch.cat([visit["prompt_ids"], visit["completion_ids"]]).long()
            attention_mask[row, : lengths[row]] = 1
        device = self.accelerator.device
        multimodal = batch_multimodal_inputs([visit.get("multimodal", {}) for visit in visits], width)
        logps, _, _ = self._get_per_token_logps_and_entropies(
            self.model,
            input_ids.to(device),
            attention_mask.to(device),
            width - 1,
            batch_size=self.args.per_device_train_batch_size,
            **{key: value.to(device) if torch.is_tensor(value) else value for key, value in multimodal.items()},
        )
        # logps[:, j] is the log-prob of token j + 1.
        completion_width = max(1, max(len(v["completion_ids"]) for v in visits))
        out = torch.zeros(len(visits), completion_width, dtype=torch.float32)
        mask = torch.zeros(len(visits), completion_width, dtype=torch.bool)
        for row, visit in enumerate(visits):
            start, length = len(visit["prompt_ids"]) - 1, len(visit["completion_ids"])
            out[row, :length] = logps[row, start : start + length].float().cpu()
            mask[row, :length] = visit["action_mask"]
        return out, mask

    @torch.no_grad()
    def _measure_pending_visit(self, pending: dict, visit_store: dict) -> dict:
        """Close a pending round against `visit_store` (collective: every rank runs one forward of the same size).

        Per completion of the round: D since its prompt's previous visit (the stored completion's log-probs then and
        now; D = 0 on a first visit), and the visit to store next (this completion with its post-update log-probs).
        Returns gathered `drift`, `first_visit` and `visits`, in the order of the round's keys."""
        local = pending["completions"]
        previous = [visit_store.get(key) for key in pending["local_keys"]]
        first_visit = torch.tensor([visit is None for visit in previous])
        # A first visit stands in for itself (D = 0), so every rank runs one batch of 2 x its local size.
        stored = [visit if visit is not None else own for visit, own in zip(previous, local, strict=True)]
        logps_now, mask = self._visit_logps(stored + local)
        stored_logps = torch.zeros_like(logps_now[: len(local)])
        for row, visit in enumerate(stored):
            if "logps" in visit:
                stored_logps[row, : len(visit["logps"])] = visit["logps"]
        drift = logprob_drift(stored_logps, logps_now[: len(local)], mask[: len(local)])
        drift = torch.where(first_visit, torch.zeros_like(drift), drift)
        visits = [
            {**own, "logps": logps_now[len(local) + row, : len(own["completion_ids"])].clone()}
            for row, own in enumerate(local)
        ]
        device = self.accelerator.device
        return {
            "drift": self.accelerator.gather(drift.to(device)).cpu(),
            "first_visit": self.accelerator.gather(first_visit.to(device)).cpu(),
            "visits": gather_object(visits),
        }

    def _close_pending_visit(self, pending: dict, tracker: VisitValueTracker, visit_store: dict) -> dict:
        """SPO's KL-adaptive update of `tracker` and `visit_store` for a pending round (collective); returns the
        round's scorable `drift`, `rho` and `first_visit`."""
        closed = self._measure_pending_visit(pending, visit_store)
        scorable = pending["scorable"]
        drift = closed["drift"][scorable]
        rho = kl_adaptive_rho(
            drift, d_half=self.args.value_kl_half, rho_min=self.args.value_rho_min, rho_max=self.args.value_rho_max
        )
        keys = [key for key, ok in zip(pending["keys"], scorable.tolist(), strict=True) if ok]
        tracker.observe(keys, pending["outcomes"][scorable], rho)
        # A prompt seen twice in one round keeps its last completion, as the reference does.
        for key, visit, ok in zip(pending["keys"], closed["visits"], scorable.tolist(), strict=True):
            if ok:
                visit_store[key] = visit
        return {"drift": drift, "rho": rho, "first_visit": closed["first_visit"][scorable]}

    def _observe_pending_visit(self) -> None:
        """SPO's KL-adaptive rho: the last round's outcomes enter the tracker after the updates that used it."""
        pending, self._pending_visit = self._pending_visit, None
        if pending is None:
            return
        closed = self._close_pending_visit(pending, self._value_tracker, self._visit_store)
        if closed["rho"].numel():
            metrics = self._metrics["train"]
            metrics["value/rho_mean"].append(closed["rho"].mean().item())
            metrics["value/kl_drift"].append(closed["drift"].mean().item())
            unclipped = torch.exp2(-closed["drift"] / self.args.value_kl_half)
            metrics["value/rho_clip_frac"].append((unclipped != closed["rho"]).double().mean().item())
            metrics["value/first_visit_frac"].append(closed["first_visit"].double().mean().item())
        self._refresh_priorities()

    def _log_tracker_metrics(self, keys: list[str], dispatch_values: torch.Tensor) -> None:
        """Per round: the dispatched prompts' mean value, effective evidence alpha + beta (the reference's
        `spo/Neff`) and visits so far, and the tracker's size."""
        metrics = self._metrics["train"]
        metrics["value/mean"].append(dispatch_values.mean().item())
        if isinstance(self._value_tracker, EventValueTracker):
            alpha, beta = self._value_tracker.pseudo_counts(keys, self._value_event)
        else:
            alpha, beta = self._value_tracker.pseudo_counts(keys)
        metrics["value/alpha_plus_beta"].append((alpha + beta).mean().item())
        metrics["value/visits_per_prompt"].append(self._value_tracker.visits(keys).double().mean().item())
        metrics["value/tracked_prompts"].append(float(self._value_tracker.num_tracked))
        if self.args.value_rho_mode == "constant":
            metrics["value/rho_mean"].append(self.args.value_rho)
        if getattr(self, "_priority_sampler", None) is not None:
            metrics["value/effective_prompts"].append(effective_num_prompts(self._priority_sampler.weights).item())

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
        keys = dataset_prompt_keys(dataset, self.args)
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
        self._refresh_priorities(full=True)

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
        return tracker_rewards(rewards, self.args).cpu()

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """Trainer's scheduler; with `lr_schedule_per_generation`, each multiplier is taken at the first optimizer
        step of its generation round (`per_generation_lr_lambda`), as verl steps its scheduler once per rollout."""
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        if self.args.lr_schedule_per_generation:  # idempotent: a second call wraps with the same rounding
            steps_per_round = int(self.args.optimizer_steps_per_generation())
            scheduler.lr_lambdas = [per_generation_lr_lambda(f, steps_per_round) for f in scheduler.lr_lambdas]
        return scheduler

    # ---------------------------------------------------------------- loss
    def _compute_loss(self, model, inputs):
        if self.loss_type == "aspo":
            return self._compute_aspo_loss(model, inputs)
        if not self._collects_weight_map(inputs):
            return super()._compute_loss(model, inputs)
        # TRL's loss computes the current log-probs inline: `_get_per_token_logps_and_entropies` hands them out.
        self._weight_map_logps = []
        try:
            loss = super()._compute_loss(model, inputs)
            (per_token_logps,) = self._weight_map_logps
        finally:
            self._weight_map_logps = None
        self._add_clipped_ratio_weight_map(
            inputs["old_per_token_logps"], per_token_logps, inputs["advantages"], _action_mask(inputs), self.args.delta
        )
        return loss

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        """GRPOTrainer's forward pass; inside `_compute_loss` with the weight map on, it also keeps the log-probs."""
        result = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if self._weight_map_logps is not None:
            self._weight_map_logps.append(result[0].detach())
        return result

    def _collects_weight_map(self, inputs) -> bool:
        """Whether this micro-batch enters the weight map: training passes with behaviour log-probs (off-policy or
        vLLM-corrected; TRL leaves them out on-policy, where r = 1 and every weight is 1)."""
        return self._weight_map is not None and self.model.training and inputs.get("old_per_token_logps") is not None

    def _compute_aspo_loss(self, model, inputs):
        """The aspo per-token term inside TRL's loss pipeline (masks, IS correction, KL, aggregation, metrics).

        GRPOTrainer picks its per-token term inline in `_compute_loss`, so the aspo branch must replace that method;
        everything around the term calls TRL's own helpers."""
        args = self.args
        mode = "train" if self.model.training else "eval"
        completion_mask = inputs["completion_mask"]
        mask = _action_mask(inputs)
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
        collects_weight_map = self._collects_weight_map(inputs)
        old_per_token_logps = inputs.get("old_per_token_logps")
        old_per_token_logps = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps

        high_entropy = None
        if args.aspo_entropy_quantile is not None:
            high_entropy = entropy_split_mask(entropies, mask, args.aspo_entropy_quantile)
        per_token_loss, stats = asymmetric_policy_loss(
            per_token_logps,
            old_per_token_logps,
            advantages,
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            high_entropy_mask=high_entropy,
            unflipped_mask=inputs.get("aspo_unflipped"),
            **aspo_loss_options(args, self.state.global_step),
        )
        if collects_weight_map:
            self._add_aspo_weight_map(old_per_token_logps, per_token_logps, advantages, mask, stats)
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
            per_token_kl = k3_kl(inputs["ref_per_token_logps"], per_token_logps, args.kl_clamp)
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
        """`aspo/*` as ratios over the logging window (trl_aspo.algorithms.aspo_metrics); `entropy`, `kl` and `policy_loss`
        per micro-batch, as GRPOTrainer logs them."""
        columns = [aspo_metric_sums(stats, mask), (entropies.detach() * mask).sum().view(1), policy_loss.view(1)]
        if per_token_kl is not None:
            columns.append((per_token_kl.detach() * mask).sum().view(1))
        # One reduction and one device-to-host copy for every metric: each `.item()` would stall a GPU on its own.
        totals = self.accelerator.reduce(torch.cat([column.float() for column in columns]), reduction="sum").tolist()
        sums, rest = totals[: len(ASPO_TOKEN_STATS) + 2], totals[len(ASPO_TOKEN_STATS) + 2 :]
        tokens = max(sums[-1], 1.0)
        metrics = self._metrics[mode]
        for name, pair in aspo_metric_ratios(sums).items():
            metrics[name].append(pair)
        metrics["entropy"].append(rest[0] / tokens)
        metrics["policy_loss"].append(rest[1] / self.accelerator.num_processes)
        if per_token_kl is not None:
            metrics["kl"].append(rest[2] / tokens)
            metrics["aspo/kl_coef"].append(self._aspo_kl_coef)
        if mode == "train" and self.args.aspo_adaptive_kl_beta is not None:
            self._update_adaptive_kl(rest[0], sums[-1])

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """GRPOTrainer's log, with the `aspo/*` ratios reduced over the window (trl_aspo.algorithms.aspo_metrics) and without
        TRL's `frac_reward_zero_std` when `num_generations == 1`: each group then has one member, so it would read
        1.0 on every step; `zero_advantage_share` is the single-stream reading of completions without signal."""
        mode = "train" if self.model.training else "eval"
        if self._weight_map is not None and mode == "train":
            self._log_weight_map()
        reduce_ratio_metrics(self._metrics[mode])
        if self.num_generations == 1:
            self._metrics[mode].pop("frac_reward_zero_std", None)
        super().log(logs, start_time)

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
    def _save_rng_state(self, output_dir: str) -> None:
        # The smallest hook of `Trainer._save_checkpoint` that every rank runs inside the new checkpoint before
        # trainer_state.json marks it complete and old checkpoints are rotated away: the state is written there.
        super()._save_rng_state(output_dir)
        self._save_aspo_state(output_dir)

    def _save_aspo_state(self, checkpoint: str) -> None:
        # Collective when a KL-adaptive round is pending (rho is gathered): every rank computes, the main one writes.
        tracker, visit_store = (None, None) if self._value_tracker is None else self._checkpoint_tracker()
        self._save_weight_map(checkpoint)
        if not self.args.should_save:
            return
        state = {
            "value_event": self._value_event,
            "aspo_kl_coef": float(self._aspo_kl_coef),
            "config": self._resume_config(),
        }
        if tracker is not None:
            state["tracker"] = tracker.state_dict()
        if visit_store:
            state["visit_store"] = visit_store
        if getattr(self, "_priority_sampler", None) is not None:
            # Weights of the checkpoint's tracker (which may have closed a pending round), so the file is consistent.
            sampler = copy.deepcopy(self._priority_sampler)
            sampler.set_values(self._tracker_values(self._dataset_keys, tracker))
            state["sampler"] = sampler.state_dict()
        save_checkpoint_state(checkpoint, state)

    def _resume_config(self) -> dict:
        train_rows = None if isinstance(self.train_dataset, IterableDataset) else len(self.train_dataset)
        return resume_settings(self.args, train_rows)

    def _checkpoint_tracker(self) -> tuple[EventValueTracker | VisitValueTracker, dict]:
        """The tracker and stored visits a run resumed from this checkpoint must start from.

        With KL-adaptive rho the last round's outcomes wait for the updates that use it. A resumed run starts with a
        fresh generation round, so the checkpoint closes the pending round with the current model: at a round
        boundary this is exactly what the next dispatch computes (the model does not change in between). It is done
        on copies (the visits dict shallowly: closing replaces entries, never mutates them), so the running training
        is untouched."""
        if self._pending_visit is None:
            return self._value_tracker, self._visit_store
        tracker, visit_store = copy.deepcopy(self._value_tracker), dict(self._visit_store)
        self._close_pending_visit(self._pending_visit, tracker, visit_store)
        return tracker, visit_store

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        self._restore_weight_map(checkpoint)
        if checkpoint_state_file(checkpoint) is None:
            require_state_or_reset(self.args, checkpoint, STATE_JSON)
            return
        state = load_checkpoint_state(checkpoint)
        path = checkpoint_state_file(checkpoint)
        # A generation round happens at some micro-step, so a run has had at most as many rounds as micro-steps.
        max_rounds = self.state.global_step * self.args.gradient_accumulation_steps
        if state["value_event"] > max_rounds:
            raise ValueError(
                f"checkpoint state {path}: value_event={state['value_event']} exceeds the {max_rounds} micro-steps of "
                f"its global_step={self.state.global_step}; the file does not belong to this checkpoint."
            )
        fresh_tracker = check_resume_settings(
            self.args, state.get("config"), self._resume_config(), path, has_tracker="tracker" in state
        )
        self._value_event = state["value_event"]
        self._aspo_kl_coef = state["aspo_kl_coef"]
        self._pending_visit = None
        self._visit_store = {} if fresh_tracker else dict(state.get("visit_store", {}))
        if self._value_tracker is not None and not fresh_tracker:
            restore_tracker(self._value_tracker, state, path, self.args)
        if getattr(self, "_priority_sampler", None) is not None and state.get("sampler") is not None:
            try:
                self._priority_sampler.load_state_dict(state["sampler"])
            except (KeyError, TypeError, ValueError) as error:
                raise ValueError(
                    f"checkpoint state {path} holds a sampler state that cannot be resumed: "
                    f"{error.__class__.__name__}: {error}"
                ) from None
        # A checkpoint without sampler state (saved without prioritized sampling) still sets weights from its tracker.
        self._refresh_priorities(full=True)
