"""`ASPOTrainer`: TRL's `GRPOTrainer` conducting the pure functions of trl-aspo (docs/design.md, "Data flow").

Per generation round:

    prompts --(prioritized sampler)--> TRL generation and rewards --> baseline: group mean | tracker value frozen at
      dispatch --> `AdvantagePipeline` (normalization, tool shaping, checks, metrics; shared with AsyncASPOTrainer)
      --> per-token loss: TRL's | a registered loss (`assembled_loss`, shared) --> the tracker observes the round
      before the next dispatch

With every switch of `ASPOConfig` at its default the trainer computes exactly what `GRPOTrainer` computes.
"""

from __future__ import annotations

import copy

import torch
from accelerate.utils import broadcast_object_list, gather_object
from datasets import IterableDataset
from trl import GRPOConfig, GRPOTrainer

from trl_aspo.algorithms.advantage_estimators import get_advantage_estimator
from trl_aspo.algorithms.context_length import check_prompts_fit, generation_context
from trl_aspo.algorithms.filters import zero_variance_groups
from trl_aspo.algorithms.losses import repetition_rate
from trl_aspo.algorithms.lr_schedule import per_generation_lr_lambda
from trl_aspo.algorithms.policy_losses import get_policy_loss, reduce_ratio_metrics
from trl_aspo.algorithms.tool_metrics import ToolCallCounter, tool_call_metrics
from trl_aspo.config.aspo_config import ASPOConfig
from trl_aspo.infra.served_context import served_max_model_len
from trl_aspo.infra.vllm_cpu import cpu_weight_sync
from trl_aspo.trainers.checkpoint_state import checkpoint_state_file
from trl_aspo.trainers.citations import model_card_paper
from trl_aspo.trainers.graceful_stop import GracefulStopMixin
from trl_aspo.trainers.grpo_arguments import as_aspo_config, with_overlong_penalty
from trl_aspo.trainers.grpo_loss import DRAW_PREFIX, GRPOLossMixin, action_mask
from trl_aspo.trainers.grpo_prepass import GRPOValuePrepassMixin
from trl_aspo.trainers.project_state import restore_project_state, save_project_state
from trl_aspo.trainers.resume import TiedWeightsCheckpointMixin
from trl_aspo.trainers.reward_checks import checked_reward_calls
from trl_aspo.trainers.step_guard import NonFiniteStepGuardMixin
from trl_aspo.trainers.step_timing import ADVANTAGES, OFFPOLICY_CORRECTION, StepTimingMixin
from trl_aspo.trainers.value_tracking import ValueTracking
from trl_aspo.values.prompt_ids import prompt_keys
from trl_aspo.values.sampler import PrioritizedRepeatSampler, effective_num_prompts
from trl_aspo.values.scoring import (
    AdvantageBatch,
    AdvantagePipeline,
    check_correct_reward_name,
    total_rewards,
    unscorable_if_infinite_rewards,
    warn_if_tool_shaping_runs_no_tools,
)
from trl_aspo.values.single_stream import dataset_prompt_keys, tracker_rewards, train_rows


