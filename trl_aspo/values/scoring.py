"""The advantage pipeline: what both trainers do with a batch once its rewards are gathered (docs/design.md, "Data
flow"). `ASPOTrainer` hands over one generation round gathered across ranks, `AsyncASPOTrainer` one optimizer step's
samples; both call `AdvantagePipeline.score` and log what it returns:

    centered (R - v | a group estimator's, e.g. R - group mean) --> normalization: group | batch (SPO) | token
      (SPO++, action-token measure) --> tool-position shaping (arXiv 2508.19201) and its extras --> unscorable
      samples at 0 --> finite check --> metrics: shaping/*, advantage/p*, zero_advantage_share

A group estimator (trl_aspo.algorithms.advantage_estimators) is called on the same inputs by both trainers: a
generation round's rewards, or each group's raw rewards in the asynchronous trainer (`StepScorer.group_baseline`).
A tracker's baseline differs by trainer, because the policy event differs: the synchronous tracker value is frozen
when the round is dispatched (the trainer reads it then), the asynchronous one is read per sample at its
`model_version` (`StepScorer.tracker_baseline`). A sample without a reward (every reward function abstained: NaN, or
an infinite reward) is unscorable: advantage 0, no part in any statistic (normalization, quantiles,
`zero_advantage_share`, shaping's means and shares), never observed by the tracker.
"""

from __future__ import annotations

import importlib
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from trl_aspo.algorithms.advantage_checks import advantage_sources, check_finite_advantages
from trl_aspo.algorithms.advantage_estimators import get_advantage_estimator
from trl_aspo.algorithms.normalize import batch_normalize, token_measure_normalize
from trl_aspo.algorithms.shaping import (
    CallablePenalty,
    InteractiveTurnBonus,
    ShapingHook,
    is_correct,
    shaping_stats,
    tool_position_bias,
)
from trl_aspo.values.event_values import AsyncEventValues
from trl_aspo.values.single_stream import field_name, tracker_rewards

logger = logging.getLogger(__name__)

ADVANTAGE_QUANTILES = (10, 30, 50, 70, 90)


def unscorable_if_infinite_rewards(
    rewards_per_func: torch.Tensor, reward_weights: torch.Tensor, reward_names: list[str]
) -> torch.Tensor:
    """(N, F) rewards per function with infinite ones turned into NaN, TRL's "this function returned None", and every
    function's reward NaN where the weighted total overflows float32: before any baseline sees them.

    A +-inf reward would make every weight that shares a mean or a standard deviation with it NaN; as None it only
    leaves that completion unscored by that function."""
    infinite = torch.isinf(rewards_per_func)
    totals = (rewards_per_func * reward_weights.to(rewards_per_func.device)).nansum(dim=1)
    overflowing = torch.isinf(totals) & ~infinite.any(dim=1)
    if not (infinite.any() or overflowing.any()):
        return rewards_per_func
    names = [name for name, bad in zip(reward_names, infinite.any(dim=0).tolist(), strict=True) if bad]
    logger.warning(
        f"{int(infinite.sum())} infinite reward(s) from {names} and {int(overflowing.sum())} weighted total(s) "
        "beyond float32 in this round are treated as None (that completion unscored by that function)."
    )
    rewards_per_func = rewards_per_func.masked_fill(infinite, torch.nan)
    return torch.where(overflowing.unsqueeze(1), torch.full_like(rewards_per_func, torch.nan), rewards_per_func)


def total_rewards(rewards_per_func: torch.Tensor, reward_weights: torch.Tensor) -> torch.Tensor:
    """(N,) weighted total of (N, F) rewards per function, NaN where every function returned None (TRL's NaN)."""
    totals = (rewards_per_func * reward_weights.to(rewards_per_func.device)).nansum(dim=1)
    return totals.masked_fill(torch.isnan(rewards_per_func).all(dim=1), torch.nan)


