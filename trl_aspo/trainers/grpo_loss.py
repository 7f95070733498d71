"""`ASPOTrainer`'s loss: a registered policy loss (`assembled_loss`, trl_aspo.trainers.loss_assembly, shared with
AsyncASPOTrainer) inside GRPOTrainer's loss pipeline (its forward pass, masks, vLLM IS correction and KL), TRL's own
loss with the weight map, and the adaptive KL coefficient (docs/asymmetric_loss.md)."""

from __future__ import annotations

import torch

from trl_aspo.algorithms.policy_losses import PolicyLoss, get_policy_loss
from trl_aspo.algorithms.rollout_correction import correction_metrics, correction_sums, rollout_correction_weight
from trl_aspo.trainers.loss_assembly import AssemblyInputs, assembled_loss, log_loss_metrics
from trl_aspo.trainers.step_timing import OFFPOLICY_CORRECTION, POLICY_LOSS
from trl_aspo.trainers.weight_map_mixin import WeightMapMixin

# Batch keys of a registered loss's per-sample draws (B-length tensors survive TRL's shuffling and splitting).
DRAW_PREFIX = "policy_loss_draw_"

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


def action_mask(inputs) -> torch.Tensor:
    """(B, T) the tokens the loss trains on: completion tokens the model wrote (tool outputs masked out)."""
    completion_mask = inputs["completion_mask"]
    return completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]


