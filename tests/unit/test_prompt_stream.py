"""The asynchronous worker's prompt stream (trl_aspo.infra.prompt_stream): the prioritized draw, attaching it to the
local worker, first-dispatch versions and conversation ids (the trainer runs:
tests/integration/test_prompt_stream_trainer.py)."""

from __future__ import annotations

import asyncio
import math
import pickle

import pytest
import torch
from helpers import MODEL, async_fields, calculator_tokenizer

from trl_aspo.builtin.task import correctness_reward, make_dataset
from trl_aspo.infra import LocalRolloutWorker
from trl_aspo.infra.prompt_stream import (
    PrioritizedLocalRolloutLoop,
    PrioritizedPromptLoop,
    PromptDispatches,
    PromptPriorities,
    TrackedLocalRolloutLoop,
    TrackedRolloutSample,
    attach_prompt_priorities,
    attach_rollout_tracking,
)
from trl_aspo.values.prompt_ids import prompt_key


@pytest.fixture(scope="module")
def tokenizer():
    return calculator_tokenizer()


# The draw


def test_weights_are_the_bernoulli_std_plus_the_floor():
    priorities = PromptPriorities(torch.tensor([1.0, 0.5, 0.0, 0.9]), epsilon=0.05)
    # sqrt(v (1 - v)) + 0.05: 0 + 0.05, 0.5 + 0.05, 0 + 0.05, 0.3 + 0.05
    torch.testing.assert_close(priorities.weights, torch.tensor([0.05, 0.55, 0.05, 0.35], dtype=torch.float64))
    priorities.update([3], torch.tensor([0.5]))
    assert priorities.weights.tolist() == pytest.approx([0.05, 0.55, 0.05, 0.55])
    # Kish: (0.05 + 0.55 + 0.05 + 0.55)^2 / (2 * 0.05^2 + 2 * 0.55^2) = 1.44 / 0.61
    assert priorities.effective_prompts() == pytest.approx(1.44 / 0.61)


def test_draw_frequencies_follow_the_weights():
    priorities = PromptPriorities(torch.tensor([1.0, 0.5, 0.5, 0.5]), seed=3)
    draws = 6000
    counts = torch.bincount(torch.tensor([priorities.draw(group) for group in range(draws)]), minlength=4)
    # Weights 0.05, 0.55, 0.55, 0.55 out of 1.7: p = 1/34 and 11/34.
    for row, p in enumerate([1 / 34, 11 / 34, 11 / 34, 11 / 34]):
        sd = math.sqrt(draws * p * (1 - p))
        assert abs(int(counts[row]) - draws * p) < 4 * sd, (row, int(counts[row]), draws * p)


def test_a_draw_depends_only_on_seed_group_and_weights():
    values = torch.linspace(0.0, 1.0, 9)
    first, second = PromptPriorities(values, seed=7), PromptPriorities(values, seed=7)
    drawn = [first.draw(group) for group in range(200)]
    assert drawn == [second.draw(group) for group in reversed(range(200))][::-1]  # any order of groups
    assert drawn != [PromptPriorities(values, seed=8).draw(group) for group in range(200)]
    second.update(list(range(9)), torch.full((9,), 0.5))
    assert drawn != [second.draw(group) for group in range(200)]
    second.update(list(range(9)), values)
    assert drawn == [second.draw(group) for group in range(200)]


def test_bad_priorities_input_is_refused():
    with pytest.raises(ValueError, match="`epsilon` must be > 0"):
        PromptPriorities(torch.tensor([0.5]), epsilon=0.0)
    with pytest.raises(ValueError, match="one value per dataset row"):
        PromptPriorities(torch.tensor([]))
    priorities = PromptPriorities(torch.tensor([0.5, 0.5]))
    with pytest.raises(ValueError, match=r"`rows` must lie in \[0, 2\)"):
        priorities.update([2], torch.tensor([0.5]))
    with pytest.raises(ValueError, match=r"must be finite and lie in \[0, 1\]"):
        priorities.update([0], torch.tensor([1.5]))
    with pytest.raises(ValueError, match="`group_index` must be a non-negative integer"):
        priorities.draw(-1)


