"""Single-stream scoring of a batch of samples: the one home of the glue between config, value tracker,
normalization and tool shaping (DESIGN.md sections 2-4). `AsyncASPOTrainer` scores each optimizer step's samples
with it; `ASPOTrainer` can delegate to it later.

Data flow of one batch (`StepScorer.score`):

1. rewards for the tracker: the total reward, mapped by `value_reward_range` onto [0, 1] (`tracker_rewards`);
2. baseline: `A = R - v(x, z)` with the value read before any outcome of the batch is observed (spo++:
   `AsyncEventValues` at the sample's model version `z`; spo: `VisitValueTracker`), then the batch's outcomes are
   observed; for the group estimator, the rollout worker's per-group advantage (rescaled to `R - mean` when the
   batch is normalized here);
3. normalization over the batch (`batch` or `token`, trl_aspo.normalize);
4. tool-position shaping by `group_id` (the whole batch with one completion per prompt, trl_aspo.shaping).

Samples without a reward (every reward function abstained: NaN) get advantage 0 and are not observed.

SPO (per-visit forgetting) applies its updates in arrival order, one outcome at a time: with asynchronous rollouts
the state it reaches depends on the order in which samples arrive, by construction. SPO++ depends only on the set
of outcomes visible to each sample (trl_aspo.event_values).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .event_values import AsyncEventValues
from .normalize import batch_normalize, token_measure_normalize
from .shaping import is_correct, shaping_stats, tool_position_bias
from .tracker import VisitValueTracker
from .value_init import read_init_records

# Rewards a hair outside [0, 1] (float round-off of weighted sums) are clamped rather than refused.
_UNIT_RANGE_TOLERANCE = 1e-6


def make_value_tracker(args) -> AsyncEventValues | VisitValueTracker | None:
    """The tracker `args.advantage_estimator` asks for (None for the group baseline), initialized from
    `args.value_init_file` when given (priors anchored at version 0, the start of training)."""
    if args.advantage_estimator == "spo++":
        tracker = AsyncEventValues(rho=args.value_rho)
    elif args.advantage_estimator == "spo":
        tracker = VisitValueTracker()
    else:
        return None
    if args.value_init_file is not None:
        records = read_init_records(args.value_init_file, None)
        if records.count_keys:
            tracker.init_from_counts(
                records.count_keys, records.successes, records.trials, prior_strength=args.value_prior_strength
            )
        if records.pseudo_keys:
            tracker.set_pseudo_counts(records.pseudo_keys, records.alphas, records.betas)
    return tracker


def tracker_rewards(rewards: torch.Tensor, args) -> torch.Tensor:
    """Total rewards as the tracker learns them: mapped by `value_reward_range` onto [0, 1], NaN kept."""
    if args.value_reward_range is not None:
        low, high = args.value_reward_range
        rewards = (rewards - low) / (high - low)
    valid = rewards[~torch.isnan(rewards)]
    outside = (valid < -_UNIT_RANGE_TOLERANCE) | (valid > 1 + _UNIT_RANGE_TOLERANCE)
    if outside.any():
        bad = valid[outside][0].item()
        if args.value_reward_range is not None:
            raise ValueError(
                f"advantage_estimator={args.advantage_estimator!r} needs total rewards in [0, 1]; after mapping "
                f"value_reward_range={list(args.value_reward_range)} onto [0, 1] a reward is {bad}: the rewards "
                "leave the declared range."
            )
        raise ValueError(
            f"advantage_estimator={args.advantage_estimator!r} needs total rewards in [0, 1]; got {bad}. Set "
            "value_reward_range=[lo, hi] to map a known reward range onto [0, 1]."
        )
    return rewards.clamp(0.0, 1.0)


@dataclass
class ScoredBatch:
    """What `StepScorer.score` returns: final advantages (B,) float64 and the metrics of the batch."""

    advantages: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


class StepScorer:
    """Scores batches of samples for one trainer: holds the value tracker for its whole life (and checkpoints)."""

    def __init__(self, args) -> None:
        self.args = args
        self.tracker = make_value_tracker(args)

    def baseline(
        self,
        keys: list[str],
        rewards: torch.Tensor,
        versions: list[int],
        worker_advantages: torch.Tensor,
        worker_reward_std: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """`A = R - v` before normalization (float64 (B,), 0 where the reward is NaN), then observe the outcomes."""
        scorable = ~torch.isnan(rewards)
        metrics: dict[str, float] = {}
        if self.tracker is None:
            advantages = worker_advantages.double()
            if self.args.advantage_normalization != "group":
                # The worker's z-score is (R - mean) / (std + 1e-8) with the group's population std: undo the scale.
                advantages = advantages * (worker_reward_std.double().nan_to_num(0.0) + 1e-8)
            return torch.where(scorable, advantages, torch.zeros_like(advantages)), metrics
        outcomes = tracker_rewards(rewards.double(), self.args)
        index = [i for i in range(len(keys)) if bool(scorable[i])]
        scored_keys = [keys[i] for i in index]
        values = torch.full_like(outcomes, float("nan"))
        if isinstance(self.tracker, AsyncEventValues):
            scored_versions = [versions[i] for i in index]
            self.tracker.enter(scored_keys, scored_versions)
            values[index] = self.tracker.value(scored_keys, scored_versions)
            self.tracker.observe(scored_keys, outcomes[index], scored_versions)
        else:
            for i in index:  # per visit, in arrival order
                values[i] = self.tracker.value([keys[i]])[0]
                self.tracker.observe([keys[i]], outcomes[i : i + 1], self.args.value_rho)
        advantages = torch.where(scorable, outcomes - values, torch.zeros_like(outcomes))
        if index:
            metrics["value/mean"] = values[index].mean().item()
        metrics["value/tracked_prompts"] = float(self.tracker.num_tracked)
        return advantages, metrics

    def score(
        self,
        keys: list[str],
        rewards: torch.Tensor,
        versions: list[int],
        token_counts: torch.Tensor,
        group_ids: torch.Tensor,
        worker_advantages: torch.Tensor,
        worker_reward_std: torch.Tensor,
        tool_positions: torch.Tensor | None = None,
    ) -> ScoredBatch:
        """Baseline, normalization and shaping of one batch (all tensors (B,), in arrival order).

        `tool_positions`: action tokens before each sample's first tool call (-1 for none); needed with
        `tool_shaping`."""
        advantages, metrics = self.baseline(keys, rewards, versions, worker_advantages, worker_reward_std)
        scorable = ~torch.isnan(rewards)
        normalization = self.args.advantage_normalization
        if normalization != "group" and bool(scorable.any()):
            if normalization == "batch":
                normalized = batch_normalize(advantages[scorable])
            else:
                normalized = token_measure_normalize(advantages[scorable], token_counts[scorable].double())
            advantages = advantages.clone()
            advantages[scorable] = normalized
        if self.args.tool_shaping:
            if tool_positions is None:
                raise ValueError("tool_shaping needs the position of each sample's first tool call.")
            lengths = token_counts.long()
            eligible = scorable & is_correct(
                rewards.nan_to_num(float("-inf")), self.args.tool_shaping_correct_threshold
            )
            eligible = eligible & (tool_positions >= 0) & (tool_positions < lengths)
            groups = (
                group_ids.long() if self.args.num_generations > 1 else torch.zeros_like(group_ids, dtype=torch.long)
            )
            bias = tool_position_bias(
                advantages,
                tool_positions.long(),
                lengths,
                eligible,
                groups,
                delta=self.args.tool_shaping_delta,
                k=self.args.tool_shaping_k,
            )
            advantages = advantages + bias
            metrics.update({f"shaping/{name}": value for name, value in shaping_stats(bias, eligible).items()})
        metrics["zero_advantage_share"] = (
            torch.isclose(advantages, torch.zeros_like(advantages), atol=1e-6).double().mean().item()
        )
        return ScoredBatch(advantages=advantages, metrics=metrics)
