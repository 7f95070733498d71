"""A one-line-per-run progress bar for experiment scripts, showing chosen metrics instead of a dict per step."""

from __future__ import annotations

from tqdm.auto import tqdm
from transformers import TrainerCallback


class MetricProgressCallback(TrainerCallback):
    """tqdm bar over optimizer steps whose postfix shows `metrics` (label -> logged key) from the latest log.

    Use it in place of transformers' `ProgressCallback`: `trainer.remove_callback(ProgressCallback)` first."""

    def __init__(self, description: str, metrics: dict[str, str]):
        self.description, self.metrics, self.bar = description, metrics, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.bar = tqdm(total=state.max_steps, desc=self.description, unit="step")

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "reward" in logs:
            values = {label: logs.get(key) for label, key in self.metrics.items()}
            self.bar.set_postfix({label: "n/a" if v is None else f"{v:.2f}" for label, v in values.items()})

    def on_step_end(self, args, state, control, **kwargs):
        self.bar.update(1)

    def on_train_end(self, args, state, control, **kwargs):
        self.bar.close()
