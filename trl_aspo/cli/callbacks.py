"""Callbacks of `trl-aspo compare` runs: held-out accuracy during training, and training time in every log row.

Both write into `trainer.state.log_history` (so into `trainer_state.json` and the run summary), which the comparison
figure reads: `heldout/*` rows give the held-out curve over training, `train_seconds` the wall-clock x axis.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from transformers import TrainerCallback

from trl_aspo.evaluation.report import generation_attention

# evaluate_tool_use summary key -> logged key.
HELDOUT_LOG_KEYS = {
    "accuracy": "heldout/accuracy",
    "tool_call_rate": "heldout/tool_call_rate",
    "mean_first_call_position": "heldout/first_call_position",
    "calls_per_completion": "heldout/calls_per_completion",
}
TRAIN_SECONDS = "train_seconds"


class HeldoutDuringTraining(TrainerCallback):
    """Evaluates the policy on the held-out split every `every_steps` optimizer steps (not at the last step, which
    the comparison evaluates after training) and appends `{"step": s, "heldout/...": ...}` to the log history.

    `evaluate(model, tokenizer)` returns an `evaluate_tool_use` summary; it runs on every rank, each generating the
    same completions, under `torch.random.fork_rng` (inside `evaluate_tool_use`), so training's random stream is not
    changed by it, and every rank logs the same row. Every rank must take part: under FSDP2 each forward of the
    sharded model all-gathers its layers (and under DeepSpeed ZeRO-3 the engine's hooks gather each layer's
    partition), so a forward on the main process alone waits forever for the others.
    `seconds` is the time spent evaluating, which `TrainingClock` leaves out."""

    def __init__(self, every_steps: int, evaluate: Callable[[object, object], dict]):
        self.every_steps, self.evaluate, self.seconds = every_steps, evaluate, 0.0

    def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        step = state.global_step
        if step % self.every_steps or step >= state.max_steps:
            return
        start = time.perf_counter()
        # DDP wraps the model (`.module`); FSDP2 shards it in place and ZeRO-3 hooks it, the model itself.
        unwrapped = getattr(model, "module", model)
        with generation_attention(unwrapped) as generating:
            summary = self.evaluate(generating, processing_class)
        self.seconds += time.perf_counter() - start
        row = {"step": step, **{key: summary[name] for name, key in HELDOUT_LOG_KEYS.items() if name in summary}}
        state.log_history.append(row)


class TrainingClock(TrainerCallback):
    """Adds `train_seconds` to every log row: wall-clock seconds since training began, less the time `paused()`
    reports (held-out evaluation during training), so curves against time compare training alone."""

    def __init__(self, paused: Callable[[], float] = lambda: 0.0):
        self.paused, self.start = paused, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kwargs):
        # Trainer.log appends the row to log_history before calling on_log, so the row is completed in place.
        if self.start is not None and state.log_history:
            state.log_history[-1][TRAIN_SECONDS] = time.perf_counter() - self.start - self.paused()
