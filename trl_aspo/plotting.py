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


# Not a logged metric: the panel of held-out evaluations before and after training.
HELDOUT_ACCURACY = "heldout/accuracy"
# Panels of the comparison figure: (log_history key, title).
COMPARISON_PANELS = (
    ("reward", "training reward"),
    (HELDOUT_ACCURACY, "held-out accuracy"),
    ("entropy", "entropy"),
    ("tools/first_call_position", "first tool-call position (tokens)"),
    ("zero_advantage_share", "zero-advantage share"),
)


def metric_points(history: list[dict], key: str) -> dict[int, float]:
    """Optimizer step -> logged value of `key` (rows without the key, such as the final train summary, skipped)."""
    return {row["step"]: float(row[key]) for row in history if row.get(key) is not None and "step" in row}


def running_mean(values: list[float], window: int) -> list[float]:
    """Trailing mean over `window` points: one step's value, from a few dozen completions, is noisy."""
    return [sum(values[max(0, i - window + 1) : i + 1]) / min(i + 1, window) for i in range(len(values))]


def mean_and_spread(series: list[dict[int, float]]) -> tuple[list[int], list[float], list[float]]:
    """Steps logged by every run, the mean over runs and the sample standard deviation (0 for a single run)."""
    steps = sorted(set.intersection(*(set(points) for points in series))) if series else []
    means, spreads = [], []
    for step in steps:
        values = [points[step] for points in series]
        mean = sum(values) / len(values)
        variance = sum((v - mean) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else 0.0
        means.append(mean)
        spreads.append(variance**0.5)
    return steps, means, spreads


def plot_comparison(
    variants: dict[str, list[dict]],
    path: str,
    extra_metrics: tuple[str, ...] = (),
    smoothing: int = 5,
    title: str | None = None,
) -> str:
    """One figure comparing variants: per panel, each variant's mean curve over its runs and a +-1 sd band.

    `variants` maps a label to its runs; a run is `{"history": log_history, "completions_per_step": int | None,
    "heldout": {"initial": float | None, "final": float | None}}` (held-out optional). The x axis is completions
    generated (steps when a run's completions per step is unknown). Panels whose metric no run logged are left out,
    so any TRL run plots what it has. Training curves are smoothed with a trailing `smoothing`-step mean per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [run for group in variants.values() for run in group]
    panels = [*COMPARISON_PANELS, *((key, key) for key in extra_metrics if key not in dict(COMPARISON_PANELS))]
    panels = [
        (key, label)
        for key, label in panels
        if (key == HELDOUT_ACCURACY and any((run.get("heldout") or {}).get("final") is not None for run in runs))
        or any(metric_points(run["history"], key) for run in runs)
    ]
    if not panels:
        raise ValueError("None of the runs logged any metric to plot (empty log_history?).")
    by_completions = all(run.get("completions_per_step") for run in runs)
    x_label = "completions generated" if by_completions else "optimizer step"
    columns = min(3, len(panels))
    rows = -(-len(panels) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, 3.3 * rows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for axis, (key, label) in zip(axes.flat, panels, strict=False):
        for color, (name, group) in zip(colors * 4, variants.items(), strict=False):
            scale = group[0].get("completions_per_step") if by_completions else 1
            if key == HELDOUT_ACCURACY:
                _plot_heldout(axis, group, scale, color, name)
                continue
            series = []
            for run in group:
                points = metric_points(run["history"], key)
                if points:
                    steps = sorted(points)
                    series.append(dict(zip(steps, running_mean([points[s] for s in steps], smoothing), strict=True)))
            steps, means, spreads = mean_and_spread(series)
            if not steps:
                continue
            x = [step * scale for step in steps]
            axis.plot(x, means, color=color, linewidth=1.8, label=f"{name} (n={len(series)})")
            low = [m - s for m, s in zip(means, spreads, strict=True)]
            high = [m + s for m, s in zip(means, spreads, strict=True)]
            axis.fill_between(x, low, high, color=color, alpha=0.2, linewidth=0)
        axis.set_title(label, fontsize=10)
        axis.set_xlabel(x_label)
        axis.grid(alpha=0.3)
    for axis in list(axes.flat)[len(panels) :]:
        axis.axis("off")
    axes.flat[0].legend(fontsize=8)
    suffix = f"mean +- 1 sd over runs; training curves: {smoothing}-step running mean"
    figure.suptitle(f"{title}\n{suffix}" if title else suffix, fontsize=10)
    figure.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _plot_heldout(axis, group: list[dict], scale: int, color: str, name: str) -> None:
    """Held-out accuracy before (x = 0) and after training, mean with +-1 sd error bars over the runs."""
    points = []
    for moment in ("initial", "final"):
        values = [(run.get("heldout") or {}).get(moment) for run in group]
        values = [v for v in values if v is not None]
        if not values:
            continue
        x = 0 if moment == "initial" else max((row.get("step", 0) for row in group[0]["history"]), default=0) * scale
        _, (mean,), (spread,) = mean_and_spread([{0: v} for v in values])
        points.append((x, mean, spread))
    if points:
        xs, means, spreads = zip(*points, strict=True)
        axis.errorbar(xs, means, yerr=spreads, color=color, marker="o", capsize=3, label=name)
