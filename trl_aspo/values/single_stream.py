"""The value tracker's lifecycle, the same in both trainers (SPO, arXiv 2509.13232; SPO++, arXiv 2608.24870):

- the trackers themselves come from the estimator's registration (trl_aspo.values.tracker_estimators): spo:
  `VisitValueTracker`; spo++: `EventValueTracker` synchronously (event = generation round), `AsyncEventValues`
  asynchronously (event = the sample's model version, order-invariant);
- prompt identity: `dataset_prompt_keys`, `prompt_ids_by_content`;
- priors: `init_values_from_file`, and `init_values_from_samples` for the value pre-pass of either trainer;
- what the tracker learns: the total reward mapped by `value_reward_range` onto [0, 1] (`tracker_rewards`);
- what prioritized sampling reads: `tracker_values` and `PromptRows` (scored prompts back to dataset rows).

SPO (per-visit forgetting) applies its updates in arrival order, one outcome at a time: with asynchronous rollouts
the state it reaches depends on the order in which samples arrive, by construction. SPO++ depends only on the set
of outcomes visible to each sample (trl_aspo.values.event_values).
"""

from __future__ import annotations

import logging
import math

import torch

from trl_aspo.values.event_tracker import EventValueTracker
from trl_aspo.values.event_values import AsyncEventValues
from trl_aspo.values.prompt_ids import column_prompt_keys, prompt_key, prompt_match_key
from trl_aspo.values.value_init import read_init_records
from trl_aspo.values.visit_tracker import VisitValueTracker

logger = logging.getLogger(__name__)

# Float32 rounding of a weighted reward sum (weights summing to 1, full credit: 1.0000001) is not a range violation.
_UNIT_RANGE_TOLERANCE = 1e-6

ValueTracker = EventValueTracker | AsyncEventValues | VisitValueTracker


def field_name(args, name: str) -> str:
    """A field as the user's config class names it (`ASPOConfig.value_rho`, `AsyncASPOConfig.value_rho`)."""
    return f"{type(args).__name__}.{name}"


# ---------------------------------------------------------------- 1. tracker lifecycle
def dataset_prompt_keys(dataset, args) -> list[str]:
    """The tracker key of every row: `prompt_id_column`'s value when set, else a hash of the prompt."""
    column = args.prompt_id_column
    if column is not None:
        if column not in dataset.column_names:
            raise ValueError(
                f"{field_name(args, 'prompt_id_column')}={column!r} is not a dataset column; columns: "
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
            f"{field_name(args, 'prompt_id_column')}={column!r} needs a map-style `datasets.Dataset`: samples carry "
            "their prompt, which is looked up among the dataset's rows to find its id."
        )
    ids: dict[str, str] = {}
    for content, prompt_id in zip(map(prompt_key, dataset["prompt"]), dataset_prompt_keys(dataset, args), strict=True):
        if ids.setdefault(content, prompt_id) != prompt_id:
            raise ValueError(
                f"{field_name(args, 'prompt_id_column')}={column!r}: one prompt appears under the ids "
                f"{ids[content]!r} and {prompt_id!r}; samples of it could not be told apart. Give equal prompts one "
                "id."
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
        raise ValueError(f"{field_name(args, 'value_init_file')}={path!r}: {error}") from None
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
            f"{field_name(args, 'value_init_file')}={path!r}: none of its {len(keys)} records matches a training "
            f"prompt; {how}."
        )
    message = (
        f"{field_name(args, 'value_init_file')}={path!r}: {matched} of {len(keys)} records match a training prompt"
    )
    if matched < len(keys):
        logger.warning(f"{message}; the other {len(keys) - matched} are ignored ({how}).")
    else:
        logger.info(f"{message}.")


# ---------------------------------------------------------------- 2. rewards for the tracker
# TRL adds the reward of an environment defining `get_reward` as one more reward source of weight 1 (both trainers).
_TOTAL_REWARD = (
    "The total is the weighted sum of the reward functions' rewards, plus the reward of an environment_factory's "
    "environment that defines get_reward (weight 1), which adds to the reward functions' total."
)


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
                f"{field_name(args, 'value_reward_range')}={list(args.value_reward_range)} onto [0, 1] a reward is "
                f"{bad}: the rewards leave the declared range. {_TOTAL_REWARD}"
            )
        raise ValueError(
            f"advantage_estimator={args.advantage_estimator!r} needs total rewards in [0, 1]; got {bad}. Set "
            f"{field_name(args, 'value_reward_range')}=[lo, hi] to map a known reward range onto [0, 1]. "
            f"{_TOTAL_REWARD}"
        )
    return rewards.clamp(0.0, 1.0)


