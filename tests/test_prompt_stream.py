"""Prioritized sampling on the asynchronous worker's prompt stream (trl_aspo.infra.prompt_stream): the draw, its shared
weights across a spawned process, attaching it to workers, and AsyncASPOTrainer runs on the local worker and on TRL's
own worker process."""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing
import pickle

import pytest
import torch
from async_common import MODEL, async_fields, calculator_tokenizer, trainer_with_local_worker

from trl_aspo.builtin.task import correctness_reward, make_dataset
from trl_aspo.infra import LocalRolloutWorker, LocalWeightTransfer, install_cpu_fallbacks
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


def _child_draws(priorities, updated, answers) -> None:
    answers.put(("before", priorities.weights.tolist(), priorities.draw(0)))
    updated.wait(60)
    answers.put(("after", priorities.weights.tolist(), [priorities.draw(group) for group in range(50)]))


def test_a_spawned_child_sees_weights_updated_after_it_started():
    priorities = PromptPriorities(torch.tensor([0.5, 0.5, 0.5, 0.5]), seed=1)
    copy = pickle.loads(pickle.dumps({"prompt_priorities": priorities}))["prompt_priorities"]  # TRL's check
    assert copy.weights.tolist() == priorities.weights.tolist()
    context = multiprocessing.get_context("spawn")
    updated, answers = context.Event(), context.Queue()
    child = context.Process(target=_child_draws, args=(priorities, updated, answers), daemon=True)
    child.start()
    try:
        assert answers.get(timeout=120)[1] == [0.55] * 4
        priorities.update([0, 1, 2], torch.tensor([1.0, 1.0, 0.0]))
        updated.set()
        label, weights, drawn = answers.get(timeout=60)
    finally:
        child.join(30)
    assert label == "after" and weights == pytest.approx([0.05, 0.05, 0.05, 0.55])
    assert drawn == [priorities.draw(group) for group in range(50)]
    assert drawn.count(3) > 25  # row 3 carries 11/14 of the weight


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


# AsyncASPOTrainer


def certain_half_init_file(tmp_path, dataset) -> tuple[str, set[str]]:
    """A value_init_file putting every even row at value 1 - 1e-12 (Beta(1e6, 1e-6)): weight ~2e-6 at
    priority_epsilon=1e-6, against >= ~0.1 for a prompt whose value is anywhere in [0.01, 0.99]."""
    keys = [prompt_key(prompt) for prompt in dataset["prompt"]]
    certain = set(keys[0::2])
    path = tmp_path / "init.json"
    path.write_text(json.dumps([{"prompt_id": key, "alpha": 1e6, "beta": 1e-6} for key in sorted(certain)]))
    return str(path), certain


def prioritized_fields(tmp_path, init_file, **overrides):
    fields = dict(per_device_train_batch_size=4, num_generations=1, max_steps=3, max_inflight_tasks=1)
    return dict(
        **async_fields(tmp_path, **{**fields, **overrides}),
        advantage_estimator="spo++",
        loss_type="aspo",
        prioritized_sampling=True,
        priority_epsilon=1e-6,
        value_init_file=init_file,
    )


def recording_scores(trainer) -> list:
    samples, score_step = [], trainer._score_step

    def recording_score_step(step_samples):
        samples.extend(step_samples)
        return score_step(step_samples)

    trainer._score_step = recording_score_step
    return samples


def test_trainer_starts_the_weights_from_the_tracker_and_warns_on_unknown_prompts(tmp_path, tokenizer, caplog):
    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer

    install_cpu_fallbacks()
    dataset = make_dataset("train", 8, seed=0)
    init_file, _ = certain_half_init_file(tmp_path, dataset)
    args = AsyncASPOConfig(**prioritized_fields(tmp_path, init_file))
    worker = LocalRolloutWorker(MODEL, tokenizer, dataset, correctness_reward, args)
    trainer = AsyncASPOTrainer(
        MODEL,
        reward_funcs=correctness_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        rollout_worker=worker,
        weight_transfer=LocalWeightTransfer(worker),
    )
    assert worker._loop_kwargs["prompt_priorities"] is trainer._prompt_priorities
    # Even rows: v = 1e6 / (1e6 + 1e-6), sqrt(v (1 - v)) = 1e-6, + epsilon 1e-6; odd rows: unseen, v = 0.5. (1 - v
    # is 1e-12 to within float64's 1e-16, so sqrt(v (1 - v)) to within ~1e-10 absolute.)
    expected = torch.tensor([2e-6, 0.5 + 1e-6] * 4, dtype=torch.float64)
    torch.testing.assert_close(trainer._prompt_priorities.weights, expected, rtol=0, atol=1e-10)
    with caplog.at_level("WARNING", logger="trl_aspo.trainers.async_aspo_trainer"):
        trainer._refresh_priorities(["not-a-dataset-prompt", trainer._dataset_keys[1]])
    assert "1 scored prompt(s) match no train_dataset prompt" in caplog.text
    torch.testing.assert_close(trainer._prompt_priorities.weights, expected, rtol=0, atol=1e-10)