# Attaching to workers


def test_attach_swaps_the_loop_of_the_local_worker_and_refuses_others(tmp_path, tokenizer):
    from trl.experimental.async_grpo import AsyncGRPOConfig

    dataset = make_dataset("train", 4, seed=0)
    priorities = PromptPriorities(torch.full((4,), 0.5))
    args = AsyncGRPOConfig(**async_fields(tmp_path, num_generations=2))
    local = LocalRolloutWorker(MODEL, tokenizer, dataset, correctness_reward, args)
    attach_prompt_priorities(local, priorities)
    assert local._loop_cls is PrioritizedLocalRolloutLoop
    assert pickle.loads(pickle.dumps(PrioritizedLocalRolloutLoop)) is PrioritizedLocalRolloutLoop  # by reference
    # A worker resumed at group 5 (TRL's dataset_start_index) draws groups 5, 6, ... under TRL's group ids 0, 1, ...
    local._loop_kwargs["dataset_start_index"] = 5
    loop = local._loop_cls(**local._loop_kwargs)
    stream = loop._repeat_iterator()
    assert [priorities.draw(group) for group in range(3)] != [priorities.draw(5 + group) for group in range(3)]
    expected = [(group, dataset[priorities.draw(5 + group)]) for group in range(3) for _ in range(2)]
    assert [next(stream) for _ in range(6)] == expected
    loop._sampler.shutdown()

    from trl_aspo.infra.local_worker import _LocalRolloutLoop

    class OtherLoop(_LocalRolloutLoop):
        pass

    local._loop_cls = OtherLoop
    with pytest.raises(TypeError, match="prioritized_sampling=True: the worker's loop class .*OtherLoop has no"):
        attach_prompt_priorities(local, priorities)
    with pytest.raises(TypeError, match="prioritized_sampling=True draws prompts .* got a object"):
        attach_prompt_priorities(object(), priorities)
    assert issubclass(PrioritizedLocalRolloutLoop, PrioritizedPromptLoop)


# What the worker records for the tracker: first dispatches and conversation ids


def test_prompt_dispatches_keep_each_keys_first_version_and_round_trip():
    dispatches = PromptDispatches(["a", "b", "a"])  # rows 0 and 2 share a key, so one entry
    assert dispatches.record(2, 4) == 4
    assert dispatches.record(0, 6) == 4  # the key's first dispatch was row 2's
    assert dispatches.record(1, 7) == 7
    assert dispatches.state_dict() == {"a": 4, "b": 7}
    restored = PromptDispatches(["a", "b", "a"])
    restored.load_state_dict({"a": 4, "b": 7, "not-in-this-dataset": 1})
    assert restored.state_dict() == {"a": 4, "b": 7}
    with pytest.raises(ValueError, match="key 'a' has version -1; a dispatch version is an integer >= 0"):
        restored.load_state_dict({"a": -1})
    copy = pickle.loads(pickle.dumps(dispatches))  # TRL's up-front check copies; the spawn shares (see below)
    assert copy.state_dict() == dispatches.state_dict()


def _always_one(completions, **kwargs):
    return [1.0] * len(completions)


def local_tracked_loop(tmp_path, tokenizer, dataset, **fields):
    from trl.experimental.async_grpo import AsyncGRPOConfig

    args = AsyncGRPOConfig(**async_fields(tmp_path, **fields))
    worker = LocalRolloutWorker(MODEL, tokenizer, dataset, _always_one, args)
    dispatches = PromptDispatches([prompt_key(prompt) for prompt in dataset["prompt"]])
    attach_rollout_tracking(worker, dispatches)
    assert worker._loop_cls is TrackedLocalRolloutLoop
    return worker, dispatches


