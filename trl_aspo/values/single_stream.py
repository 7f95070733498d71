"""Single-stream scoring: the one home of the glue between config, value tracker, normalization, tool shaping and
checkpointed state (DESIGN.md sections 2-4), used by both `ASPOTrainer` and `AsyncASPOTrainer`. Each step of the
data flow is one function here; the trainers only gather their samples and call them:

1. tracker lifecycle: `make_value_tracker` (spo: `VisitValueTracker`; spo++: `EventValueTracker` synchronously,
   `AsyncEventValues` asynchronously), `init_values_from_file`, the prompt keys (`dataset_prompt_keys`,
   `prompt_ids_by_content`);
2. rewards for the tracker: the total reward, mapped by `value_reward_range` onto [0, 1] (`tracker_rewards`);
3. baseline: `A = R - v`, with `v` read before any outcome of the batch is observed (each trainer reads it at its
   own policy event: the generation round, or the sample's model version);
4. normalization over the batch (`normalize_advantages`: `batch` or `token`, trl_aspo.algorithms.normalize);
5. tool-position shaping (`tool_shaping_bias`, trl_aspo.algorithms.shaping) by prompt group, or over the batch with one
   completion per prompt, and its optional extras (`make_shaping_hooks`);
6. checkpointed state: which settings a resume may change (`resume_settings`, `check_resume_settings`), resuming
   without state (`require_state_or_reset`) and restoring the tracker (`restore_tracker`).

`StepScorer` runs steps 2-5 on one asynchronous optimizer step. Samples without a reward (every reward function
abstained: NaN) get advantage 0 and are not observed.

SPO (per-visit forgetting) applies its updates in arrival order, one outcome at a time: with asynchronous rollouts
the state it reaches depends on the order in which samples arrive, by construction. SPO++ depends only on the set
of outcomes visible to each sample (trl_aspo.values.event_values).
"""

from __future__ import annotations

import importlib
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from trl_aspo.algorithms.losses import progressive_flip_threshold
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
from trl_aspo.values.prompt_ids import column_prompt_keys, prompt_key, prompt_match_key
from trl_aspo.values.tracker import EventValueTracker, VisitValueTracker
from trl_aspo.values.value_init import read_init_records

logger = logging.getLogger(__name__)

# Float32 rounding of a weighted reward sum (weights summing to 1, full credit: 1.0000001) is not a range violation.
_UNIT_RANGE_TOLERANCE = 1e-6

ValueTracker = EventValueTracker | AsyncEventValues | VisitValueTracker

# Settings a resume compares with the checkpoint's. Refused when changed (why), unless marked resettable and
# `value_reset_on_resume` is set; the others are applied with a logged warning.
RESUME_FIELDS = (
    "advantage_estimator",
    "prompt_id_column",
    "seed",
    "value_rho",
    "value_rho_mode",
    "value_reward_range",
    "advantage_normalization",
    "prioritized_sampling",
)
RESUME_REFUSED = {
    "advantage_estimator": "the saved value tracker belongs to that estimator",
    "prompt_id_column": "the saved tracker's prompt keys come from it",
    "seed": "the saved random states and sampler order come from it",
}
RESUME_RESET = {"advantage_estimator", "prompt_id_column"}


def _field(args, name: str) -> str:
    """A field as the user's config class names it (`ASPOConfig.value_rho`, `AsyncASPOConfig.value_rho`)."""
    return f"{type(args).__name__}.{name}"


# ---------------------------------------------------------------- 1. tracker lifecycle
def make_value_tracker(args, asynchronous: bool = False) -> ValueTracker | None:
    """The tracker `args.advantage_estimator` asks for (None for the group baseline). The policy event of spo++ is
    the generation round synchronously (`EventValueTracker`) and the sample's model version asynchronously
    (`AsyncEventValues`, order-invariant)."""
    if args.advantage_estimator == "spo++":
        return AsyncEventValues(rho=args.value_rho) if asynchronous else EventValueTracker(rho=args.value_rho)
    if args.advantage_estimator == "spo":
        return VisitValueTracker()
    return None


def dataset_prompt_keys(dataset, args) -> list[str]:
    """The tracker key of every row: `prompt_id_column`'s value when set, else a hash of the prompt."""
    column = args.prompt_id_column
    if column is not None:
        if column not in dataset.column_names:
            raise ValueError(
                f"{_field(args, 'prompt_id_column')}={column!r} is not a dataset column; columns: "
                f"{dataset.column_names}."
            )
        return column_prompt_keys(dataset[column], column)
    return [prompt_key(prompt) for prompt in dataset["prompt"]]