@pytest.mark.slow
def test_local_worker_draws_the_uncertain_prompts(tmp_path, tokenizer):
    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer

    dataset = make_dataset("train", 32, seed=0)
    init_file, certain = certain_half_init_file(tmp_path, dataset)
    args = AsyncASPOConfig(**prioritized_fields(tmp_path, init_file))
    trainer = trainer_with_local_worker(AsyncASPOTrainer, args, tokenizer, dataset, correctness_reward, seed=0)
    worker = trainer.rollout_worker
    assert worker._loop_cls is PrioritizedLocalRolloutLoop
    # Every sample's key (the scorer's) is a dataset row's key (the priorities'): chat prompts hash alike.
    assert {prompt_key(sample["prompt"]) for sample in dataset} == set(trainer._dataset_keys)
    samples = recording_scores(trainer)
    trainer.train()

    keys = [prompt_key(sample.prompt) for sample in samples]
    assert len(keys) >= 12 and set(keys) <= set(trainer._dataset_keys)
    # TRL's cycling would give rows 0, 1, 2, ... (half of them certain); each draw of a certain prompt has
    # probability < 16 * 2e-6 / (16 * 0.1) = 2e-5.
    assert not set(keys) & certain
    assert len(set(keys)) > 1
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == 3 and all(math.isfinite(log["loss"]) for log in logs)
    # 16 rows at ~0.5 and 16 at ~2e-6 start at an effective 16 prompts; observed rows only lose weight from 0.5.
    effective = [log["value/effective_prompts"] for log in logs]
    assert all(1.0 < value <= 16.0 + 1e-3 for value in effective)
    # The shared weights are the tracker's values with every received outcome visible (version after the newest).
    values = trainer._scorer.tracker.value(trainer._dataset_keys, trainer.model_version + 1)
    torch.testing.assert_close(trainer._prompt_priorities.weights, (values * (1 - values)).sqrt() + 1e-6)


def test_prioritized_sampling_refuses_a_non_map_dataset_and_other_workers(tmp_path, tokenizer):
    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer

    install_cpu_fallbacks()
    dataset = make_dataset("train", 8, seed=0)
    args = AsyncASPOConfig(**prioritized_fields(tmp_path, None))
    worker = LocalRolloutWorker(MODEL, tokenizer, dataset, correctness_reward, args)
    common = dict(
        reward_funcs=correctness_reward,
        args=args,
        processing_class=tokenizer,
        weight_transfer=LocalWeightTransfer(worker),
    )
    with pytest.raises(ValueError, match="prioritized_sampling=True needs train_dataset to be a map-style"):
        AsyncASPOTrainer(MODEL, **common, train_dataset=dataset.to_iterable_dataset(), rollout_worker=worker)

    class OwnWorker:
        rollout_buffer = metrics_queue = None

    with pytest.raises(TypeError, match="prioritized_sampling=True draws prompts .* got a OwnWorker"):
        AsyncASPOTrainer(MODEL, **common, train_dataset=dataset, rollout_worker=OwnWorker())


@pytest.mark.slow
def test_resumed_local_worker_draws_from_the_restored_tracker(tmp_path, tokenizer):
    """Resume a prioritized run: the weights are rebuilt from the restored tracker before the worker starts, and its
    first group is the draw of the checkpoint's first untrained group index under them."""
    import copy

    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer
    from trl_aspo.values.sampler import priority_weights

    install_cpu_fallbacks()
    dataset = make_dataset("train", 32, seed=0)

    def trainer_for(max_steps):
        fields = prioritized_fields(tmp_path, None, max_steps=max_steps, save_strategy="steps", save_steps=2)
        args = AsyncASPOConfig(**{**fields, "priority_epsilon": 0.05})
        return trainer_with_local_worker(AsyncASPOTrainer, args, tokenizer, dataset, correctness_reward, seed=0)

    trainer_for(2).train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    first_untrained = json.loads((checkpoint / "rollout_state.json").read_text())["prompt_index"]

    resumed = trainer_for(3)
    assert resumed._prompt_priorities.weights.tolist() == [0.55] * 32  # a fresh tracker: every value 0.5
    at_start = {}
    start = resumed.rollout_worker.start

    def recording_start():
        tracker, keys = resumed._scorer.tracker, resumed._dataset_keys
        at_start["expected"] = priority_weights(tracker.value(keys, resumed.model_version + 1), 0.05)
        at_start["priorities"] = copy.deepcopy(resumed._prompt_priorities)
        start()

    resumed.rollout_worker.start = recording_start
    samples = recording_scores(resumed)
    resumed.train(resume_from_checkpoint=str(checkpoint))

    weights = at_start["priorities"].weights
    torch.testing.assert_close(weights, at_start["expected"], rtol=0, atol=0)
    assert (weights != 0.55).sum() >= 2  # the restored tracker's observed prompts
    first = next(sample for sample in samples if sample.group_id == 0)
    assert first.prompt == dataset[at_start["priorities"].draw(first_untrained)]["prompt"]


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
