"""A readable console for training runs: a progress bar with the few numbers a user watches, instead of
transformers' dict of every metric per logging step (every metric still goes to the trackers and the log history).
"""

from __future__ import annotations

from tqdm.auto import tqdm
from transformers import TrainerCallback

# What `trl-aspo train` shows: label -> logged key, in order; keys a run does not log are left out.
TRAIN_CONSOLE_METRICS = {
    "reward": "reward",
    "accuracy": "rewards/correctness_reward/mean",
    "loss": "loss",
    "lr": "learning_rate",
    "tool calls": "tools/tool_call_frac",
}


def format_value(value) -> str:
    """Short text of a logged number: 3 significant digits (scientific below 1e-3, e.g. a learning rate)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if value != 0 and abs(value) < 1e-3:
        return f"{value:.1e}"
    return f"{value:.3g}"


class MetricProgressCallback(TrainerCallback):
    """tqdm bar over optimizer steps whose postfix shows `metrics` (label -> logged key), each at its latest logged
    value, and a one-line summary when training ends.

    Use it in place of transformers' `ProgressCallback`: `trainer.remove_callback(ProgressCallback)` first."""

    def __init__(self, description: str, metrics: dict[str, str]):
        self.description, self.metrics, self.bar = description, metrics, None
        self.latest: dict[str, str] = {}

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc=self.description, unit="step")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.bar is None:
            return
        logs = logs or {}
        if "train_runtime" in logs:
            self.bar.write(
                f"{self.description}: {state.global_step} steps in {logs['train_runtime']:.0f} s "
                f"(mean loss {format_value(logs.get('train_loss', float('nan')))})"
            )
            return
        # Latest value of each: a GRPO step without a generation round logs no reward.
        self.latest.update({label: format_value(logs[key]) for label, key in self.metrics.items() if key in logs})
        if self.latest:
            self.bar.set_postfix({label: self.latest[label] for label in self.metrics if label in self.latest})

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self) -> None:
        """End the bar (also when training stops early, so it is not redrawn after the last message)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