def prompt_ids_by_content(dataset, args) -> dict[str, str]:
    """`prompt_id_column`'s key of each training prompt, by the prompt's content hash: for samples that carry their
    prompt but not their dataset row (the asynchronous rollout worker's). Needs a map-style dataset; a prompt that
    appears under two different ids is refused (its samples could not be told apart)."""
    column = args.prompt_id_column
    if not _enumerable(dataset):
        raise ValueError(
            f"{_field(args, 'prompt_id_column')}={column!r} needs a map-style `datasets.Dataset`: samples carry their "
            "prompt, which is looked up among the dataset's rows to find its id."
        )
    ids: dict[str, str] = {}
    for content, prompt_id in zip(map(prompt_key, dataset["prompt"]), dataset_prompt_keys(dataset, args), strict=True):
        if ids.setdefault(content, prompt_id) != prompt_id:
            raise ValueError(
                f"{_field(args, 'prompt_id_column')}={column!r}: one prompt appears under the ids {ids[content]!r} "
                f"and {prompt_id!r}; samples of it could not be told apart. Give equal prompts one id."
            )
    return ids


def _enumerable(dataset) -> bool:
    from datasets import IterableDataset

    return dataset is not None and not isinstance(dataset, IterableDataset) and hasattr(dataset, "column_names")


def init_values_from_file(tracker: ValueTracker, args, dataset=None) -> None:
    """Set priors from `args.value_init_file` (anchored at the start of training) and say how many records name a
    training prompt of `dataset` (a map-style dataset; an iterable one cannot be enumerated, so no report). A file
    none of whose records names a training prompt is refused."""
    path = args.value_init_file
    by_match = None
    if _enumerable(dataset) and args.prompt_id_column is None:
        by_match = {prompt_match_key(prompt): prompt_key(prompt) for prompt in dataset["prompt"]}
    records = read_init_records(path, args.prompt_id_column, by_match)
    try:
        if records.count_keys:
            tracker.init_from_counts(
                records.count_keys, records.successes, records.trials, prior_strength=args.value_prior_strength
            )
        if records.pseudo_keys:
            tracker.set_pseudo_counts(records.pseudo_keys, records.alphas, records.betas)
    except ValueError as error:
        raise ValueError(f"{_field(args, 'value_init_file')}={path!r}: {error}") from None
    if _enumerable(dataset):
        keys = records.count_keys + records.pseudo_keys
        _report_init_matches(args, keys, set(dataset_prompt_keys(dataset, args)))


def _report_init_matches(args, keys: list[str], dataset_keys: set[str]) -> None:
    path = args.value_init_file
    matched = sum(key in dataset_keys for key in keys)
    column = args.prompt_id_column
    if column is None:
        how = "records name prompts by 'prompt' (the exact dataset prompt: chat messages for a chat dataset)"
    else:
        how = f"records name prompts by 'prompt_id', matched against prompt_id_column={column!r}"
    if matched == 0:
        raise ValueError(
            f"{_field(args, 'value_init_file')}={path!r}: none of its {len(keys)} records matches a training "
            f"prompt; {how}."
        )
    message = f"{_field(args, 'value_init_file')}={path!r}: {matched} of {len(keys)} records match a training prompt"
    if matched < len(keys):
        logger.warning(f"{message}; the other {len(keys) - matched} are ignored ({how}).")
    else:
        logger.info(f"{message}.")


# ---------------------------------------------------------------- 2. rewards for the tracker
def tracker_rewards(rewards: torch.Tensor, args) -> torch.Tensor:
    """Total rewards as the tracker learns them: mapped by `value_reward_range` onto [0, 1], NaN kept; rewards a
    hair outside [0, 1] (float round-off) are clamped, others refused."""
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
                f"{_field(args, 'value_reward_range')}={list(args.value_reward_range)} onto [0, 1] a reward is "
                f"{bad}: the rewards leave the declared range."
            )
        raise ValueError(
            f"advantage_estimator={args.advantage_estimator!r} needs total rewards in [0, 1]; got {bad}. Set "
            f"{_field(args, 'value_reward_range')}=[lo, hi] to map a known reward range onto [0, 1]."
        )
    return rewards.clamp(0.0, 1.0)


# ---------------------------------------------------------------- 4. normalization
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