class ASPOTrainer(
    TiedWeightsCheckpointMixin,
    GracefulStopMixin,
    NonFiniteStepGuardMixin,
    GRPOValuePrepassMixin,
    GRPOLossMixin,
    StepTimingMixin,
    GRPOTrainer,
):
    """Drop-in replacement for `trl.GRPOTrainer` adding the asymmetric IS loss (`loss_type="aspo"`), tool-position
    advantage shaping (`tool_shaping=True`) and single-stream value tracking (`advantage_estimator="spo"|"spo++"`).

    Takes exactly `GRPOTrainer`'s arguments. `model` may also name a built-in model (`"builtin:tiny-calculator"`,
    `"builtin:tiny-multicall"`, `"builtin:tiny-random"`), loaded locally with its tokenizer.

    TRL methods overridden, each the smallest hook available:

    - `train`: runs the value pre-pass before TRL's loop on a fresh start.
    - `_get_grad_norm`: `skip_nonfinite_grad_steps` drops a step's gradients when their norm is not finite.
    - `_get_train_sampler`: prioritized sampling replaces TRL's `RepeatSampler` with placeholder rows.
    - `_calculate_rewards`: TRL computes its baseline inline and returns no gathered rewards; they are kept here.
    - `_generate_and_score_completions`: the advantages of a round are replaced after TRL's generation and scoring.
    - `create_scheduler`: `lr_schedule_per_generation` holds each multiplier over a generation round.
    - `_compute_loss`: TRL picks its per-token term inline, so the aspo branch replaces the method.
    - `_get_per_token_logps_and_entropies`: hands TRL's own loss's log-probs to the weight map.
    - `log`: `aspo/*` ratios reduced over the window; no `frac_reward_zero_std` with one completion per prompt.
    - `_save_rng_state`: the hook every rank runs inside a new checkpoint before it is marked complete.
    - `_load_optimizer_and_scheduler`: the hook of a resume after the model is loaded, before training.
    """

    _tag_names = ["trl", "grpo", "aspo"]
    _name = "ASPO"
    _priority_sampler: PrioritizedRepeatSampler | None = None
    _context_length: int | None = None

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, *positional, **kwargs):
        if isinstance(model, str) and model.startswith("builtin:"):
            from trl_aspo.builtin import load_builtin

            model, tokenizer = load_builtin(model)
            if kwargs.get("processing_class") is None and len(positional) < 3:
                kwargs["processing_class"] = tokenizer
        if args is None:
            model_name = model if isinstance(model, str) else model.config._name_or_path or "model"
            args = ASPOConfig(f"{model_name.split('/')[-1]}-ASPO")
        args = as_aspo_config(args)
        if args.overlong_buffer_length is not None:
            reward_funcs, args = with_overlong_penalty(reward_funcs, args)
        with cpu_weight_sync(args.use_vllm):
            super().__init__(model, reward_funcs, args, *positional, **kwargs)
        runs_tools = bool(self.tools) or self.environment_factories is not None or self.rollout_func is not None
        warn_if_tool_shaping_runs_no_tools(args, "tools=, environment_factory= or rollout_func", runs_tools)
        if args.prioritized_sampling and isinstance(self.train_dataset, IterableDataset):
            raise ValueError(
                "ASPOConfig.prioritized_sampling needs a map-style `datasets.Dataset`: an iterable dataset streams "
                "its rows in order and cannot be drawn from by priority."
            )
        if args.prompt_id_column is not None and hasattr(self.train_dataset, "column_names"):
            # Every row's id, checked now (as the asynchronous trainer does), not when a bad row is first drawn.
            dataset_prompt_keys(self.train_dataset, args)
        self._estimator = get_advantage_estimator(args.advantage_estimator)
        # The policy event of value tracking: one per generation round (also seeds each round's draws).
        self._value_event = 0
        self._values = ValueTracking.start(
            args, self.train_dataset, asynchronous=False, accelerator=self.accelerator, forward=self._visit_forward
        )
        self._context_length = self._generation_context()
        self._tool_calls = ToolCallCounter(
            self._tokenizer, args.tool_call_opener, args.tool_call_pattern, tools_run=runs_tools
        )
        self._pipeline = AdvantagePipeline(args)
        check_correct_reward_name(args, self.reward_func_names, "the reward functions are")
        self._aspo_kl_coef = self.beta
        self._aspo_entropy_window = None
        self._start_weight_map()
        self._start_step_timing()
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
        # The weights follow the tracker: every round's observed prompts, all rows now and after a resume.
        self._values.follow_priorities(self._priority_sampler.update_values, lambda: self._value_event)
        self._values.refresh_priorities()
        return self._priority_sampler

    def _draw_prioritized_round(self, inputs: list[dict]) -> list[dict]:
        """This rank's rows of the round being dispatched, drawn now from the tracker's current values.

        Drawing at dispatch rather than when the data loader reads ahead (prefetch, accumulation windows, workers)
        lets every outcome already in the tracker act on this draw, and makes the draw a pure function of the seed,
        the round index and the tracker, so a resumed run draws what the uninterrupted one drew. Rows are laid out
        as the loader lays them (each prompt `num_generations` times, rank `k` taking the `k`-th contiguous share)."""
        drawn = self._priority_sampler.draw(self._value_event)
        repeated = [row for row in drawn for _ in range(self.num_generations)]
        start = self.accelerator.process_index * len(inputs)
        return [self._sampling_dataset[row] for row in repeated[start : start + len(inputs)]]

    # ---------------------------------------------------------------- advantages
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        with checked_reward_calls(self):  # a return value TRL's torch.tensor would refuse, named
            rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._gathered_rewards_per_func = unscorable_if_infinite_rewards(
            rewards_per_func, self.reward_weights, self.reward_func_names
        )
        return self._gathered_rewards_per_func

    def _generation_context(self) -> int | None:
        """The generator's context, checked against `max_completion_length` now that the model is loaded: vLLM's
        `max_model_len` (colocate: the engine's; server: what the server reports), else the policy config's positions
        (`model_context_length`)."""
        served, source = None, ""
        if self.use_vllm and self.vllm_mode == "colocate":
            served, source = self.vllm_generation.llm.llm_engine.model_config.max_model_len, "vLLM's max_model_len"
        elif self.use_vllm and self.vllm_mode == "server":
            # Only the main process holds TRL's client; every rank checks its own prompts against the same number.
            asked = (
                [served_max_model_len(self.vllm_generation.vllm_client.base_url)]
                if self.accelerator.is_main_process
                else [None]
            )
            served, source = broadcast_object_list(asked, from_process=0)[0], "the vLLM server's max_model_len"
        config = self.accelerator.unwrap_model(self.model).config
        return generation_context(self.max_completion_length, served, source, config)

    def _tokenize_prompts(self, prompts: list):
        """TRL's tokenization, then each prompt checked to fit the context with `max_completion_length`."""
        tokenized = super()._tokenize_prompts(prompts)

        def describe(index: int) -> str:
            text = str(prompts[index])
            return f"The prompt {text[:80]!r}{'...' if len(text) > 80 else ''}"

        check_prompts_fit(
            [len(ids) for ids in tokenized[0]], self.max_completion_length, self._context_length, describe
        )
        return tokenized

    def _generate_and_score_completions(self, inputs):
        mode = "train" if self.model.training else "eval"
        keys = dispatch_values = None
        if mode == "train" and self._values is not None:
            with self._timed(ADVANTAGES, self.accelerator.device):
                self._append_train_metrics(self._values.close_pending_round())
                if self.args.prioritized_sampling:
                    inputs = self._draw_prioritized_round(inputs)
                keys = gather_object(prompt_keys(inputs, self.args.prompt_id_column))
                self._values.enter(keys, self._value_event)
                dispatch_values = self._values.values(keys, self._value_event).float()
        output = super()._generate_and_score_completions(inputs)
        if mode != "train":
            return output
        round_action_mask = action_mask(output)  # before `filter_zero_variance_groups` masks dropped groups out
        with self._timed(ADVANTAGES, self.accelerator.device):
            self._score_round(output, inputs, keys, dispatch_values)
        if "importance_sampling_ratio" in output:  # timed only where TRL's vLLM IS correction is on
            with self._timed(OFFPOLICY_CORRECTION, self.accelerator.device):
                self._log_rollout_correction(output)
        completion_repeats = repetition_rate(output["completion_ids"], round_action_mask)
        self._metrics[mode]["repetition_rate"].append(self.accelerator.gather(completion_repeats).mean().item())
        self._value_event += 1
        return output

    def _score_round(self, output, inputs, keys: list[str] | None, dispatch_values: torch.Tensor | None) -> None:
        """The round's final advantages into `output` (and TRL's logged ones): baseline (the tracker's values at
        dispatch, `keys` and `dispatch_values`, or the group estimator), `AdvantagePipeline` on the gathered round,
        the tracker's observation of the outcomes and the registered loss's per-sample draws."""
        device = self.accelerator.device
        tool_stats = self._tool_statistics(output)  # (N, 4) gathered: position, length, calls, turns
        rewards_per_func = self._gathered_rewards_per_func
        rewards = total_rewards(rewards_per_func, self.reward_weights)
        scorable = ~torch.isnan(rewards)
        # TRL lays each prompt's completions out consecutively, `num_generations` at a time.
        group_ids = torch.arange(len(rewards), device=device) // self.num_generations
        if self._values is not None:
            outcomes = tracker_rewards(rewards, self.args)
            centered = outcomes - dispatch_values.to(device)
            self._append_train_metrics(self._values.round_metrics(keys, dispatch_values, self._value_event))
            if self._priority_sampler is not None:
                effective = effective_num_prompts(self._priority_sampler.weights).item()
                self._append_train_metrics({"value/effective_prompts": effective})
        else:
            centered = self._estimator(rewards, group_ids, scorable)
            if self.args.filter_zero_variance_groups:
                scorable = scorable & ~self._drop_zero_variance_groups(rewards, output, inputs)
        correctness = None
        if self.args.tool_shaping_correct_reward is not None:
            correctness = rewards_per_func[:, self.reward_func_names.index(self.args.tool_shaping_correct_reward)]
        scored = self._pipeline.score(
            AdvantageBatch(
                centered=centered,
                scorable=scorable,
                token_counts=tool_stats[:, 1],
                group_ids=group_ids,
                rewards=rewards,
                # TRL's group z-score, gathered only where it is the advantage (each gather is a collective).
                group_advantages=(
                    self.accelerator.gather(output["advantages"])
                    if self.args.advantage_normalization == "group"
                    else None
                ),
                tool_stats=tool_stats,
                correctness=correctness,
                texts=lambda: gather_object(
                    self._tokenizer.batch_decode(output["completion_ids"], skip_special_tokens=True)
                ),
                reward_columns={
                    f"rewards/{name}": column
                    for name, column in zip(self.reward_func_names, rewards_per_func.T, strict=True)
                },
            )
        )
        self._append_train_metrics(scored.metrics)
        if self._values is not None or self.args.advantage_normalization != "group" or self.args.tool_shaping:
            output["advantages"] = self._local_slice(scored.advantages, inputs)
            # The deque holds one generation batch: extending replaces TRL's logged advantages with the final ones.
            self._logs["advantages"].extend(scored.advantages.tolist())
        if self._values is not None:
            self._values.observe_round(keys, outcomes, scorable, self._value_event, output)
        policy_loss = get_policy_loss(self.loss_type)
        if policy_loss is not None and policy_loss.draw is not None:
            # Drawn once per round on the gathered advantages, seeded alike on every rank.
            generator = torch.Generator().manual_seed(self.args.seed * 1_000_003 + self._value_event)
            for name, draw in policy_loss.draw(scored.advantages.cpu(), self.args, generator).items():
                output[DRAW_PREFIX + name] = self._local_slice(draw, inputs)

    def _drop_zero_variance_groups(self, rewards, output, inputs) -> torch.Tensor:
        """Take groups whose rewards are all equal out of the loss: their tokens leave the completion mask and the
        token count TRL normalizes by (the reference rejects them from the batch). Returns the gathered (N,) dropped
        flags, so the caller also leaves them out of the advantage statistics."""
        dropped = zero_variance_groups(rewards, self.num_generations)
        keep = (~self._local_slice(dropped, inputs)).unsqueeze(1).to(output["completion_mask"].dtype)
        output["completion_mask"] = output["completion_mask"] * keep
        output["num_items_in_batch"] = self.accelerator.gather(action_mask(output).sum()).sum()
        self._metrics["train"]["filter/zero_variance_dropped_share"].append(dropped.float().mean().item())
        return dropped.to(rewards.device)

    def _local_slice(self, gathered: torch.Tensor, inputs) -> torch.Tensor:
        start = self.accelerator.process_index * len(inputs)
        return gathered[start : start + len(inputs)].to(self.accelerator.device)

    def _tool_statistics(self, output) -> torch.Tensor:
        """(N, 4) gathered tool statistics of the round (`ToolCallCounter`), logged as `tools/*` when they apply."""
        stats = self._tool_calls(output["completion_ids"], output["completion_mask"], output.get("tool_mask"))
        gathered = self.accelerator.gather(stats.to(self.accelerator.device))
        if self.tools or self.args.tool_call_pattern is not None or self.args.tool_shaping:
            for name, value in tool_call_metrics(*gathered.unbind(dim=1)).items():
                self._metrics["train"][f"tools/{name}"].append(value)
        return gathered

    # ---------------------------------------------------------------- value tracking
    def _visit_forward(self, input_ids, attention_mask, logits_to_keep, multimodal) -> torch.Tensor:
        """The current policy's log-probs for KL-adaptive rho's pass over stored visits (`ValueTracking`)."""
        batch_size = self.args.per_device_train_batch_size
        return self._get_per_token_logps_and_entropies(
            self.model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size, **multimodal
        )[0]

    def _append_train_metrics(self, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self._metrics["train"][name].append(value)

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """Trainer's scheduler; with `lr_schedule_per_generation`, each multiplier is taken at the first optimizer
        step of its generation round (`per_generation_lr_lambda`), as verl steps its scheduler once per rollout."""
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        if self.args.lr_schedule_per_generation:  # idempotent: a second call wraps with the same rounding
            steps_per_round = int(self.args.optimizer_steps_per_generation())
            scheduler.lr_lambdas = [per_generation_lr_lambda(f, steps_per_round) for f in scheduler.lr_lambdas]
        return scheduler

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """`zero_advantage_share` replaces TRL's `frac_reward_zero_std` with one completion per prompt, where that
        would read 1.0 on every step (each group has one member)."""
        mode = "train" if self.model.training else "eval"
        if self._weight_map is not None and mode == "train":
            self._log_weight_map()
        reduce_ratio_metrics(self._metrics[mode])
        if self.num_generations == 1:
            self._metrics[mode].pop("frac_reward_zero_std", None)
        super().log(logs, start_time)

    # ---------------------------------------------------------------- checkpoints
    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)
        self._save_aspo_state(output_dir)

    def _save_aspo_state(self, checkpoint: str) -> None:
        # Collective when a KL-adaptive round is pending (rho is gathered): every rank computes, the main one writes.
        tracker, entries = (None, {}) if self._values is None else self._values.checkpoint_entries()
        self._save_weight_map(checkpoint)
        if not self.args.should_save:
            return
        sampler = None
        if self._priority_sampler is not None:
            # Weights of the checkpoint's tracker (which may have closed a pending round), so the file is consistent.
            sampler = copy.deepcopy(self._priority_sampler)
            sampler.set_values(self._values.priority_values(self._value_event, tracker))
            sampler = sampler.state_dict()
        save_project_state(
            checkpoint,
            self.args,
            train_rows(self.train_dataset),
            self._value_event,
            self._aspo_kl_coef,
            entries.pop("tracker", None),
            sampler=sampler,
            **entries,
        )

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        self._restore_weight_map(checkpoint)
        if self._values is None:
            state, _ = restore_project_state(
                checkpoint, self.args, train_rows(self.train_dataset), None, self.state.global_step
            )
        else:
            state = self._values.restore(checkpoint, self.state.global_step)
        if state is None:
            return
        self._value_event = state["value_event"]
        self._aspo_kl_coef = state["aspo_kl_coef"]
        if self._priority_sampler is not None and state.get("sampler") is not None:
            try:
                self._priority_sampler.load_state_dict(state["sampler"])
            except (KeyError, TypeError, ValueError) as error:
                raise ValueError(
                    f"checkpoint state {checkpoint_state_file(checkpoint)} holds a sampler state that cannot be "
                    "resumed: "
                    f"{error.__class__.__name__}: {error}"
                ) from None
        if self._values is not None:
            # A checkpoint without sampler state (saved without prioritized sampling) still sets weights from its
            # tracker, at the restored event.
            self._values.refresh_priorities()
