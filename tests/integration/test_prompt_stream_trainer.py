"""Prioritized sampling on the asynchronous worker's prompt stream in use: its shared weights across a spawned
process, and AsyncASPOTrainer runs on the local worker (fresh and resumed)."""

from __future__ import annotations

import json
import math
import multiprocessing
import pickle

import pytest
import torch
from helpers import (
    MODEL,
    calculator_tokenizer,
    certain_half_init_file,
    prioritized_fields,
    recording_scores,
    trainer_with_local_worker,
)

from trl_aspo.builtin.task import correctness_reward, make_dataset
from trl_aspo.infra import LocalRolloutWorker, LocalWeightTransfer, install_cpu_fallbacks
from trl_aspo.infra.prompt_stream import PrioritizedLocalRolloutLoop, PromptPriorities
from trl_aspo.values.prompt_ids import prompt_key


@pytest.fixture(scope="module")
def tokenizer():
    return calculator_tokenizer()


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
        trainer._values.refresh_priorities(["not-a-dataset-prompt", trainer._values.dataset_keys[1]])
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
    assert {prompt_key(sample["prompt"]) for sample in dataset} == set(trainer._values.dataset_keys)
    samples = recording_scores(trainer)
    trainer.train()

    keys = [prompt_key(sample.prompt) for sample in samples]
    assert len(keys) >= 12 and set(keys) <= set(trainer._values.dataset_keys)
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
    values = trainer._values.tracker.value(trainer._values.dataset_keys, trainer.model_version + 1)
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
        tracker, keys = resumed._values.tracker, resumed._values.dataset_keys
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