# ---------------------------------------------------------------- 5. tool-position shaping
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
    and the whole batch with one (`num_generations == 1`), as DESIGN.md section 2 specifies."""
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
                f"{_field(args, 'tool_shaping_penalty')}={args.tool_shaping_penalty!r} could not be imported: {error}"
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
        f"{_field(args, 'tool_shaping')}=True, but the trainer has no {tool_sources} and "
        f"{_field(args, 'tool_call_pattern')} is None: shaping only acts on completions whose text contains "
        f"tool_call_opener={args.tool_call_opener!r}, which nothing executes. Pass tools= or set tool_call_pattern.",
        UserWarning,
        stacklevel=3,
    )


def aspo_loss_options(args, step: int) -> dict:
    """The `asymmetric_policy_loss` options the config sets at optimizer step `step` (the dual-clip constants, the
    high-entropy offsets and the progressive flip threshold); the caller adds the clip range and the masks."""
    return {
        "dual_clip": args.aspo_dual_clip,
        "dual_clip_pos": args.aspo_dual_clip_pos,
        "dual_clip_neg": args.aspo_dual_clip_neg,
        "epsilon_low_high_entropy": args.aspo_epsilon_high_entropy,
        "epsilon_high_high_entropy": args.aspo_epsilon_high_entropy,
        "flip_threshold": progressive_flip_threshold(step, args.aspo_flip_threshold_start, args.aspo_flip_decay_steps),
    }


# ---------------------------------------------------------------- 6. checkpointed state
def resume_settings(args, train_rows: int | None) -> dict:
    """The settings a resumed run is compared with (README, "Resuming")."""
    settings = {name: getattr(args, name) for name in RESUME_FIELDS}
    if settings["value_reward_range"] is not None:
        settings["value_reward_range"] = list(settings["value_reward_range"])
    settings["train_rows"] = train_rows
    return settings


def check_resume_settings(args, saved: dict | None, current: dict, path: str, has_tracker: bool) -> bool:
    """Compare the checkpoint's settings with this run's (README, "Resuming"); returns whether the tracker starts
    fresh. Settings that change what the saved state means are refused, the others applied with a warning. A legacy
    state without recorded settings is only checked for the tracker's presence."""
    reset = args.value_reset_on_resume
    changed = {}
    if saved is not None:
        changed = {name: (saved.get(name), value) for name, value in current.items() if saved.get(name) != value}
    for name in RESUME_REFUSED:
        if name in changed and not (reset and name in RESUME_RESET):
            before, after = changed[name]
            allowed = f" or set {_field(args, 'value_reset_on_resume')}=True" if name in RESUME_RESET else ""
            raise ValueError(
                f"Resuming from {path} with {name}={after!r}, but the checkpoint was trained with {name}={before!r}: "
                f"{RESUME_REFUSED[name]}. Use {name}={before!r}{allowed}."
            )
    if "train_rows" in changed and args.prioritized_sampling:
        before, after = changed["train_rows"]
        raise ValueError(
            f"Resuming from {path} with a training dataset of {after} rows, but the checkpoint was trained on "
            f"{before} rows: the prioritized sampler's weights and order are per row; use the same dataset."
        )
    for name, (before, after) in changed.items():
        if name not in RESUME_REFUSED:
            logger.warning(f"Resuming from {path}: {name} changes from {before!r} to {after!r}; the new value applies")
    tracked = args.advantage_estimator in ("spo", "spo++")
    fresh = tracked and (not has_tracker or "advantage_estimator" in changed)
    if fresh and not reset:
        raise ValueError(
            f"{path} holds no value tracker for advantage_estimator={args.advantage_estimator!r}. Resume with the "
            f"checkpoint's estimator, or set {_field(args, 'value_reset_on_resume')}=True to start a fresh tracker "
            "on purpose."
        )
    if reset and (fresh or changed.keys() & RESUME_RESET):
        logger.warning(f"Resuming from {path}: value_reset_on_resume=True, the checkpoint's value tracker is not used")
        return True
    return fresh


def require_state_or_reset(args, checkpoint: str, state_name: str) -> None:
    """A checkpoint without trl-aspo state: refused under a value tracker unless `value_reset_on_resume` says to
    start a fresh one on purpose."""
    if args.advantage_estimator not in ("spo", "spo++"):
        return
    if not args.value_reset_on_resume:
        raise ValueError(
            f"{checkpoint} holds no trl-aspo state ({state_name}): it was written by an interrupted save, by another "
            f"trainer, or with save_only_model, so the value tracker of advantage_estimator="
            f"{args.advantage_estimator!r} cannot be restored. Resume from an earlier checkpoint, or set "
            f"{_field(args, 'value_reset_on_resume')}=True to start a fresh tracker on purpose."
        )
    logger.warning(
        f"Resuming from {checkpoint} without trl-aspo state: value_reset_on_resume=True starts a fresh value tracker "
        "(value_init_file applies; no pre-pass)."
    )


