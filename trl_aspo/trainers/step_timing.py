"""Per-step timing of trl-aspo's own work, as verl logs `timing_s/*` (`log_timing`, on by default): the seconds of
each optimizer step that the plugin adds to what TRL's trainer does anyway, logged beside TRL's metrics.

- `timing/advantages_s`: the advantage computation: the value tracker (values at dispatch, observed outcomes, SPO's
  KL-adaptive log-prob pass, prioritized draws), the estimator, normalization and tool shaping, with their metrics.
  The synchronous trainer scores once per generation round, inside the step that generates it; the asynchronous one
  scores each optimizer step's samples on the main process when its data loader reads them, which counts in the
  step during which they are read (a rollout batch's all at its first step).
- `timing/policy_loss_s`: the registered loss's forward beyond TRL's model forward (`assembled_loss`: its per-token
  term, the correction factor, the KL term, the aggregation, and the loss's metrics), summed over the step's
  micro-batches. Forward only: its backward runs inside TRL's backward pass and is not separated.
- `timing/offpolicy_correction_s`: the off-policy correction: in the synchronous trainer the off-policy mask and the
  vLLM IS factor on a registered loss's path and the `offpolicy/*` diagnostics of TRL's vLLM correction; in the
  asynchronous one the decoupled objective (the proximal log-probs, `recompute`'s forward pass included, and the
  correction weight with its diagnostics).
- `timing/step_s`: the step's wall time, from the previous step's end (the first step: training's start) to this
  one's, so that each region reads as a share of it (`trl-aspo plot`).
- `timing/value_prepass_s`: the value pre-pass (`value_init_samples`), logged once, with the first step.

A region logged once is logged at every later step (0 where it did not run), so a window's mean is per step. Each
process times its own work; the log holds the main process's (as verl logs rank 0's).

Clocks: a region on a CUDA device is a pair of `torch.cuda.Event(enable_timing=True)` recorded on the current stream
and read (`elapsed_time`) only at the end of the optimizer step, and only once its end event has completed
(`query()`): timing adds no synchronization, and a pair still running then is counted at a later step's end. Such a
pair measures the stream's time from the start event to the end event: the region's kernels, and the host's work in
between while the stream has nothing else queued (host work that overlaps earlier kernels costs the step nothing and
is not counted). A region on another device (the asynchronous trainer scores on CPU tensors), the step and the
pre-pass are timed by `time.perf_counter`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import TrainerCallback

ADVANTAGES = "timing/advantages_s"
POLICY_LOSS = "timing/policy_loss_s"
OFFPOLICY_CORRECTION = "timing/offpolicy_correction_s"
STEP = "timing/step_s"
VALUE_PREPASS = "timing/value_prepass_s"


def cuda_timing_event() -> torch.cuda.Event:
    """An unrecorded CUDA event that can time (`elapsed_time`), on the current device."""
    return torch.cuda.Event(enable_timing=True)


class StepTimer:
    """Seconds per named region within one optimizer step (module docstring). `clock`: the host clock, in seconds;
    `new_event`: makes an unrecorded CUDA event (`record()`, `query()`, `elapsed_time(end)` in ms): the tests hand in
    stand-ins for both."""

    def __init__(
        self, clock: Callable[[], float] = time.perf_counter, new_event: Callable[[], Any] = cuda_timing_event
    ) -> None:
        self.clock = clock
        self.new_event = new_event
        self._seconds: dict[str, float] = {}
        self._pending: list[tuple[str, Any, Any]] = []  # CUDA event pairs not read yet
        self._step_start: float | None = None

    @contextlib.contextmanager
    def region(self, name: str, device: torch.device | str) -> Iterator[None]:
        """Add the time of the `with` body to `name`: CUDA events on a CUDA `device`, the host clock otherwise."""
        self._seconds.setdefault(name, 0.0)
        if torch.device(device).type == "cuda":
            start = self.new_event()
            start.record()
            try:
                yield
            finally:
                end = self.new_event()
                end.record()
                self._pending.append((name, start, end))
            return
        started = self.clock()
        try:
            yield
        finally:
            self._seconds[name] += self.clock() - started

    def start(self) -> None:
        """Training starts: the first step is timed from now; nothing measured before counts."""
        self._seconds, self._pending = {}, []
        self._step_start = self.clock()

    def end_step(self) -> dict[str, float]:
        """The step's seconds per region, with its wall time (`STEP`) once `start` was called; the regions start again
        from 0. Only event pairs whose end has completed are read (no synchronization); the others wait for a later
        step's end."""
        waiting = []
        for name, start, end in self._pending:
            if end.query():
                self._seconds[name] += start.elapsed_time(end) / 1000.0
            else:
                waiting.append((name, start, end))
        self._pending = waiting
        metrics = dict(self._seconds)
        now = self.clock()
        if self._step_start is not None:
            metrics[STEP] = now - self._step_start
        self._step_start = now
        self._seconds = dict.fromkeys(self._seconds, 0.0)
        return metrics


class StepTimingCallback(TrainerCallback):
    """Starts the timer when training starts and hands each optimizer step's timings to `append` at the step's end
    (after `optimizer.step()`, before the step is logged)."""

    def __init__(self, timer: StepTimer, append: Callable[[dict[str, float]], None]) -> None:
        self.timer = timer
        self.append = append

    def on_train_begin(self, args, state, control, **kwargs):
        self.timer.start()

    def on_step_end(self, args, state, control, **kwargs):
        self.append(self.timer.end_step())


class StepTimingMixin:
    """`log_timing` for both trainers: `_start_step_timing` (in `__init__`), `_timed` around each region, and
    `_timed_prepass` around the value pre-pass. The metrics go to TRL's `_metrics["train"]`, which its `log`
    averages over the logging window."""

    _step_timer: StepTimer | None = None

    def _start_step_timing(self) -> None:
        if getattr(self.args, "log_timing", False):
            self._step_timer = StepTimer()
            self.add_callback(StepTimingCallback(self._step_timer, self._append_timings))

    def _append_timings(self, timings: dict[str, float]) -> None:
        for name, seconds in timings.items():
            self._metrics["train"][name].append(seconds)

    def _timed(self, name: str, device: torch.device | str, training: bool = True):
        """The timer's region `name` on `device`; nothing with timing off or for an evaluation pass (`training`
        False). Not read from `model.training`: the asynchronous trainer scores its first step's samples before
        transformers first puts the model in training mode."""
        if self._step_timer is None or not training:
            return contextlib.nullcontext()
        return self._step_timer.region(name, device)

    @contextlib.contextmanager
    def _timed_prepass(self) -> Iterator[None]:
        """`VALUE_PREPASS`: the pre-pass's wall time, added after it (the synchronous one restores TRL's metrics)."""
        started = time.perf_counter()
        yield
        if self._step_timer is not None:
            self._append_timings({VALUE_PREPASS: time.perf_counter() - started})
