"""Stopping a run on a signal at a step that resumes exactly (`stop_signals`, `stop_at`, `stop_grace_s`).

A cluster preempts a job, or ends it at its time limit, with a signal (SLURM: SIGTERM, or the one `--signal` names)
and kills it a grace period later. `GracefulStop` is the callback that turns the first such signal into a checkpoint:

- the signal handler only records the signal (the optimizer step under way finishes);
- at each step boundary where the run may stop (`stop_at: round`: the step that ends a generation round, the round
  TRL's `GRPOTrainer` counts in `_step`; the asynchronous trainer: a rollout batch of `steps_per_rollout_batch`
  steps; `stop_at: step`: every step) every rank gathers every rank's signal, so all of them stop at the same step
  or none does, whichever rank the signal reached (this gather is the one collective added per boundary);
- stopping sets transformers' own `control.should_save` and `should_training_stop`, so the checkpoint is written by
  `Trainer._save_checkpoint` exactly as a `save_steps` one (model, optimizer, scheduler, RNG, trl-aspo state,
  rollout state) and the loop ends as at `max_steps`; `stopped` then holds the signal and the step.

A SIGINT at least 1 s after the first signal raises `KeyboardInterrupt` (stop at once, no checkpoint); every other
repeated signal is ignored (`trl_aspo.infra.stop_signals.StopRequest`). If no stop boundary is reached within
`stop_grace_s` (a hung process), a timer prints `expired_message` and exits with `EXIT_STOPPED` (75) without a new
checkpoint.

`GracefulStopMixin.train` installs the handlers at train begin (main thread only) and restores the previous ones when
`train` returns or raises; a handler the user installed is replaced with a warning. The handlers are opt-in in the
Python API (add a `GracefulStop` callback); `trl-aspo train` adds one.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

import torch
from transformers import TrainerCallback

from trl_aspo.config.fields import ASYNC
from trl_aspo.infra.stop_signals import EXIT_STOPPED, StopRequest, note, signal_numbers


class GracefulStop(TrainerCallback):
    """Stop a run on the config's `stop_signals` at its `stop_at` boundary, all ranks alike, with a checkpoint (the
    module docstring). `expired_message(head)` is the line printed when `stop_grace_s` passes first, `head` saying
    so (default: `head` and the latest complete checkpoint). After `train` returns, `stopped` is (signal name, step,
    the boundary's name) if the run stopped on a signal."""

    def __init__(self, expired_message: Callable[[str], str] | None = None):
        self.expired_message = expired_message
        self.trainer = None
        self.request: StopRequest | None = None
        self.timer: threading.Timer | None = None
        self.stopped: tuple[str, int] | None = None

    # --------------------------------------------------------------------------------- train begin / end (the mixin)
    def begin(self, trainer) -> None:
        args = trainer.args
        numbers = signal_numbers(args.stop_signals)
        names = [number.name[3:] for number in numbers]
        if names and args.enable_jit_checkpoint:
            raise ValueError(
                f"{type(args).__name__}.enable_jit_checkpoint=True is invalid with GracefulStop (stop_signals="
                f"{names}): transformers' JIT checkpoint installs its own SIGTERM handler; one handler only: set "
                "enable_jit_checkpoint=False or stop_signals=[]."
            )
        self.trainer, self.stopped = trainer, None
        self.request = StopRequest(numbers, self._first_signal) if numbers else None
        if self.request is not None and not self.request.install("GracefulStop"):
            self.request = None

    def end(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.request is not None:
            self.request.restore()

    def _first_signal(self, signum: int) -> None:
        args = self.trainer.args
        boundary = self.boundary_name()
        where = "the end of this optimizer step" if args.stop_at == "step" else f"the next {boundary.split(' ', 1)[1]}"
        if self.trainer.accelerator.is_main_process:
            note(
                f"{signal.Signals(signum).name} received: stopping at {where} with a checkpoint (stop_at: "
                f"{args.stop_at}, within stop_grace_s={args.stop_grace_s:g} s)."
            )
        self.timer = threading.Timer(args.stop_grace_s, self._expired)
        self.timer.daemon = True
        self.timer.start()

    def _expired(self) -> None:
        from trl_aspo.trainers.resume import latest_checkpoint

        grace = self.trainer.args.stop_grace_s
        head = f"No stop boundary within stop_grace_s={grace:g} s: exited without a new checkpoint"
        if self.trainer.accelerator.is_main_process:
            if self.expired_message is not None:
                note(self.expired_message(head))
            else:
                latest = latest_checkpoint(self.trainer.args.output_dir)
                note(f"{head}; latest complete checkpoint: {os.path.abspath(latest) if latest else 'none'}")
        os._exit(EXIT_STOPPED)

    # ------------------------------------------------------------------------------------------------- the boundary
    def boundary_name(self) -> str:
        if self.trainer.args.stop_at == "step":
            return "the end of an optimizer step"
        if getattr(self.trainer.args, "_trainer", None) == ASYNC:
            return "a rollout-batch boundary"
        return "a generation-round boundary"

    def at_boundary(self) -> bool:
        trainer, args = self.trainer, self.trainer.args
        if args.stop_at == "step":
            return True
        if getattr(args, "_trainer", None) == ASYNC:
            return trainer.state.global_step % getattr(args, "steps_per_rollout_batch", 1) == 0
        # TRL generates a new round when its micro-step counter `_step` is a multiple of this (GRPOTrainer
        # `_prepare_inputs`); after a mid-round resume the rounds count from the resumed step, as `_step` does.
        return trainer._step % (args.steps_per_generation * trainer.num_iterations) == 0

    def agreed_signal(self) -> int:
        """The stop signal of any rank (0: none), the same on every rank."""
        own = self.request.signum if self.request is not None and self.request.signum is not None else 0
        accelerator = self.trainer.accelerator
        if accelerator.num_processes == 1:
            return own
        return int(accelerator.gather(torch.tensor([own], device=accelerator.device)).max())

    def on_step_end(self, args, state, control, **kwargs):
        if self.trainer is None or not self.at_boundary():
            return
        signum = self.agreed_signal()
        # At max_steps the loop ends anyway: the run finishes as usual (final save_model included), not as a stop.
        if signum and state.global_step < state.max_steps:
            control.should_save = True
            control.should_training_stop = True
            self.stopped = (signal.Signals(signum).name, state.global_step, self.boundary_name())


class GracefulStopMixin:
    """`train`: installs the handlers of every `GracefulStop` callback for the run and restores the previous ones when
    it returns or raises (a callback's `on_train_end` is skipped by an exception)."""

    def train(self, *args, **kwargs):
        # A trainer built without Trainer.__init__ (a test's bare one) has no callbacks yet.
        handler = getattr(self, "callback_handler", None)
        stops = [callback for callback in getattr(handler, "callbacks", []) if isinstance(callback, GracefulStop)]
        for stop in stops:
            stop.begin(self)
        try:
            return super().train(*args, **kwargs)
        finally:
            for stop in stops:
                stop.end()