class GRPOLossMixin(WeightMapMixin):
    """The loss methods of `ASPOTrainer` (a `GRPOTrainer`): `_compute_loss` (TRL picks its per-token term inline, so
    a registered loss replaces the method) and `_get_per_token_logps_and_entropies` (hands TRL's own loss's log-probs
    to the weight map)."""

    # While TRL's own loss runs with log_weight_map: the current log-probs its forward pass computes.
    _weight_map_logps: list[torch.Tensor] | None = None

    def _compute_loss(self, model, inputs):
        policy_loss = get_policy_loss(self.loss_type)
        if policy_loss is not None:
            return self._compute_registered_loss(model, inputs, policy_loss)
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
            inputs["old_per_token_logps"], per_token_logps, inputs["advantages"], action_mask(inputs), self.args.delta
        )
        return loss

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        result = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if self._weight_map_logps is not None:
            self._weight_map_logps.append(result[0].detach())
        return result

    def _collects_weight_map(self, inputs) -> bool:
        """Whether this micro-batch enters the weight map: training passes with behaviour log-probs (off-policy or
        vLLM-corrected; TRL leaves them out on-policy, where r = 1 and every weight is 1)."""
        return self._weight_map is not None and self.model.training and inputs.get("old_per_token_logps") is not None

    def _compute_registered_loss(self, model, inputs, policy_loss: PolicyLoss):
        """`assembled_loss` (shared with AsyncASPOTrainer) on TRL's forward pass, with TRL's masks, its vLLM IS
        correction and its KL term, aggregated over one accumulation window as TRL's dapo (token) or grpo
        (sequence)."""
        mode = "train" if self.model.training else "eval"
        mask = action_mask(inputs)
        per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model,
            torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
            inputs["completion_ids"].size(1),
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            **{key: inputs.get(key) for key in _FORWARD_KEYS},
        )
        advantages = inputs["advantages"]
        old_per_token_logps = inputs.get("old_per_token_logps")
        old_per_token_logps = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
        factor = torch.ones_like(per_token_logps)
        if self.off_policy_mask_threshold is not None or (self.use_vllm and self.vllm_importance_sampling_correction):
            with self._timed(OFFPOLICY_CORRECTION, per_token_logps.device, mode == "train"):
                factor = self._off_policy_factor(inputs, per_token_logps, old_per_token_logps, mask)
        if self.top_entropy_quantile < 1.0:
            factor = factor * self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        normalizer, divisor = None, accumulation
        if self.args.aspo_aggregation == "token":
            # `num_items_in_batch` spans the generation batch: rescale to one accumulation window, as TRL's dapo.
            normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
            divisor = 1.0
        # Timed apart from the weight map, a diagnostic of its own; the loss's backward is TRL's.
        with self._timed(POLICY_LOSS, per_token_logps.device, mode == "train"):
            out = assembled_loss(
                policy_loss,
                AssemblyInputs(
                    per_token_logps,
                    old_per_token_logps,
                    advantages,
                    mask,
                    entropies=entropies.detach(),
                    draws={
                        key[len(DRAW_PREFIX) :]: value for key, value in inputs.items() if key.startswith(DRAW_PREFIX)
                    },
                    factor=factor,
                    ref_log_probs=inputs["ref_per_token_logps"] if self.beta != 0.0 else None,
                    kl_coef=self._aspo_kl_coef,
                ),
                self.args,
                self.state.global_step,
                self.epsilon_low,
                self.epsilon_high,
                normalizer,
                divisor,
            )
        if self._collects_weight_map(inputs):
            self._add_registered_weight_map(
                policy_loss, old_per_token_logps, per_token_logps, advantages, mask, out.stats
            )
        loss = out.loss
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
        with self._timed(POLICY_LOSS, per_token_logps.device, mode == "train"):
            self._log_loss_metrics(mode, policy_loss, out, entropies, mask)
        return loss

    def _off_policy_factor(self, inputs, per_token_logps, old_per_token_logps, mask) -> torch.Tensor:
        """TRL's off-policy corrections of a micro-batch as one factor of a registered loss's per-token term: its
        off-policy sequence mask (`off_policy_mask_threshold`) and its vLLM importance-sampling weight."""
        factor = torch.ones_like(per_token_logps)
        if self.off_policy_mask_threshold is not None:
            advantages = inputs["advantages"]
            factor = factor * self.get_off_policy_mask(
                advantages=advantages if advantages.dim() == 2 else advantages.unsqueeze(1),
                per_token_logps=per_token_logps,
                sampling_per_token_logps=inputs.get("sampling_per_token_logps", old_per_token_logps),
                mask=mask,
                off_policy_threshold=self.off_policy_mask_threshold,
            )
        if self.use_vllm and self.vllm_importance_sampling_correction:
            factor = factor * inputs["importance_sampling_ratio"]
        return factor

    def _log_loss_metrics(self, mode, policy_loss, out, entropies, mask) -> None:
        """The loss's metrics as ratios over the logging window (`log_loss_metrics`, shared); `entropy`, `kl` and
        `policy_loss` per micro-batch, as GRPOTrainer logs them."""
        sums = [(entropies.detach() * mask).sum(), out.aggregated]
        if out.per_token_kl is not None:
            sums.append((out.per_token_kl.detach() * mask).sum())
        totals, tokens = log_loss_metrics(self._metrics[mode], self.accelerator, policy_loss, out.stats, mask, *sums)
        metrics = self._metrics[mode]
        metrics["entropy"].append(totals[0] / max(tokens, 1.0))
        metrics["policy_loss"].append(totals[1] / self.accelerator.num_processes)
        if out.per_token_kl is not None:
            metrics["kl"].append(totals[2] / max(tokens, 1.0))
            metrics["aspo/kl_coef"].append(self._aspo_kl_coef)
        if mode == "train" and self.args.aspo_adaptive_kl_beta is not None:
            self._update_adaptive_kl(totals[0], tokens)

    def _log_rollout_correction(self, output) -> None:
        """TRL's vLLM importance-sampling correction of a training round (`importance_sampling_ratio`, the weight of
        `c = f(pi_old / pi_vllm)` that multiplies every loss), as the `offpolicy/*` diagnostics AsyncASPOTrainer logs
        for its decoupled mode: the weight's mean and effective sample size, the share of tokens truncated or masked
        by the sign of the final advantage, and the mean |log(pi_old / pi_vllm)|, over the round and every rank."""
        if "importance_sampling_ratio" not in output:
            return
        mask = action_mask(output)
        _, changed, log_ratio = rollout_correction_weight(
            output["old_per_token_logps"],
            output["sampling_per_token_logps"],
            mask,
            self.vllm_importance_sampling_mode,
            self.args.vllm_importance_sampling_clip_min,
            self.args.vllm_importance_sampling_clip_max,
        )
        weight = output["importance_sampling_ratio"].expand(mask.shape)
        sums = correction_sums(weight, changed, log_ratio, output["advantages"], mask)
        totals = self.accelerator.reduce(sums.to(self.accelerator.device), reduction="sum").tolist()
        for name, value in correction_metrics(totals).items():
            self._metrics["train"][name].append(value)

    def _update_adaptive_kl(self, entropy_sum: float, token_count: float) -> None:
        """Raise the KL coefficient for the next optimizer step while the step's mean entropy is below target."""
        window = (entropy_sum, token_count)
        if self._aspo_entropy_window is not None:
            window = (self._aspo_entropy_window[0] + entropy_sum, self._aspo_entropy_window[1] + token_count)
        self._aspo_entropy_window = window
        if not self.accelerator.sync_gradients:
            return
        low = window[0] / max(window[1], 1.0) < self.args.aspo_adaptive_kl_entropy_target
        self._aspo_kl_coef = self.args.aspo_adaptive_kl_beta if low else self.beta
        self._aspo_entropy_window = None