def test_the_local_loop_records_each_prompts_first_dispatch_version(tmp_path, tokenizer):
    """Each group's prompt dispatch is recorded at the model version current when the loop hands it out; a prompt
    dispatched again later keeps its first version (rows 0..2 cycled, TRL's order from `dataset_start_index`)."""
    dataset = make_dataset("train", 3, seed=0)
    worker, dispatches = local_tracked_loop(tmp_path, tokenizer, dataset, num_generations=2)
    worker._loop_kwargs["dataset_start_index"] = 1
    loop = worker._loop_cls(**worker._loop_kwargs)
    stream = loop._repeat_iterator()
    taken = []
    for version in (2, 2, 5, 5, 7, 7, 9, 9):  # two items per group: groups 0..3 at versions 2, 5, 7, 9
        worker.update_model_version(version)
        taken.append(next(stream))
    loop._sampler.shutdown()
    rows = [1, 2, 0, 1]
    assert taken == [(group, dataset[row]) for group, row in enumerate(rows) for _ in range(2)]
    keys = [prompt_key(prompt) for prompt in dataset["prompt"]]
    assert dispatches.state_dict() == {keys[1]: 2, keys[2]: 5, keys[0]: 7}
    assert loop._group_dispatch == {0: 2, 1: 5, 2: 7, 3: 2}  # group 3 is row 1 again: its first dispatch, 2


def test_the_loop_stamps_rows_with_their_conversation_and_prompt_dispatch(tmp_path, tokenizer):
    """TRL's `_score_group` on a group of four conversations that all wrote "42", the second forked into two rows:
    every row is a `TrackedRolloutSample` carrying its conversation's `rollout_id` (shared by the forked rows only)
    and the group prompt's first dispatch version; the rows survive a pickle (the spawned worker's queue)."""
    from trl.experimental.async_grpo.async_rollout_worker import RolloutGroup, TrainingSequence

    dataset = make_dataset("train", 2, seed=0)
    worker, dispatches = local_tracked_loop(tmp_path, tokenizer, dataset, num_generations=4)
    loop = worker._loop_cls(**worker._loop_kwargs)
    worker.update_model_version(3)
    stream = loop._repeat_iterator()
    group_id, row = next(stream)
    loop._sampler.shutdown()
    answer = [{"role": "assistant", "content": "42"}]

    def sequence(rollout, offset):
        return TrainingSequence([1, 2, 3 + offset], [0, 1, 1], [0.0, -0.5, -0.5], rollout)

    conversations = [[sequence("r0", 0)], [sequence("r1", 0), sequence("r1", 1)], [sequence("r2", 0)]]
    conversations.append([sequence("r3", 0)])
    group = RolloutGroup(
        prompts=[row["prompt"]] * 4,
        reward_kwargs={},
        completions=[answer] * 4,
        completions_ids=[[7]] * 4,
        completions_sequences=conversations,
        tool_call_counts=[0] * 4,
        tool_failure_counts=[0] * 4,
        model_version=3,
        group_id=group_id,
        env_rewards=[None] * 4,
        rollout_rewards=[None] * 4,
    )
    samples = asyncio.run(loop._score_group(group))
    assert [type(sample) for sample in samples] == [TrackedRolloutSample] * 5
    assert [sample.rollout_id for sample in samples] == ["r0", "r1", "r1", "r2", "r3"]
    assert [sample.input_ids.tolist()[-1] for sample in samples] == [3, 3, 4, 3, 3]
    assert {sample.prompt_dispatch_version for sample in samples} == {3}
    assert all(sample.completion == answer and sample.metrics["reward"] == 1.0 for sample in samples)
    copied = pickle.loads(pickle.dumps(samples[1]))
    assert (copied.rollout_id, copied.prompt_dispatch_version, copied.input_ids.tolist()) == ("r1", 3, [1, 2, 3])
    assert dispatches.state_dict() == {prompt_key(row["prompt"]): 3}
