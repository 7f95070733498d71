"""`SafeStopAsyncRolloutWorker.stop` (trl_aspo.infra.worker_stop) after the child died while a thread of it waited on
the stop event, as TRL's child's stop watcher does: TRL's `stop` blocks in `Event.set`, this one returns. The real
worker's failure through the trainer is tests/vllm_tier/test_context_vllm.py."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time

from accelerate import PartialState
from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

from trl_aspo.infra.worker_stop import SafeStopAsyncRolloutWorker, attach_safe_stop


def failing_child(stop_event, failed_event) -> None:
    """TRL's child in miniature: a watcher thread waits on the stop event, then the loop fails and the process dies."""
    threading.Thread(target=stop_event.wait, daemon=True).start()
    time.sleep(0.5)
    failed_event.set()
    os._exit(1)


def worker_with_dead_child(cls):
    context = multiprocessing.get_context("spawn")
    worker = object.__new__(cls)
    worker._stop_event_mp, worker._failed_event = context.Event(), context.Event()
    worker._process = context.Process(target=failing_child, args=(worker._stop_event_mp, worker._failed_event))
    worker._process.start()
    assert worker._failed_event.wait(60)
    worker._process.join(60)
    return worker


def stops_within(worker, seconds: float) -> bool:
    stopping = threading.Thread(target=worker.stop, daemon=True)
    stopping.start()
    stopping.join(seconds)
    return not stopping.is_alive()


def test_trls_stop_hangs_after_the_child_died_waiting_and_the_safe_stop_returns():
    PartialState()  # TRL's stop logs through accelerate
    # If TRL's own stop returns here, TRL fixed it and `attach_safe_stop` can go.
    assert not stops_within(worker_with_dead_child(AsyncRolloutWorker), 5)
    worker = worker_with_dead_child(SafeStopAsyncRolloutWorker)
    assert stops_within(worker, 30)
    assert worker._process is None


def test_only_trls_own_worker_class_is_swapped():
    trl_worker, other = object.__new__(AsyncRolloutWorker), object()
    subclass = type("MyWorker", (AsyncRolloutWorker,), {})
    mine = object.__new__(subclass)
    for worker in (trl_worker, other, mine):
        attach_safe_stop(worker)
    assert type(trl_worker) is SafeStopAsyncRolloutWorker
    assert type(other) is object and type(mine) is subclass
