"""`AsyncASPOTrainer`'s loss: a registered policy loss (`assembled_loss`, trl_aspo.trainers.loss_assembly, shared with
ASPOTrainer) on the log-probs of AsyncGRPOTrainer's own packed forward, laid out per sample, with the generator's
log-probs as the old policy and every unit of an optimizer step weighted the same; and the decoupled objective
(`vllm_importance_sampling_correction`): the ratio against the trainer's own log-probs at the step, each token's loss
weighted by the rollout correction (trl_aspo.algorithms.rollout_correction), for TRL's PPO loss and every registered
one (docs/async.md)."""

from __future__ import annotations

from collections import defaultdict

import torch

from trl_aspo.algorithms.losses import clipped_surrogate_loss, step_loss_normalizer
from trl_aspo.algorithms.packed import SegmentRows, packed_loss_units
from trl_aspo.algorithms.policy_losses import PolicyLoss, PolicyLossInputs, RatioMetric, get_policy_loss
from trl_aspo.algorithms.proximal_policy import PROXIMAL_SUM_NAMES, proximal_metrics, proximal_sums
from trl_aspo.algorithms.rollout_correction import (
    CORRECTION_SUM_NAMES,
    correction_metrics,
    correction_sums,
    rollout_correction_weight,
)
from trl_aspo.algorithms.weight_map import clipped_ratio_weight
from trl_aspo.trainers.loss_assembly import AssemblyInputs, assembled_loss, log_loss_metrics
from trl_aspo.trainers.step_timing import OFFPOLICY_CORRECTION, POLICY_LOSS
from trl_aspo.trainers.weight_map_mixin import WeightMapMixin


def _trl_ppo_loss(inputs: PolicyLossInputs):
    loss, dual_clipped = clipped_surrogate_loss(
        inputs.log_probs,
        inputs.old_log_probs,
        inputs.advantages,
        inputs.epsilon_low,
        inputs.epsilon_high,
        getattr(inputs.args, "ppo_dual_clip", None),
    )
    return loss, {"dual_clipped": dual_clipped}


# TRL's "ppo" loss written out for the decoupled mode and the dual clip, where TRL's inline computation cannot take
# the proximal ratio, the correction weight or the cap; not registered (TRL owns the name). `ppo/dual_clip_frac`:
# action tokens with A < 0 where the cap binds, over all action tokens (as verl counts).
TRL_PPO_LOSS = PolicyLoss("ppo", _trl_ppo_loss, metrics=(RatioMetric("ppo/dual_clip_frac", "dual_clipped"),))
# Metrics logged again under this suffix on the steps j >= 1 of a rollout batch, where the proximal ratio can move
# (a batch's first step would otherwise dilute them).
LATER_STEPS_SUFFIX = "_later_steps"
# TRL's own staleness measurements (its RolloutQueueDataset, per sample when it is taken for a step), logged also under
# the names users compare across frameworks.
STALENESS_ALIASES = {
    "sample/staleness_mean": "offpolicy/staleness_mean",
    "sample/staleness_max": "offpolicy/staleness_max",
}


