"""Stand-ins for the rollout worker and the weight transfer of TRL's asynchronous trainer that generate nothing.

`AsyncASPOTrainer` (and TRL's `AsyncGRPOTrainer`) take a `rollout_worker` (TRL's `RolloutWorkerProtocol`) and a
`weight_transfer` (`WeightTransferProtocol`). `ReplayRolloutWorker` hands out pre-made `RolloutSample`s and
`NoOpWeightTransfer` publishes to no inference server, so the trainer's own work is timed or tested without
generation, the way `rollout_func` stands in for the synchronous trainer's: scripts/bench_rollout_batches.py and
scripts/gpu_check.py time it, the tests feed it exact sample streams.
"""

from __future__ import annotations

import dataclasses
import queue
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample


class _ReplayQueue(queue.Queue):
    """A `queue.Queue` filled with `samples` once, each passed through `hand_out` when taken; with `cycle` a sample
    taken goes back to the end, so the queue never empties (never waits) and `qsize()` stays `len(samples)`."""

    def __init__(self, samples: list[RolloutSample], cycle: bool, hand_out: Callable[[Any], Any]):
        super().__init__()
        self.cycle, self.hand_out = cycle, hand_out
        for sample in samples:
            self.put(sample)

    def _get(self):  # queue.Queue's hook, called under its lock
        sample = super()._get()
        if self.cycle:
            self.queue.append(sample)
        return self.hand_out(sample)


class ReplayRolloutWorker:
    """`RolloutWorkerProtocol` that generates nothing: its `rollout_buffer` hands out `samples` in order.

    Without `cycle` it holds each sample once, so a trainer that asks for more waits, as for TRL's worker; with `cycle`
    it repeats them forever. `restamp_version` gives each sample handed out the model version last passed to
    `update_model_version` (none is ever stale); `new_group_ids` gives each its own group id, 1, 2, 3, ... (one-sample
    groups, as SPO++ trains). Either makes a copy (`dataclasses.replace`); otherwise the sample is handed out as given.
    The version is kept as `latest_model_version`: TRL's `AsyncRolloutWorker` makes `model_version` a property, and
    tests mix this class into it (`class Replaying(ReplayRolloutWorker, AsyncRolloutWorker)`, whose `__init__` is
    not run) to be treated as TRL's worker.
    """

    def __init__(
        self,
        samples: Iterable[RolloutSample],
        *,
        cycle: bool = False,
        restamp_version: bool = False,
        new_group_ids: bool = False,
    ):
        samples = list(samples)
        if cycle and not samples:
            raise ValueError("ReplayRolloutWorker(cycle=True) needs at least one sample to repeat.")
        self.restamp_version, self.new_group_ids = restamp_version, new_group_ids
        self.latest_model_version = 0
        self.handed_out = 0
        self.rollout_buffer = _ReplayQueue(samples, cycle, self._hand_out)
        self.metrics_queue: queue.Queue = queue.Queue()

    def _hand_out(self, sample: RolloutSample) -> RolloutSample:
        self.handed_out += 1
        changes: dict[str, int] = {}
        if self.restamp_version:
            changes["model_version"] = self.latest_model_version
        if self.new_group_ids:
            changes["group_id"] = self.handed_out
        return dataclasses.replace(sample, **changes) if changes else sample

    def start(self) -> None:
        """Nothing to start: the samples are there."""

    def stop(self) -> None:
        """Nothing to stop."""

    def update_model_version(self, model_version: int) -> None:
        self.latest_model_version = model_version

    def check_health(self, stale_after_s: float) -> None:
        """Always healthy: nothing runs."""


class NoOpWeightTransfer:
    """`WeightTransferProtocol` without an inference server: a publish only reads the weights (`send_weights`
    consumes its iterator, so the trainer's gathering of the weights still runs)."""

    def init_weight_transfer(self) -> None:
        """Nothing to set up."""

    def pause(self) -> None:
        """Nothing to pause."""

    def send_weights(self, iterator: Iterator[Any]) -> None:
        for _ in iterator:
            pass

    def resume(self) -> None:
        """Nothing to resume."""

    def destroy(self) -> None:
        """Nothing to release."""