def restore_tracker(tracker: ValueTracker, state: dict, path: str, args) -> None:
    """Load the checkpoint's tracker, naming the file when it does not fit; a changed `value_rho` applies from the
    resume on (SPO++; SPO reads rho at each update)."""
    try:
        tracker.load_state_dict(state["tracker"])
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ValueError(
            f"checkpoint state {path} holds a value tracker that advantage_estimator={args.advantage_estimator!r} "
            f"cannot resume: {type(error).__name__}: {error}"
        ) from None
    if isinstance(tracker, EventValueTracker | AsyncEventValues):
        tracker.rho = args.value_rho


def _unscorable_if_infinite(
    rewards: torch.Tensor, worker_advantages: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
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


@dataclass
class ScoredBatch:
    """What `StepScorer.score` returns: final advantages (B,) float64 and the metrics of the batch."""

    advantages: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


class StepScorer:
    """Scores the batches of one asynchronous trainer (steps 2-5): holds the value tracker for its whole life."""

    def __init__(self, args, train_dataset=None) -> None:
        self.args = args
        self.tracker = make_value_tracker(args, asynchronous=True)
        if self.tracker is not None and args.value_init_file is not None:
            init_values_from_file(self.tracker, args, train_dataset)
        # `R - v` of the last batch's conversations, for rows of one forked conversation split across two batches.
        self._previous_conversations: dict[object, float] = {}

    def baseline(
        self,
        keys: list[str],
        rewards: torch.Tensor,
        versions: list[int],
        worker_advantages: torch.Tensor,
        worker_reward_std: torch.Tensor,
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
        if self.tracker is None:
            advantages = worker_advantages.double()
            if self.args.advantage_normalization != "group":
                # The worker's z-score is (R - mean) / (std + 1e-8) with the group's population std: undo the scale.
                advantages = advantages * (worker_reward_std.double().nan_to_num(0.0) + 1e-8)
            return torch.where(scorable, advantages, torch.zeros_like(advantages)), metrics
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
        keys: list[str],
        rewards: torch.Tensor,
        versions: list[int],
        token_counts: torch.Tensor,
        group_ids: torch.Tensor,
        worker_advantages: torch.Tensor,
        worker_reward_std: torch.Tensor,
        tool_positions: torch.Tensor | None = None,
        conversations: list[object] | None = None,
        correctness_scores: torch.Tensor | None = None,
        shaping_extras: Callable[[torch.Tensor], torch.Tensor] | None = None,
        entry_versions: list[int] | None = None,
    ) -> ScoredBatch:
        """Baseline, normalization and shaping of one batch (all tensors (B,), in arrival order).

        `tool_positions`: action tokens before each sample's first tool call (-1 for none); needed with
        `tool_shaping`. `conversations`, `entry_versions`: see `baseline`. `correctness_scores`: what shaping
        compares with `tool_shaping_correct_threshold` (the `tool_shaping_correct_reward` function's rewards); the
        total reward when None. `shaping_extras`: the optional extras' bias (B,) as a function of the advantages
        before shaping (see `make_shaping_hooks`).

        An infinite total reward leaves its sample unscored (as `ASPOTrainer` treats it: TRL's None), and a
        non-finite worker advantage (the z-score of a group that held one) becomes 0, with a warning, so one bad
        reward cannot turn the step's statistics into NaN."""
        rewards, worker_advantages = _unscorable_if_infinite(rewards, worker_advantages)
        advantages, metrics = self.baseline(
            keys, rewards, versions, worker_advantages, worker_reward_std, conversations, entry_versions
        )
        scorable = ~torch.isnan(rewards)
        if self.args.advantage_normalization != "group":
            advantages = normalize_advantages(advantages, token_counts, scorable, self.args.advantage_normalization)
        if self.args.tool_shaping:
            if tool_positions is None:
                raise ValueError("tool_shaping needs the position of each sample's first tool call.")
            scores = rewards if correctness_scores is None else correctness_scores
            bias, eligible = tool_shaping_bias(advantages, scores, tool_positions, token_counts, group_ids, self.args)
            if shaping_extras is not None:
                bias = bias + shaping_extras(advantages)
            advantages = advantages + bias
            metrics.update({f"shaping/{name}": value for name, value in shaping_stats(bias, eligible).items()})
        metrics["zero_advantage_share"] = (
            torch.isclose(advantages, torch.zeros_like(advantages), atol=1e-6).double().mean().item()
        )
        return ScoredBatch(advantages=advantages, metrics=metrics)