class AsyncGRPOLossMixin(WeightMapMixin):
    """`compute_loss` (TRL's PPO loss is inlined in it), `get_batch_samples` (one step's units) and `log` (closes the
    weight map's window) of `AsyncASPOTrainer`."""

    _loss_micro_batches = 0  # seeds the per-micro-batch draws of a registered loss
    _correction_window: torch.Tensor | None = None  # this optimizer step's `correction_sums` so far

    @property
    def _loss_type(self) -> str:
        """`args.loss_type`, or TRL's PPO loss for arguments without it: AsyncGRPOConfig has no such field, and
        TRL's own tests drive these methods on a trainer built by hand with plain `TrainingArguments`."""
        return getattr(self.args, "loss_type", "ppo")

    @property
    def _policy_loss(self) -> PolicyLoss | None:
        """The registered loss `loss_type` names; None for TRL's PPO loss."""
        return get_policy_loss(self._loss_type)

    @property
    def _decoupled(self) -> bool:
        """Whether the decoupled objective is on (False for arguments without the field, as `_loss_type`)."""
        return bool(getattr(self.args, "vllm_importance_sampling_correction", False))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """A registered loss: TRL's packed forward and accounting run unchanged (its PPO loss is inlined there, so
        there is no smaller method to override); the returned loss is `assembled_loss` on the same log-probs, laid
        out per sample (`SegmentRows`) with the generator's log-probs as the old policy.

        With `log_weight_map`, every trained token enters the map, old probability = the generator's: every sample
        here carries the rollout's log-probs, from a policy up to `max_staleness` versions behind and computed by
        another engine. With loss_type='ppo' the weight is TRL's clipped surrogate's, `clipped_ratio_weight` without
        `delta`.

        Decoupled (`vllm_importance_sampling_correction`): the old policy is the proximal policy of the sample's
        rollout batch (`RolloutBatchMixin.proximal_log_probs`: on a batch's first step the trainer's own log-probs of
        this forward, detached), and each token's loss is multiplied by the rollout correction weight
        w_is = f(pi_prox / pi_generator); TRL's PPO loss is then computed here (`TRL_PPO_LOSS`, TRL's normalization),
        as it is with `ppo_dual_clip`. The weight map then records w_is times the loss's weight, against the
        generator's probability."""
        policy_loss = self._policy_loss
        decoupled = self._decoupled
        dual_clip = getattr(self.args, "ppo_dual_clip", None) is not None
        collects_weight_map = self._weight_map is not None and self.model.training
        if policy_loss is None and not decoupled and not dual_clip and not collects_weight_map:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        captured = {}

        def forward(**kwargs):
            captured["outputs"] = model(**kwargs)
            return captured["outputs"]

        ppo_loss = super().compute_loss(forward, inputs, return_outputs, num_items_in_batch)
        outputs = captured["outputs"]
        selected = inputs["token_index"] >= 0
        token_index = inputs["token_index"][selected]
        if policy_loss is None and not decoupled and not dual_clip:
            # TRL's loss runs on the flat (M,) targets: one (1, M) row of action tokens.
            old_log_probs, advantages = inputs["old_log_probs"][selected][None], inputs["advantages"][selected][None]
            log_probs = outputs.log_probs.flatten()[token_index][None].detach()
            self._add_clipped_ratio_weight_map(old_log_probs, log_probs, advantages, torch.ones_like(log_probs))
            return ppo_loss
        rows = SegmentRows(inputs["segment_id"][selected])
        log_probs = rows.to_rows(outputs.log_probs.flatten()[token_index])
        generator_log_probs = rows.to_rows(inputs["old_log_probs"][selected])
        advantages = rows.to_rows(inputs["advantages"][selected])
        args = self.args
        old_log_probs, factor = generator_log_probs, None
        if decoupled:
            with self._timed(OFFPOLICY_CORRECTION, log_probs.device):
                old_log_probs, alpha = self.proximal_log_probs(inputs, rows, selected, log_probs, generator_log_probs)
                factor = self._rollout_correction(
                    log_probs, old_log_probs, generator_log_probs, advantages, rows.mask, alpha
                )
        if policy_loss is None:
            # TRL's PPO loss and its normalization: the micro-batch's token sum over its tokens per rank, per
            # accumulation step.
            tokens_per_rank = (inputs["global_n_tokens"][0] / self.accelerator.num_processes).clamp(min=1.0)
            loss_fn, draws, normalizer = TRL_PPO_LOSS, {}, tokens_per_rank.to(log_probs)
            divisor = self.current_gradient_accumulation_steps
        else:
            loss_fn, draws, divisor = policy_loss, {}, 1.0
            if policy_loss.draw is not None:
                # Drawn among this micro-batch's samples (the synchronous trainer draws once per round).
                generator = torch.Generator().manual_seed(args.seed * 1_000_003 + self._loss_micro_batches)
                draws = policy_loss.draw(advantages[:, 0], args, generator)
            self._loss_micro_batches += 1
            # Every action token (or completion) of the optimizer step weighs the same across ranks and micro-batches.
            units = self._loss_step_units[0 if args.aspo_aggregation == "token" else 1]
            normalizer = step_loss_normalizer(units, self.accelerator.num_processes).to(log_probs)
        entropies = rows.to_rows(outputs.entropy.flatten()[token_index].detach())
        # The loss's forward beyond TRL's packed forward; its backward is TRL's.
        with self._timed(POLICY_LOSS, log_probs.device):
            out = assembled_loss(
                loss_fn,
                AssemblyInputs(
                    log_probs, old_log_probs, advantages, rows.mask, entropies=entropies, draws=draws, factor=factor
                ),
                args,
                self.state.global_step,
                self.epsilon_low,
                self.epsilon_high,
                normalizer,
                divisor,
            )
        loss = out.loss
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * outputs.aux_loss / self.current_gradient_accumulation_steps
        if collects_weight_map:
            if policy_loss is None:
                weight = clipped_ratio_weight(
                    log_probs, old_log_probs, advantages, self.epsilon_low, self.epsilon_high
                )
                weight = weight * (~out.stats["dual_clipped"]).to(weight.dtype)
            else:
                weight = policy_loss.weight(out.stats, advantages, args)
            weight = weight if factor is None else weight * factor
            self._add_weight_map(generator_log_probs, log_probs, advantages, rows.mask, weight)
        if policy_loss is not None or dual_clip:
            with self._timed(POLICY_LOSS, log_probs.device):
                self._log_loss_metrics(loss_fn, out.stats, rows.mask, out.per_token_loss.detach())
        return loss

    def _rollout_correction(
        self, log_probs, proximal_log_probs, generator_log_probs, advantages, mask, alpha
    ) -> torch.Tensor:
        """The correction weight (B, T) of one micro-batch; its diagnostics and the proximal ratio's
        (`proximal_sums`, and the loglinear `alpha`) join the optimizer step's window, which the step's last
        micro-batch closes: summed over ranks (every rank reaches it), logged as `offpolicy/*` and `ppo/*`."""
        args = self.args
        weight, changed, log_ratio = rollout_correction_weight(
            proximal_log_probs,
            generator_log_probs,
            mask,
            args.vllm_importance_sampling_mode,
            args.vllm_importance_sampling_clip_min,
            args.vllm_importance_sampling_clip_max,
        )
        alpha_sum = torch.zeros((), dtype=torch.float64)
        if alpha is not None:
            alpha_sum = (alpha.to(mask.device)[:, None] * mask).sum().to(torch.float64)
        sums = torch.cat(
            [
                correction_sums(weight, changed, log_ratio, advantages, mask),
                proximal_sums(log_probs, proximal_log_probs, advantages, mask, self.epsilon_low, self.epsilon_high),
                alpha_sum.view(1).to(mask.device),
            ]
        )
        self._correction_window = sums if self._correction_window is None else self._correction_window + sums
        if self.accelerator.sync_gradients:
            totals = self.accelerator.reduce(self._correction_window.to(self.accelerator.device), reduction="sum")
            totals = totals.tolist()
            self._correction_window = None
            split = len(CORRECTION_SUM_NAMES)
            metrics = self._metrics["train"]
            for name, value in correction_metrics(totals[:split]).items():
                metrics[name].append(value)
            proximal = totals[split : split + len(PROXIMAL_SUM_NAMES)]
            pairs = proximal_metrics(proximal)
            if alpha is not None and pairs:
                pairs["offpolicy/proximal_alpha_mean"] = (totals[-1], proximal[0])
            self._append_step_metrics(pairs)
        return weight.to(proximal_log_probs.dtype)

    def _append_step_metrics(self, values: dict) -> None:
        """Append metric values of this optimizer step, and, on the steps j >= 1 of a rollout batch, again under
        `LATER_STEPS_SUFFIX`."""
        metrics = self._metrics["train"]
        later = self.steps_per_rollout_batch > 1 and self._step_in_batch >= 1
        for name, value in values.items():
            metrics[name].append(value)
            if later:
                metrics[name + LATER_STEPS_SUFFIX].append(value)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self._weight_map is not None and self.model.training:
            self._log_weight_map()
        metrics = self._metrics["train"]
        for trl_name, name in STALENESS_ALIASES.items():
            if metrics.get(trl_name):
                metrics[name] = list(metrics[trl_name])
        super().log(logs, start_time)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """`Trainer.get_batch_samples` (one optimizer step's micro-batches), also counting the step's action tokens
        and completions over all its micro-batches and ranks for `aspo_aggregation` (`_loss_step_units`)."""
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self._policy_loss is not None:
            local = [packed_loss_units(batch["segment_id"][batch["token_index"] >= 0]) for batch in batch_samples]
            local = torch.stack(local).sum(0) if local else torch.zeros(2)
            self._loss_step_units = self.accelerator.reduce(local.to(self.accelerator.device), reduction="sum")
        return batch_samples, num_items_in_batch

    def _log_loss_metrics(
        self, policy_loss: PolicyLoss, stats: dict[str, torch.Tensor], mask: torch.Tensor, per_token_loss: torch.Tensor
    ):
        """The loss's metric ratios over the logging window (`log_loss_metrics`, shared with ASPOTrainer; also under
        `LATER_STEPS_SUFFIX` on a rollout batch's later steps), and `policy_loss`, the token mean of the per-token
        loss, summed over ranks (TRL reduces the pairs)."""
        window = defaultdict(list)
        (loss_sum,), tokens = log_loss_metrics(
            window, self.accelerator, policy_loss, stats, mask, (per_token_loss * mask).sum()
        )
        for name, values in window.items():
            for value in values:
                self._append_step_metrics({name: value})
        if tokens > 0:
            self._metrics["train"]["policy_loss"].append((loss_sum, tokens))