def init_values_from_samples(
    tracker: ValueTracker, prompts: list[str], sample_keys: list[str], outcomes: list[float], args, event=None
) -> None:
    """Set the priors of the value pre-pass: each of `prompts` (in this order) from its samples, `sample_keys[i]`
    the prompt of sample `i` and `outcomes[i]` its reward as the tracker sees it (`tracker_rewards`; NaN: no
    function scored it). A prompt's successes are its summed outcomes (fractional rewards are fractional
    pseudo-counts) and its trials its scorable samples; a prompt without any keeps the default prior. spo++ anchors
    the priors at `event`."""
    successes = dict.fromkeys(prompts, 0.0)
    trials = dict.fromkeys(prompts, 0)
    for key, outcome in zip(sample_keys, outcomes, strict=True):
        if not math.isnan(outcome):
            successes[key] += outcome
            trials[key] += 1
    scored = [key for key in prompts if trials[key] > 0]
    counts = {"prior_strength": args.value_prior_strength}
    if event is not None:
        counts["event"] = event
    tracker.init_from_counts(scored, [successes[key] for key in scored], [trials[key] for key in scored], **counts)


def tracker_values(tracker: ValueTracker, keys: list[str], event: int) -> torch.Tensor:
    """Values of `keys` at policy event `event` (SPO's tracker has no events: its current values)."""
    return tracker.value(keys, event) if tracker.ages_by_event else tracker.value(keys)


class PromptRows:
    """The dataset rows behind tracker keys, so prioritized sampling refreshes only the rows whose prompt got an
    outcome (a value changes only then: see trl_aspo.values.sampler)."""

    def __init__(self, dataset_keys: list[str]) -> None:
        self.keys = dataset_keys
        self.rows_of_key: dict[str, list[int]] = {}
        for row, key in enumerate(dataset_keys):
            self.rows_of_key.setdefault(key, []).append(row)
        self._warned_unknown = False

    def rows(self, keys) -> list[int]:
        """Every row of `keys` (each key once); a key that names no row is said once per run (a rollout worker or an
        environment changed the prompt), since no row's weight can follow its value."""
        unique = list(dict.fromkeys(keys))
        unknown = [key for key in unique if key not in self.rows_of_key]
        if unknown and not self._warned_unknown:
            logger.warning(
                f"prioritized_sampling: {len(unknown)} scored prompt(s) match no train_dataset prompt (the worker "
                "changed them?), so no dataset row's weight follows their values."
            )
            self._warned_unknown = True
        return [row for key in unique for row in self.rows_of_key.get(key, ())]

    def values(self, tracker: ValueTracker, rows: list[int], event: int) -> torch.Tensor:
        """The tracker's values of `rows` at `event`."""
        return tracker_values(tracker, [self.keys[row] for row in rows], event)


def prepass_prompts(dataset, args, has_environments: bool) -> tuple[list[str], dict[str, int]]:
    """The value pre-pass's prompts (`value_init_samples`, either trainer): every row's tracker key and the first row
    of each distinct prompt, after refusing what a pre-pass cannot roll out (environments own the rollout state; an
    iterable dataset cannot be enumerated; images are not rolled out)."""
    name = field_name(args, "value_init_samples")
    if has_environments:
        raise ValueError(
            f"{name} does not support `environment_factory` (environments own the rollout state); initialize the "
            "tracker with value_init_file instead."
        )
    if not _enumerable(dataset):
        raise ValueError(f"{name} needs a map-style `datasets.Dataset` to enumerate prompts.")
    if {"image", "images"} & set(dataset.column_names):
        raise ValueError(f"{name} does not support image datasets; use value_init_file.")
    keys = dataset_prompt_keys(dataset, args)
    first_rows: dict[str, int] = {}
    for row, key in enumerate(keys):
        first_rows.setdefault(key, row)
    return keys, first_rows


def train_rows(dataset) -> int | None:
    """The rows of a map-style training dataset (what a resume compares), None for an iterable one."""
    return len(dataset) if _enumerable(dataset) else None
