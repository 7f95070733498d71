"""trl_aspo.infra.prompt_stream on TRL's own rollout worker (it needs vLLM to be constructed) and its spawned process
against the real vLLM server: loop attachment, prioritized draws from shared weights, first-dispatch stamps."""

from __future__ import annotations

import math
import pickle

import pytest
import torch
from helpers import (
    MODEL,
    async_fields,
    calculator_tokenizer,
    certain_half_init_file,
    prioritized_fields,
    recording_scores,
)

from trl_aspo.builtin.task import calculator, correctness_reward, make_dataset
from trl_aspo.infra.prompt_stream import (
    PrioritizedAsyncRolloutLoop,
    PromptDispatches,
    PromptPriorities,
    TrackedAsyncRolloutLoop,
    TrackedRolloutSample,
    attach_prompt_priorities,
    attach_rollout_tracking,
)
from trl_aspo.values.prompt_ids import prompt_key


@pytest.fixture(scope="module")
def tokenizer():
    return calculator_tokenizer()


def test_attach_swaps_the_loop_of_trls_worker_and_refuses_others():
    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker, _AsyncRolloutLoop

    dataset = make_dataset("train", 4, seed=0)
    priorities = PromptPriorities(torch.full((4,), 0.5))
    trl_worker = AsyncRolloutWorker(dataset=dataset, num_generations=2)
    attach_prompt_priorities(trl_worker, priorities)
    assert trl_worker._loop_cls is PrioritizedAsyncRolloutLoop
    assert trl_worker._loop_kwargs["prompt_priorities"] is priorities
    assert pickle.loads(pickle.dumps(PrioritizedAsyncRolloutLoop)) is PrioritizedAsyncRolloutLoop  # by reference
    attach_prompt_priorities(trl_worker, priorities)  # a prioritized loop stays
    assert trl_worker._loop_cls is PrioritizedAsyncRolloutLoop

    class OtherLoop(_AsyncRolloutLoop):
        pass

    trl_worker._loop_cls = OtherLoop
    with pytest.raises(TypeError, match="prioritized_sampling=True: the worker's loop class .*OtherLoop has no"):
        attach_prompt_priorities(trl_worker, priorities)


def test_attach_rollout_tracking_swaps_the_loop_and_keeps_a_prioritized_one():
    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

    dataset = make_dataset("train", 4, seed=0)
    dispatches = PromptDispatches([prompt_key(prompt) for prompt in dataset["prompt"]])
    trl_worker = AsyncRolloutWorker(dataset=dataset, num_generations=2)
    attach_rollout_tracking(trl_worker, dispatches)
    assert trl_worker._loop_cls is TrackedAsyncRolloutLoop
    assert trl_worker._loop_kwargs["prompt_dispatches"] is dispatches
    attach_prompt_priorities(trl_worker, PromptPriorities(torch.full((4,), 0.5)))  # tracked -> prioritized
    assert trl_worker._loop_cls is PrioritizedAsyncRolloutLoop
    attach_rollout_tracking(trl_worker, dispatches)  # a prioritized loop is a tracked one
    assert trl_worker._loop_cls is PrioritizedAsyncRolloutLoop
    with pytest.raises(TypeError, match="only TRL's AsyncRolloutWorker .* got a object"):
        attach_rollout_tracking(object(), dispatches)


def test_trl_worker_process_draws_from_the_shared_weights(vllm_server, tmp_path, tokenizer):
    """TRL's own spawned worker against the vLLM server: the tracker state crosses the process
    boundary as the weights the child draws from, also when it changes after the child was spawned."""
    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer

    dataset = make_dataset("train", 16, seed=0)
    init_file, certain = certain_half_init_file(tmp_path, dataset)
    revived = prompt_key(dataset[0]["prompt"])  # certain (never drawn) until the child has been spawned
    args = AsyncASPOConfig(
        **prioritized_fields(tmp_path, init_file, max_steps=2, max_inflight_tasks=1),
        vllm_server_base_url=vllm_server.url,
    )
    trainer = AsyncASPOTrainer(
        MODEL,
        reward_funcs=correctness_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        tools=[calculator],
    )
    assert isinstance(trainer.rollout_worker, AsyncRolloutWorker)
    assert trainer.rollout_worker._loop_cls is PrioritizedAsyncRolloutLoop
    spawn = trainer.rollout_worker.start

    def spawn_then_swap_certainty():
        spawn()
        # Now the tracker deems every prompt certain but `revived`, which starts afresh at Beta(0.5, 0.5).
        others = [key for key in trainer._values.dataset_keys if key != revived]
        trainer._values.tracker.set_pseudo_counts(others, [1e6] * len(others), [1e-6] * len(others))
        trainer._values.tracker.set_pseudo_counts([revived], [0.5], [0.5])
        trainer._values.refresh_priorities(trainer._values.dataset_keys)

    trainer.rollout_worker.start = spawn_then_swap_certainty
    samples = recording_scores(trainer)
    trainer.train()
    keys = [prompt_key(sample.prompt) for sample in samples]
    assert len(keys) >= 8 and set(keys) <= set(trainer._values.dataset_keys)
    # With the weights as the child was spawned, `revived` (weight ~2e-6 against >= 8 * 0.1) comes up with
    # probability < 2e-5 per draw; after the swap it carries all but ~15 * 2e-6 / 0.5 of the weight. Groups drawn
    # before the swap (the child starts drawing as soon as it is up) come from the uncertain half.
    assert revived in keys
    assert not set(keys) & (certain - {revived})
    assert keys[-1] == revived
    assert trainer._values.tracker.visits([revived]).item() == keys.count(revived)
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)


def test_trl_worker_process_stamps_first_dispatches_into_the_shared_table(vllm_server, tmp_path, tokenizer):
    """TRL's own spawned worker against the vLLM server, spo++ without prioritized sampling: the
    child records each prompt's first dispatch in the table the trainer holds (shared memory, not a copy) and stamps
    it and TRL's rollout id on every row it sends back; the tracker anchors each prior there."""
    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer

    dataset = make_dataset("train", 16, seed=0)
    fields = dict(per_device_train_batch_size=4, num_generations=2, max_steps=2, max_inflight_tasks=1)
    args = AsyncASPOConfig(
        **async_fields(tmp_path, **fields), advantage_estimator="spo++", vllm_server_base_url=vllm_server.url
    )
    trainer = AsyncASPOTrainer(
        MODEL,
        reward_funcs=correctness_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        tools=[calculator],
    )
    assert isinstance(trainer.rollout_worker, AsyncRolloutWorker)
    assert trainer.rollout_worker._loop_cls is TrackedAsyncRolloutLoop
    samples = recording_scores(trainer)
    trainer.train()
    dispatches = trainer._values.prompt_dispatches.state_dict()
    priors = trainer._values.tracker.state_dict()["prior"]
    assert len(samples) >= 8 and all(isinstance(sample, TrackedRolloutSample) for sample in samples)
    for sample in samples:
        key = prompt_key(sample.prompt)
        assert sample.prompt_dispatch_version == dispatches[key] == priors[key][2] <= sample.model_version
    # One rollout id per conversation: a group of 2 has 2 (no forks in these short single-call conversations).
    for group in {sample.group_id for sample in samples}:
        rollouts = {sample.rollout_id for sample in samples if sample.group_id == group}
        assert len(rollouts) == 2 and None not in rollouts