def unscorable_if_infinite_totals(
    rewards: torch.Tensor, worker_advantages: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) total rewards with infinite ones NaN (unscored), and the rollout worker's advantages with non-finite
    ones (the z-score of a group that held an infinite reward) 0: the rollout worker hands over only totals."""
    infinite = torch.isinf(rewards)
    broken = ~torch.isfinite(worker_advantages) & ~infinite & ~torch.isnan(rewards)
    if not (infinite.any() or broken.any()):
        return rewards, worker_advantages
    logger.warning(
        f"{int(infinite.sum())} infinite total reward(s) in this step are treated as None (those samples unscored), "
        f"and {int(broken.sum())} non-finite worker advantage(s) of their groups as 0."
    )
    rewards = rewards.masked_fill(infinite, float("nan"))
    return rewards, torch.where(torch.isfinite(worker_advantages), worker_advantages, 0.0)


def normalize_advantages(
    centered: torch.Tensor, token_counts: torch.Tensor, scorable: torch.Tensor, normalization: str
) -> torch.Tensor:
    """`batch` or `token` normalization of the centered advantages over the scorable samples; the others take no
    part in the statistics and stay 0. (`group` is the group z-score, which TRL or its rollout worker computes.)"""
    normalized = torch.zeros_like(centered)
    if not bool(scorable.any()):
        return normalized
    if normalization == "batch":
        normalized[scorable] = batch_normalize(centered[scorable])
    elif normalization == "token":
        normalized[scorable] = token_measure_normalize(centered[scorable], token_counts[scorable].to(centered.dtype))
    else:
        raise ValueError(f"advantage_normalization={normalization!r}: only 'batch' and 'token' are computed here.")
    return normalized


def tool_shaping_bias(
    advantages: torch.Tensor,
    scores: torch.Tensor,
    positions: torch.Tensor,
    lengths: torch.Tensor,
    group_ids: torch.Tensor,
    args,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tool-position bias (B,) and the eligible mask (B,) of one batch.

    Eligible: correct (`scores >= tool_shaping_correct_threshold`; NaN is never correct) with a first tool call
    inside the completion (`0 <= position < length`). Groups are `group_ids` with several completions per prompt
    and the whole batch with one (`num_generations == 1`), as docs/design.md section 2 specifies."""
    eligible = is_correct(scores.nan_to_num(float("-inf")), args.tool_shaping_correct_threshold).to(positions.device)
    eligible = eligible & (positions >= 0) & (positions < lengths)
    groups = group_ids.long() if args.num_generations > 1 else torch.zeros_like(group_ids, dtype=torch.long)
    bias = tool_position_bias(
        advantages,
        positions.long(),
        lengths.long(),
        eligible,
        groups.to(advantages.device),
        delta=args.tool_shaping_delta,
        k=args.tool_shaping_k,
    )
    return bias, eligible


def make_shaping_hooks(args) -> list[ShapingHook]:
    """The optional shaping extras added after the tool-position bias: `tool_shaping_interactive_bonus` and the
    `tool_shaping_penalty` function (a dotted import path)."""
    hooks: list[ShapingHook] = []
    if args.tool_shaping_interactive_bonus > 0:
        hooks.append(InteractiveTurnBonus(bonus=args.tool_shaping_interactive_bonus))
    if args.tool_shaping_penalty is not None:
        module_name, _, attribute = args.tool_shaping_penalty.rpartition(".")
        try:
            penalty = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError, ValueError) as error:
            raise ValueError(
                f"{field_name(args, 'tool_shaping_penalty')}={args.tool_shaping_penalty!r} could not be imported: "
                f"{error}"
            ) from None
        hooks.append(CallablePenalty(penalty))
    return hooks


def warn_if_tool_shaping_runs_no_tools(args, tool_sources: str, has_tool_source: bool) -> None:
    """Warn (UserWarning) when `tool_shaping` is on but nothing executes tools and `tool_call_pattern` is unset:
    shaping then only acts on completions whose text happens to contain `tool_call_opener`. `tool_sources` names the
    trainer arguments that would execute tools; `has_tool_source` says whether any of them was given."""
    if not args.tool_shaping or has_tool_source or args.tool_call_pattern is not None:
        return
    warnings.warn(
        f"{field_name(args, 'tool_shaping')}=True, but the trainer has no {tool_sources} and "
        f"{field_name(args, 'tool_call_pattern')} is None: shaping only acts on completions whose text contains "
        f"tool_call_opener={args.tool_call_opener!r}, which nothing executes. Pass tools= or set tool_call_pattern.",
        UserWarning,
        stacklevel=3,
    )


def check_correct_reward_name(args, reward_names: list[str], scored_by: str) -> None:
    """`tool_shaping_correct_reward` must name one of the reward functions (`scored_by` says whose: the trainer's,
    or the ones the rollout worker scores with)."""
    name = args.tool_shaping_correct_reward
    if name is not None and name not in reward_names:
        raise ValueError(
            f"{field_name(args, 'tool_shaping_correct_reward')}={name!r} names no reward function; {scored_by} "
            f"{reward_names}."
        )


