"""Stopping TRL's rollout worker after its child process failed, without hanging the trainer.

TRL's `AsyncRolloutWorker.stop` sets a `multiprocessing.Event` that a thread of the child waits on (its stop
watcher). `multiprocessing.Condition.notify` counts every process that entered `wait` and blocks until each has woken;
a child that died while its watcher waited never wakes, so `stop` blocks forever. Measured (TRL 1.16, vLLM 0.31 CPU):
a rollout loop that raised (here, a turn beyond the server's context) left the trainer in `Event.set` inside
`stop`, in the `finally` of its training loop, instead of raising the child's error. `SafeStopAsyncRolloutWorker`
skips the event when the child is no longer alive (after the child reported its failure, it is given the time TRL's
`stop` gives it to exit), so the trainer goes on to raise the child's error.
"""

from __future__ import annotations

from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

__all__ = ["SafeStopAsyncRolloutWorker", "attach_safe_stop"]

CHILD_EXIT_WAIT_S = 15.0


class SafeStopAsyncRolloutWorker(AsyncRolloutWorker):
    """TRL's `AsyncRolloutWorker` whose `stop` does not wait on a dead child's stop watcher."""

    def stop(self) -> None:
        process = self._process
        if process is not None and process._popen is not None:
            if self._failed_event.is_set():
                process.join(timeout=CHILD_EXIT_WAIT_S)
            if not process.is_alive():
                process.join()
                self._process = None
                return
        super().stop()


def attach_safe_stop(worker) -> None:
    """Give TRL's own `AsyncRolloutWorker` (exactly that class, not yet stopped) `SafeStopAsyncRolloutWorker.stop`;
    any other worker is left as it is."""
    if type(worker) is AsyncRolloutWorker:
        worker.__class__ = SafeStopAsyncRolloutWorker
