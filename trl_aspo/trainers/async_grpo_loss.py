"""`AsyncASPOTrainer`'s loss: `aspo_loss` (trl_aspo.trainers.loss_assembly, shared with ASPOTrainer) on the
log-probs of AsyncGRPOTrainer's own packed forward, laid out per sample, with the generator's log-probs as the old
policy and every unit of an optimizer step weighted the same (docs/async.md)."""

from __future__ import annotations

import torch

from trl_aspo.algorithms.losses import step_loss_normalizer, unflipped_sample_mask
from trl_aspo.algorithms.packed import SegmentRows, packed_loss_units
from trl_aspo.trainers.loss_assembly import AspoLossInputs, aspo_loss, log_aspo_token_metrics
from trl_aspo.trainers.weight_map_mixin import WeightMapMixin


class AsyncGRPOLossMixin(WeightMapMixin):
    """`compute_loss` (TRL's PPO loss is inlined in it), `get_batch_samples` (one step's units) and `log` (closes the
    weight map's window) of `AsyncASPOTrainer`."""

    _aspo_micro_batches = 0  # seeds the per-micro-batch draw of aspo_unflipped_fraction

    @property
    def _loss_type(self) -> str:
        """`args.loss_type`, or TRL's PPO loss for arguments without it: AsyncGRPOConfig has no such field, and
        TRL's own tests drive these methods on a trainer built by hand with plain `TrainingArguments`."""
        return getattr(self.args, "loss_type", "ppo")

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """loss_type='aspo': TRL's packed forward and accounting run unchanged (its PPO loss is inlined there, so
        there is no smaller method to override); the returned loss is `aspo_loss` on the same log-probs, laid out
        per sample (`SegmentRows`) with the generator's log-probs as the old policy.

        With `log_weight_map`, every trained token enters the map, old probability = the generator's: every sample
        here carries the rollout's log-probs, from a policy up to `max_staleness` versions behind and computed by
        another engine, and each sample trains once. With loss_type='ppo' the weight is TRL's clipped surrogate's,
        `clipped_ratio_weight` without `delta`."""
        collects_weight_map = self._weight_map is not None and self.model.training
        if self._loss_type != "aspo" and not collects_weight_map:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        captured = {}

        def forward(**kwargs):
            captured["outputs"] = model(**kwargs)
            return captured["outputs"]

        ppo_loss = super().compute_loss(forward, inputs, return_outputs, num_items_in_batch)
        outputs = captured["outputs"]
        selected = inputs["token_index"] >= 0
        token_index = inputs["token_index"][selected]
        if self._loss_type == "ppo":
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
        entropies = None
        if args.aspo_entropy_quantile is not None:
            entropies = rows.to_rows(outputs.entropy.flatten()[token_index].detach())
        unflipped = None
        if args.aspo_unflipped_fraction > 0:
            # Drawn among this micro-batch's positive-advantage samples (the synchronous trainer draws per round).
            generator = torch.Generator().manual_seed(args.seed * 1_000_003 + self._aspo_micro_batches)
            unflipped = unflipped_sample_mask(advantages[:, 0], args.aspo_unflipped_fraction, generator)
        self._aspo_micro_batches += 1
        # Every action token (or completion) of the optimizer step weighs the same across ranks and micro-batches.
        units = self._aspo_step_units[0 if args.aspo_aggregation == "token" else 1]
        out = aspo_loss(
            AspoLossInputs(log_probs, old_log_probs, advantages, rows.mask, entropies=entropies, unflipped=unflipped),
            args,
            self.state.global_step,
            self.epsilon_low,
            self.epsilon_high,
            step_loss_normalizer(units, self.accelerator.num_processes).to(log_probs),
        )
        loss = out.loss
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * outputs.aux_loss / self.current_gradient_accumulation_steps
        if collects_weight_map:
            self._add_aspo_weight_map(old_log_probs, log_probs, advantages, rows.mask, out.stats)
        self._log_aspo_metrics(out.stats, rows.mask, out.per_token_loss.detach())
        return loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self._weight_map is not None and self.model.training:
            self._log_weight_map()
        super().log(logs, start_time)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """`Trainer.get_batch_samples` (one optimizer step's micro-batches), also counting the step's action tokens
        and completions over all its micro-batches and ranks for `aspo_aggregation` (`_aspo_step_units`)."""
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self._loss_type == "aspo":
            local = [packed_loss_units(batch["segment_id"][batch["token_index"] >= 0]) for batch in batch_samples]
            local = torch.stack(local).sum(0) if local else torch.zeros(2)
            self._aspo_step_units = self.accelerator.reduce(local.to(self.accelerator.device), reduction="sum")
        return batch_samples, num_items_in_batch

    def _log_aspo_metrics(self, stats: dict[str, torch.Tensor], mask: torch.Tensor, per_token_loss: torch.Tensor):
        """The `aspo/*` ratios over the logging window (`log_aspo_token_metrics`, shared with ASPOTrainer), and
        `policy_loss`, the token mean of the per-token loss, summed over ranks (TRL reduces the pairs)."""
        metrics = self._metrics["train"]
        (loss_sum,), tokens = log_aspo_token_metrics(
            metrics, self.accelerator, stats, mask, (per_token_loss * mask).sum()
        )
        if tokens > 0:
            metrics["policy_loss"].append((loss_sum, tokens))
