"""Training curves from a `Trainer.state.log_history`, saved as one PNG."""

from __future__ import annotations

import os

DEFAULT_METRICS = (
    "reward",
    "loss",
    "entropy",
    "zero_advantage_share",
    "tools/tool_call_frac",
    "tools/first_call_position",
    "aspo/flip_weight_mean",
    "value/mean",
)


def plot_training_curves(log_history: list[dict], output_dir: str, metrics=DEFAULT_METRICS) -> str:
    """Plot every metric of `metrics` that the log history holds, one panel each, against the optimizer step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = [name for name in metrics if any(row.get(name) is not None and "step" in row for row in log_history)]
    columns = min(3, max(1, len(present)))
    rows = max(1, -(-len(present) // columns))
    figure, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.0 * rows), squeeze=False)
    for axis, name in zip(axes.flat, present, strict=False):
        points = [(row["step"], row[name]) for row in log_history if row.get(name) is not None and "step" in row]
        axis.plot([step for step, _ in points], [value for _, value in points], marker=".", linewidth=1.2)
        axis.set_title(name, fontsize=10)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    for axis in list(axes.flat)[len(present) :]:
        axis.axis("off")
    figure.tight_layout()
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "training_curves.png")
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
