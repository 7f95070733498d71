"""`trl_aspo.infra.replay`: the rollout worker that hands out pre-made samples and the weight transfer that sends
nothing, checked by hand on tiny `RolloutSample`s (the trainers that run on them: tests/integration/)."""

from __future__ import annotations

import queue

import numpy as np
import pytest
from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker, RolloutSample

from trl_aspo.infra import NoOpWeightTransfer, ReplayRolloutWorker


def sample(name: str, model_version: int = 0, group_id: int = 0) -> RolloutSample:
    return RolloutSample(
        prompt=[{"role": "user", "content": name}],
        completion=[{"role": "assistant", "content": "4"}],
        input_ids=np.asarray([5, 6, 7], dtype=np.int64),
        completion_mask=np.asarray([0, 0, 1], dtype=np.int64),
        old_log_probs=np.asarray([0.0, 0.0, -0.5], dtype=np.float32),
        advantage=1.0,
        model_version=model_version,
        group_id=group_id,
        metrics={"reward": 1.0, "reward_std": 0.0},
    )


def names(samples) -> list[str]:
    return [s.prompt[0]["content"] for s in samples]


def test_without_cycle_each_sample_is_handed_out_once_in_order_then_the_queue_waits():
    given = [sample("a"), sample("b"), sample("c")]
    worker = ReplayRolloutWorker(given)
    assert worker.rollout_buffer.qsize() == 3
    taken = [worker.rollout_buffer.get_nowait(), worker.rollout_buffer.get(timeout=1)]
    assert worker.rollout_buffer.qsize() == 1
    taken.append(worker.rollout_buffer.get_nowait())
    assert all(got is original for got, original in zip(taken, given, strict=True))  # as given: no copy, no stamp
    with pytest.raises(queue.Empty):
        worker.rollout_buffer.get_nowait()
    with pytest.raises(queue.Empty):  # a trainer asking for more waits, as on TRL's queue
        worker.rollout_buffer.get(timeout=0.01)
    assert worker.rollout_buffer.qsize() == 0


def test_cycle_starts_over_after_the_last_sample_and_never_empties():
    worker = ReplayRolloutWorker([sample("a"), sample("b")], cycle=True)
    taken = [worker.rollout_buffer.get_nowait() for _ in range(5)]
    assert names(taken) == ["a", "b", "a", "b", "a"]
    assert worker.rollout_buffer.qsize() == 2
    with pytest.raises(ValueError, match="needs at least one sample"):
        ReplayRolloutWorker([], cycle=True)


def test_restamped_versions_follow_update_model_version():
    given = [sample("a", model_version=7), sample("b", model_version=7)]
    worker = ReplayRolloutWorker(given, cycle=True, restamp_version=True)
    versions = [worker.rollout_buffer.get_nowait().model_version]
    worker.update_model_version(3)
    versions += [worker.rollout_buffer.get_nowait().model_version for _ in range(2)]
    worker.update_model_version(5)
    versions.append(worker.rollout_buffer.get_nowait().model_version)
    assert versions == [0, 3, 3, 5]
    assert [s.model_version for s in given] == [7, 7]  # copies are stamped, not the given samples

    once = ReplayRolloutWorker([sample("a", model_version=7)], restamp_version=True)
    once.update_model_version(2)
    assert once.rollout_buffer.get_nowait().model_version == 2


def test_new_group_ids_count_from_one():
    given = [sample("a", group_id=9), sample("b", group_id=9)]
    worker = ReplayRolloutWorker(given, cycle=True, new_group_ids=True)
    taken = [worker.rollout_buffer.get_nowait() for _ in range(3)]
    assert [s.group_id for s in taken] == [1, 2, 3]
    assert names(taken) == ["a", "b", "a"]
    assert [s.model_version for s in taken] == [0, 0, 0]  # restamping is separate
    assert [s.group_id for s in given] == [9, 9]


def test_the_protocol_methods_do_nothing_and_the_worker_mixes_into_trls_worker_class():
    worker = ReplayRolloutWorker([sample("a")])
    worker.start()
    worker.check_health(stale_after_s=0.0)
    worker.stop()
    assert worker.metrics_queue.empty()

    class Replaying(ReplayRolloutWorker, AsyncRolloutWorker):
        """What tests do to be treated as TRL's worker: `model_version` is a property there."""

    mixed = Replaying([sample("a")], restamp_version=True)
    mixed.update_model_version(4)
    assert isinstance(mixed, AsyncRolloutWorker)
    assert mixed.rollout_buffer.get_nowait().model_version == 4


def test_send_weights_consumes_the_iterator():
    transfer = NoOpWeightTransfer()
    read = []

    def weights():
        for name in ("embed.weight", "head.weight"):
            read.append(name)
            yield name, np.zeros(2)

    iterator = weights()
    transfer.init_weight_transfer()
    transfer.pause()
    transfer.send_weights(iterator)
    transfer.resume()
    transfer.destroy()
    assert read == ["embed.weight", "head.weight"]
    with pytest.raises(StopIteration):
        next(iterator)
