"""SPO++'s runtime on the real local rollout worker (CPU): one request in flight per prompt
(`max_inflight_per_prompt`) and the old weights' work drained at publish (`drain_on_publish`), with fewer prompts
than generation slots, so the dispatcher has to wait for prompts rather than for slots."""

from __future__ import annotations

import threading
import time

import pytest
from helpers import async_fields, calculator_tokenizer, digit_share_reward, trainer_with_local_worker

from trl_aspo.builtin.task import make_dataset
from trl_aspo.values.prompt_ids import prompt_key

PROMPTS = 3
SLOTS = 6  # max_inflight_tasks, twice the prompts


@pytest.fixture(scope="module")
def tokenizer():
    return calculator_tokenizer()


def runtime_trainer(tmp_path, tokenizer, reward, jitter_s, **fields):
    """An spo++ AsyncASPOTrainer on the local worker over `PROMPTS` prompts, one completion each, `SLOTS` slots."""
    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer

    base = dict(per_device_train_batch_size=4, num_generations=1, max_inflight_tasks=SLOTS, max_staleness=4)
    args = AsyncASPOConfig(**async_fields(tmp_path, **{**base, **fields}), advantage_estimator="spo++")
    dataset = make_dataset("train", PROMPTS, seed=0)
    return trainer_with_local_worker(AsyncASPOTrainer, args, tokenizer, dataset, [reward], jitter_s=jitter_s)


def logged(trainer, key):
    return [log[key] for log in trainer.state.log_history if key in log]


@pytest.mark.parametrize("prioritized", [False, True], ids=["cycle", "prioritized"])
def test_one_request_in_flight_per_prompt(tmp_path, tokenizer, prioritized):
    """No two requests of one prompt overlap: each dispatch of a prompt (as the worker hands it to generation) comes
    after the previous one's trajectory was scored (its reward computed), though slots were free."""
    events = []  # (time, prompt key, "dispatch" | "scored")

    def recording_reward(completions, prompts, **kwargs):
        events.extend((time.monotonic(), prompt_key(prompt), "scored") for prompt in prompts)
        return digit_share_reward(completions)

    trainer = runtime_trainer(
        tmp_path,
        tokenizer,
        recording_reward,
        0.05,
        max_steps=3,
        max_inflight_per_prompt=1,
        prioritized_sampling=prioritized,
    )
    control = trainer._dispatch_control
    row_keys = [prompt_key(prompt) for prompt in trainer.train_dataset["prompt"]]
    try_dispatch = control.try_dispatch

    def recording_dispatch(row, conversations):
        dispatched = try_dispatch(row, conversations)
        if dispatched:
            events.append((time.monotonic(), row_keys[row], "dispatch"))
        return dispatched

    control.try_dispatch = recording_dispatch
    trainer.train()

    # A hold parked when training ends stops with the loop (no prompt is scored any more to release it).
    assert not any(thread.name == "local-rollout-worker" for thread in threading.enumerate())
    per_key = {}
    for _, key, kind in sorted(events):
        per_key.setdefault(key, []).append(kind)
    assert sum(kinds.count("dispatch") for kinds in per_key.values()) >= 12  # three steps of 4 samples
    for kinds in per_key.values():
        # dispatch, scored, dispatch, scored, ... (the last dispatch may be cut off by the end of training)
        assert all(kind == ("dispatch" if i % 2 == 0 else "scored") for i, kind in enumerate(kinds)), kinds


def test_drain_on_publish_no_turn_spans_a_publish(tmp_path, tokenizer):
    """With the drain, every turn starts and ends under one model version, under a jitter at which turns span
    publishes without it; with it off (same jitter, one in flight per prompt), some do."""
    spans = {}
    for drain in (True, False):
        trainer = runtime_trainer(
            tmp_path / str(drain),
            tokenizer,
            digit_share_reward,
            0.3,
            max_steps=4,
            max_inflight_per_prompt=1,
            drain_on_publish=drain,
        )
        trainer.train()
        spans[drain] = logged(trainer, "rollout/turns_across_publish_total")
        tokens = logged(trainer, "rollout/tokens_across_publish_total")
        assert len(spans[drain]) == len(tokens) >= 3 and trainer.model_version >= 4  # a publish per step
        if drain:
            assert sum(tokens) == 0
    assert sum(spans[True]) == 0
    assert sum(spans[False]) > 0