@dataclass
class AdvantageBatch:
    """One batch as a trainer hands it to `AdvantagePipeline.score`: every tensor (N,) over the whole batch.

    `centered`: R - baseline (any value where not `scorable`). `token_counts`: action tokens per completion (the
    token measure of normalization, `L_i` of shaping). `group_ids`: completions of one prompt in one round share an
    id. `rewards`: the total reward (NaN: unscorable). `group_advantages`: the group z-score TRL or its rollout worker
    computed, which `advantage_normalization='group'` keeps. `tool_stats`: (N, 4) positions, lengths, calls and
    interactive turns (trl_aspo.algorithms.tool_metrics), needed with `tool_shaping`. `correctness`: the rewards
    shaping compares with `tool_shaping_correct_threshold` (the total reward when None). `texts`: the decoded
    completions, asked for only when a shaping extra reads them. `reward_columns`: per-function rewards, named for
    the message of a non-finite advantage. `in_batch`: False for the rows that are members of the batch's groups
    outside it (the asynchronous trainer's neighbouring optimizer steps): they take part in shaping's group means
    only, get advantage 0 and count in no metric; None: every row is the batch's."""

    centered: torch.Tensor
    scorable: torch.Tensor
    token_counts: torch.Tensor
    group_ids: torch.Tensor
    rewards: torch.Tensor
    group_advantages: torch.Tensor | None = None
    tool_stats: torch.Tensor | None = None
    correctness: torch.Tensor | None = None
    texts: Callable[[], list[str]] | None = None
    reward_columns: dict[str, torch.Tensor] = field(default_factory=dict)
    in_batch: torch.Tensor | None = None

    @property
    def counted(self) -> torch.Tensor:
        """(N,) bool: the samples every statistic is over, the batch's own scorable ones."""
        return self.scorable if self.in_batch is None else self.scorable & self.in_batch


@dataclass
class ScoredAdvantages:
    """What `AdvantagePipeline.score` returns: the final advantages (N,) and the batch's metrics."""

    advantages: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


class AdvantagePipeline:
    """Normalization, tool shaping, the finite check and their metrics, configured once from the trainer's config."""

    def __init__(self, args) -> None:
        self.args = args
        self.shaping_hooks = make_shaping_hooks(args)

    def score(self, batch: AdvantageBatch) -> ScoredAdvantages:
        args, counted = self.args, batch.counted
        centered = torch.where(counted, batch.centered, torch.zeros_like(batch.centered))
        if args.advantage_normalization == "group":
            advantages = batch.group_advantages
        else:
            advantages = normalize_advantages(centered, batch.token_counts, counted, args.advantage_normalization)
        # Without policy-gradient signal from the reward: zero advantage after baseline and normalization.
        unsignaled = torch.where(counted, advantages, torch.zeros_like(advantages))
        metrics: dict[str, float] = {}
        if args.tool_shaping:
            advantages, shaping_metrics = self.shape(advantages, batch)
            metrics.update(shaping_metrics)
        advantages = torch.where(counted, advantages, torch.zeros_like(advantages))
        check_finite_advantages(advantages, advantage_sources(args, {"reward": batch.rewards, **batch.reward_columns}))
        metrics.update(advantage_quantiles(unsignaled[counted]))
        if bool(counted.any()):
            signals = unsignaled[counted]
            metrics["zero_advantage_share"] = (
                torch.isclose(signals, torch.zeros_like(signals), atol=1e-6).float().mean().item()
            )
        return ScoredAdvantages(advantages=advantages, metrics=metrics)

    def shape(self, advantages: torch.Tensor, batch: AdvantageBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Shaped advantages of every row (group means over every row of `batch`, members outside it included) and
        the shaping metrics over its counted rows."""
        if batch.tool_stats is None:
            raise ValueError("tool_shaping needs the position of each completion's first tool call (tool_stats).")
        positions, lengths, calls, turns = batch.tool_stats.unbind(dim=1)
        scores = batch.rewards if batch.correctness is None else batch.correctness
        bias, eligible = tool_shaping_bias(advantages, scores, positions, lengths, batch.group_ids, self.args)
        if self.shaping_hooks:
            texts = batch.texts() if batch.texts is not None else []
            for hook in self.shaping_hooks:
                bias = bias + hook(texts, positions, lengths, calls, turns, advantages).to(bias)
        counted = batch.counted
        stats = shaping_stats(bias[counted], eligible[counted.to(eligible.device)])
        return advantages + bias, {f"shaping/{name}": value for name, value in stats.items()}


def advantage_quantiles(advantages: torch.Tensor) -> dict[str, float]:
    """`advantage/p10` ... `advantage/p90` of the scorable completions' advantages after normalization, before tool
    shaping (the reference's `spo/adv_after_norm/p*`); none for an empty batch."""
    if not advantages.numel():
        return {}
    levels = torch.tensor([q / 100 for q in ADVANTAGE_QUANTILES], dtype=torch.float64, device=advantages.device)
    values = torch.quantile(advantages.double(), levels).tolist()
    return {f"advantage/p{q}": value for q, value in zip(ADVANTAGE_QUANTILES, values, strict=True)}


class StepScorer:
    """The asynchronous trainer's baseline in front of `AdvantagePipeline`: `R - v(x, z)` at each sample's version `z`
    for a tracker estimator (the tracker is held for the trainer's whole life), the registered group estimator on
    each group's raw rewards, or the rollout worker's group z-score where `advantage_normalization='group'` keeps
    TRL's own advantage."""

    def __init__(self, args, tracker=None) -> None:
        """`tracker`: the asynchronous tracker of a tracker estimator (its trainer's value tracking holds it)."""
        self.args = args
        self.estimator = get_advantage_estimator(args.advantage_estimator)
        self.pipeline = AdvantagePipeline(args)
        if self.estimator.tracks_values and tracker is None:
            raise ValueError(f"advantage_estimator={args.advantage_estimator!r}: StepScorer needs its value tracker.")
        self.tracker = tracker
        # `R - v` of the last batch's conversations, for rows of one forked conversation split across two batches.
        self._previous_conversations: dict[object, float] = {}

    def group_baseline(
        self, rewards: torch.Tensor, group_ids: torch.Tensor, conversations: list[object] | None = None
    ) -> torch.Tensor:
        """The group estimator's advantages (B,) of raw rewards, 0 where unscorable, with one entry per conversation:
        TRL's worker forks a conversation whose re-tokenization drifts into rows sharing its reward, which counts once
        in the group's statistics (as in the worker's own z-score); each of its rows gets the conversation's value.
        `conversations`: one hashable id per row (None: each row its own)."""
        conversations = list(range(len(rewards))) if conversations is None else conversations
        first_rows: dict[object, int] = {}
        for row, conversation in enumerate(conversations):
            first_rows.setdefault(conversation, row)
        slot = {conversation: index for index, conversation in enumerate(first_rows)}
        firsts = torch.tensor(list(first_rows.values()), dtype=torch.long)
        per_conversation = self.estimator(rewards[firsts], group_ids[firsts].long(), ~torch.isnan(rewards[firsts]))
        return per_conversation[torch.tensor([slot[conversation] for conversation in conversations], dtype=torch.long)]

    def tracker_baseline(
        self,
        keys: list[str],
        rewards: torch.Tensor,
        versions: list[int],
        conversations: list[object] | None = None,
        entry_versions: list[int] | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """`A = R - v` before normalization (float64 (B,), 0 where the reward is NaN), then observe the outcomes.

        `entry_versions`: spo++ only, per sample the model version its prompt's prior is anchored at (the prompt's
        first dispatch, which the rollout worker records); None anchors at the earliest version scored, which
        depends on the order in which samples arrive.

        `conversations`: one hashable id per sample naming the rollout it comes from. TRL's worker splits a multi-turn
        conversation whose re-tokenization drifts into several rows (forks) that share one reward; the tracker must
        see that outcome once, and no row may see it. Later rows of an already observed conversation (in this batch
        or the previous one) take the first row's `R - v`."""
        scorable = ~torch.isnan(rewards)
        metrics: dict[str, float] = {}
        outcomes = tracker_rewards(rewards.double(), self.args)
        conversations = [object() for _ in keys] if conversations is None else conversations  # each row its own
        centered = torch.zeros_like(outcomes)
        first_rows: dict[object, int] = {}
        repeats: list[tuple[int, object]] = []
        for i in range(len(keys)):
            if not bool(scorable[i]):
                continue
            if conversations[i] in first_rows or conversations[i] in self._previous_conversations:
                repeats.append((i, conversations[i]))
            else:
                first_rows[conversations[i]] = i
        index = list(first_rows.values())
        scored_keys = [keys[i] for i in index]
        values = torch.full_like(outcomes, float("nan"))
        if isinstance(self.tracker, AsyncEventValues):
            scored_versions = [versions[i] for i in index]
            entries = versions if entry_versions is None else entry_versions
            self.tracker.enter(scored_keys, [entries[i] for i in index])
            values[index] = self.tracker.value(scored_keys, scored_versions)
            self.tracker.observe(scored_keys, outcomes[index], scored_versions)
        else:
            for i in index:  # per visit, in arrival order
                values[i] = self.tracker.value([keys[i]])[0]
                self.tracker.observe([keys[i]], outcomes[i : i + 1], self.args.value_rho)
        centered[index] = outcomes[index] - values[index]
        observed = {conversation: centered[i].item() for conversation, i in first_rows.items()}
        for i, conversation in repeats:
            centered[i] = (
                observed[conversation] if conversation in observed else self._previous_conversations[conversation]
            )
        self._previous_conversations = observed
        if index:
            metrics["value/mean"] = values[index].mean().item()
        metrics["value/tracked_prompts"] = float(self.tracker.num_tracked)
        return centered, metrics

    def score(
        self,
        keys: list[str] | None,
        rewards: torch.Tensor,
        versions: list[int],
        token_counts: torch.Tensor,
        group_ids: torch.Tensor,
        worker_advantages: torch.Tensor,
        tool_stats: torch.Tensor | None = None,
        conversations: list[object] | None = None,
        correctness_scores: torch.Tensor | None = None,
        texts: Callable[[], list[str]] | None = None,
        entry_versions: list[int] | None = None,
        tool_positions: torch.Tensor | None = None,
        in_step: torch.Tensor | None = None,
    ) -> ScoredAdvantages:
        """Baseline, then `AdvantagePipeline.score`, of one optimizer step (all tensors (B,), in arrival order);
        returns the advantages of the step's rows.

        `keys`: the samples' tracker keys (None without a tracker). `in_step` (B,) bool: False for the rows that are
        members of the step's groups outside it (a group the step holds only part of, with its members of the
        previous step or read ahead): they enter the group statistics (the group estimator's baseline, shaping's
        means), never the tracker, the normalization or a metric.
        `tool_stats`: (B, 4) from trl_aspo.algorithms.tool_metrics, needed with `tool_shaping` (or only
        `tool_positions`, the first calls' positions, when no shaping extra reads calls or turns). `conversations`,
        `entry_versions`: see `tracker_baseline`. `correctness_scores`, `texts`: see `AdvantageBatch`.

        An infinite total reward leaves its sample unscored (as `ASPOTrainer` treats it: TRL's None), and a
        non-finite worker advantage (the z-score of a group that held one) becomes 0, with a warning, so one bad
        reward cannot turn the step's statistics into NaN."""
        rewards, worker_advantages = unscorable_if_infinite_totals(rewards.double(), worker_advantages)
        scorable = ~torch.isnan(rewards)
        in_step = torch.ones_like(scorable) if in_step is None else in_step.bool()
        metrics: dict[str, float] = {}
        if self.tracker is not None:
            rows = in_step.nonzero().flatten().tolist()
            centered = torch.zeros_like(rewards)
            centered[in_step], metrics = self.tracker_baseline(
                [keys[i] for i in rows],
                rewards[in_step],
                [versions[i] for i in rows],
                None if conversations is None else [conversations[i] for i in rows],
                None if entry_versions is None else [entry_versions[i] for i in rows],
            )
        elif self.args.advantage_normalization == "group":
            # TRL's own advantage (the group estimator, normalized by the rollout worker): kept as it is.
            centered = torch.where(scorable, worker_advantages.double(), torch.zeros_like(rewards))
        else:
            centered = self.group_baseline(rewards, group_ids, conversations)
        if tool_stats is None and tool_positions is not None:
            unknown = torch.zeros_like(tool_positions)
            tool_stats = torch.stack([tool_positions, token_counts.to(tool_positions), unknown, unknown], dim=1)
        scored = self.pipeline.score(
            AdvantageBatch(
                centered=centered,
                scorable=scorable,
                token_counts=token_counts,
                group_ids=group_ids,
                rewards=rewards,
                group_advantages=centered,
                tool_stats=tool_stats,
                correctness=correctness_scores,
                texts=texts,
                in_batch=in_step,
            )
        )
        scored.advantages = scored.advantages[in_step]
        scored.metrics.update(metrics)
        return scored
