"""Training curves from a `Trainer.state.log_history`, saved as one PNG, and the comparison figure of several runs.

Both figures name their panels the same way (`panel_title`), show integer optimizer steps, and leave out a metric
that is zero at every logged step (saying so under the figure): SPO++ with one completion per prompt, for example,
has no zero-advantage samples by construction, so that panel would be a flat line at 0.
"""

from __future__ import annotations

import math
import os

DEFAULT_METRICS = (
    "reward",
    "loss",
    "entropy",
    "zero_advantage_share",
    "tools/tool_call_frac",
    "tools/first_call_position",
    "tools/failure_frequency",
    "aspo/flip_weight_mean",
    "value/mean",
    ("offpolicy/staleness_mean", "offpolicy/staleness_max"),
    ("offpolicy/is_weight_mean", "offpolicy/ess", "offpolicy/clipped_frac_pos", "offpolicy/clipped_frac_neg"),
)
# Titles of the panels that draw several metrics (a tuple of `metrics`), each metric its own line.
GROUP_TITLES = {
    ("offpolicy/staleness_mean", "offpolicy/staleness_max"): "staleness (model versions)",
    (
        "offpolicy/is_weight_mean",
        "offpolicy/ess",
        "offpolicy/clipped_frac_pos",
        "offpolicy/clipped_frac_neg",
    ): "rollout IS weight",
}
# The panel of held-out evaluations: before and after training, and during it where `heldout/accuracy` is logged.
HELDOUT_ACCURACY = "heldout/accuracy"
# Training wall-clock seconds of a log row (trl_aspo.cli.callbacks.TRAIN_SECONDS), the x of `x_axis="seconds"`.
TRAIN_SECONDS = "train_seconds"
# `log_timing`'s metrics (trl_aspo.trainers.step_timing, named here because that module imports torch): seconds of
# the trainers' own work per optimizer step, the step's wall time, and the value pre-pass's (once, not per step).
TIMING_PREFIX = "timing/"
STEP_SECONDS = "timing/step_s"
VALUE_PREPASS_SECONDS = "timing/value_prepass_s"
# Panel titles of logged metrics; any other key is its own title.
PANEL_TITLES = {
    "reward": "training reward",
    HELDOUT_ACCURACY: "held-out accuracy",
    "loss": "loss",
    "entropy": "entropy",
    "zero_advantage_share": "zero-advantage share",
    "tools/tool_call_frac": "tool-call rate",
    "tools/first_call_position": "first tool-call position (tokens)",
    "tools/calls_per_completion": "tool calls per completion",
    "tools/failure_frequency": "failed tool calls per completion",
    "aspo/flip_weight_mean": "ASPO flipped-ratio weight",
    "value/mean": "tracker value (mean)",
    "repetition_rate": "repetition rate",
}
# Line styles told apart without colour, so variants with the same curve stay visible on top of each other.
LINE_STYLES = (("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"), ((0, (5, 1, 1, 1)), "v"), ((0, (1, 3)), "P"))


def panel_title(key: str | tuple[str, ...]) -> str:
    if isinstance(key, tuple):
        return GROUP_TITLES.get(key, " / ".join(key))
    return PANEL_TITLES.get(key, key)


def is_constant_zero(values) -> bool:
    values = list(values)
    return bool(values) and all(value == 0 for value in values)


def integer_steps(axis) -> None:
    """Tick marks at whole optimizer steps (or completions): a 4-step run gets 0, 1, 2, 3, 4 instead of 0.5s."""
    from matplotlib.ticker import MaxNLocator

    axis.xaxis.set_major_locator(MaxNLocator(integer=True))


def heldout_text(heldout: dict | None) -> str | None:
    """'held-out accuracy 24.2% before, 63.4% after' from {"initial": ..., "final": ...} (None if neither)."""
    heldout = heldout or {}
    parts = [
        f"{heldout[moment]:.1%} {word}"
        for moment, word in (("initial", "before"), ("final", "after"))
        if heldout.get(moment) is not None
    ]
    return "held-out accuracy " + ", ".join(parts) if parts else None


def plot_training_curves(
    log_history: list[dict],
    output_dir: str,
    metrics=DEFAULT_METRICS,
    title: str | None = None,
    heldout: dict | None = None,
) -> str:
    """Plot every metric of `metrics` that the log history holds, one panel each, against the optimizer step; a
    tuple of metrics shares one panel, a line each (the logged ones among them).

    The figure's title is `title` (e.g. the config name and its methods) with `heldout`'s before/after accuracy
    ({"initial": fraction, "final": fraction}, either optional); metrics zero at every step are listed, not drawn. A
    run that logged `timing/*` (`log_timing`) gets a last panel: each timed region's share of the step, stacked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = {}
    for key in metrics:
        lines = {name: metric_points(log_history, name) for name in (key if isinstance(key, tuple) else (key,))}
        panels[key] = {name: points for name, points in lines.items() if points}
    zero = [
        key for key, lines in panels.items() if lines and all(is_constant_zero(p.values()) for p in lines.values())
    ]
    present = [key for key, lines in panels.items() if lines and key not in zero]
    timed = _has_timing({"history": log_history})
    count = len(present) + timed
    columns = min(3, max(1, count))
    rows = max(1, -(-count // columns))
    figure, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.0 * rows + 0.8), squeeze=False)
    for axis, key in zip(axes.flat, present, strict=False):
        for name, points in panels[key].items():
            steps = sorted(points)
            axis.plot(steps, [points[step] for step in steps], marker=".", linewidth=1.2, label=name)
        if isinstance(key, tuple):
            axis.legend(fontsize=7)
        axis.set_title(panel_title(key), fontsize=10)
        axis.set_xlabel("optimizer step")
        integer_steps(axis)
        axis.grid(alpha=0.3)
    if timed:
        axis = list(axes.flat)[len(present)]
        _plot_timing_shares(axis, "", [{"history": log_history}], lambda step: step, smoothing=1)
        axis.set_title("trl-aspo's own time, share of the step", fontsize=10)
        axis.set_xlabel("optimizer step")
        integer_steps(axis)
        axis.grid(alpha=0.3)
    for axis in list(axes.flat)[count:]:
        axis.axis("off")
    heading = "; ".join(text for text in (title, heldout_text(heldout)) if text)
    if heading:
        figure.suptitle(heading, fontsize=11)
    _note_left_out(figure, zero)
    figure.tight_layout(rect=(0, 0.04 if zero else 0, 1, 1))
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "training_curves.png")
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _note_left_out(figure, zero: list[str]) -> None:
    if zero:
        names = ", ".join(panel_title(name) for name in zero)
        figure.text(0.01, 0.01, f"Not drawn, zero at every logged step: {names}.", fontsize=8, color="0.35")


# Panels of the comparison figure, in order (extra `metrics` follow).
COMPARISON_PANELS = tuple(
    (key, panel_title(key))
    for key in ("reward", HELDOUT_ACCURACY, "entropy", "tools/first_call_position", "zero_advantage_share")
)


def metric_points(history: list[dict], key: str) -> dict[int, float]:
    """Optimizer step -> logged value of `key` (rows without the key, such as the final train summary, skipped)."""
    return {row["step"]: float(row[key]) for row in history if row.get(key) is not None and "step" in row}


def has_train_seconds(history: list[dict]) -> bool:
    """Whether a log history carries `train_seconds` (compare runs log it), so it can be drawn against time."""
    return any(row.get(TRAIN_SECONDS) is not None and "step" in row for row in history)


def step_seconds(history: list[dict]) -> dict[int, float]:
    """Optimizer step -> training seconds at that step, interpolated linearly between logged rows (a held-out row
    or a step that logged no time gets the time of its step)."""
    known = metric_points(history, TRAIN_SECONDS)
    steps = sorted(known)
    if not steps:
        return {}
    table = {}
    for first, second in zip([0, *steps], steps, strict=False):
        start = known.get(first, 0.0)
        for step in range(first, second + 1):
            table[step] = start + (known[second] - start) * (step - first) / max(1, second - first)
    return table


def timing_shares(history: list[dict]) -> dict[str, dict[int, float]]:
    """Region -> optimizer step -> the region's share of the step's wall time (`timing/*_s` over `timing/step_s`),
    for every timed region of a log history (not the step itself, nor the value pre-pass, which precedes training).
    A step that logged its wall time but not a region gives that region 0 (it had not run yet)."""
    steps = {step: seconds for step, seconds in metric_points(history, STEP_SECONDS).items() if seconds > 0}
    regions = sorted(
        {key for row in history for key in row if key.startswith(TIMING_PREFIX)}
        - {STEP_SECONDS, VALUE_PREPASS_SECONDS}
    )
    shares = {}
    for region in regions:
        seconds = metric_points(history, region)
        shares[region] = {step: seconds.get(step, 0.0) / wall for step, wall in steps.items()}
    return shares


def timing_label(region: str) -> str:
    """'timing/advantages_s' -> 'advantages'."""
    return region.removeprefix(TIMING_PREFIX).removesuffix("_s")


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
    x_axis: str = "completions",
) -> str:
    """One figure comparing variants: per panel, each variant's mean curve over its runs and a +-1 sd band.

    `variants` maps a label to its runs; a run is `{"history": log_history, "completions_per_step": int | None,
    "heldout": {"initial": float | None, "final": float | None}}` (held-out optional). With `x_axis="completions"`
    the x axis is completions generated (steps when a run's completions per step is unknown); with `"seconds"` it is
    training wall-clock seconds (`train_seconds` of the log rows, mean over a variant's runs at each step). Panels
    whose metric no run logged are left out, so any TRL run plots what it has. Training curves are smoothed with a
    trailing `smoothing`-step mean per run; held-out points are not. A variant whose runs log `timing/*`
    (`log_timing`) gets a panel of its own: the trainers' own work stacked as shares of the step's wall time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [run for group in variants.values() for run in group]
    panels = [
        *COMPARISON_PANELS,
        *((key, panel_title(key)) for key in extra_metrics if key not in dict(COMPARISON_PANELS)),
    ]
    logged = {key: [metric_points(run["history"], key) for run in runs] for key, _ in panels}
    zero = [
        key
        for key, _ in panels
        if key != HELDOUT_ACCURACY
        and any(logged[key])
        and is_constant_zero(value for points in logged[key] for value in points.values())
    ]
    panels = [
        (key, label)
        for key, label in panels
        if (key == HELDOUT_ACCURACY and any(_has_heldout(run) for run in runs))
        or (key != HELDOUT_ACCURACY and any(logged[key]) and key not in zero)
    ]
    if not panels:
        raise ValueError("None of the runs logged any nonzero metric to plot (empty log_history?).")
    if x_axis not in ("completions", "seconds"):
        raise ValueError(f"x_axis must be 'completions' or 'seconds', got {x_axis!r}")
    by_seconds = x_axis == "seconds"
    if by_seconds and not all(has_train_seconds(run["history"]) for run in runs):
        raise ValueError("x_axis='seconds' needs train_seconds in every run's log history (a compare run logs it)")
    by_completions = not by_seconds and all(run.get("completions_per_step") for run in runs)
    x_label = (
        "training seconds (wall clock)"
        if by_seconds
        else "completions generated"
        if by_completions
        else "optimizer step"
    )
    timed = {name: group for name, group in variants.items() if any(_has_timing(run) for run in group)}
    count = len(panels) + len(timed)
    columns = min(3, count)
    rows = -(-count // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, 3.3 * rows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = {
        name: (colors[index % len(colors)], *LINE_STYLES[index % len(LINE_STYLES)])
        for index, name in enumerate(variants)
    }
    for axis, (key, label) in zip(axes.flat, panels, strict=False):
        for index, (name, group) in enumerate(variants.items()):
            color, linestyle, marker = styles[name]
            # Earlier variants drawn wider, markers at staggered points: a curve equal to another still shows.
            width = max(1.0, 2.6 - 0.5 * index)
            to_x = _x_of_step(group, by_seconds, by_completions)
            if key == HELDOUT_ACCURACY:
                _plot_heldout(axis, group, to_x, color, name, marker, markersize=2.5 * width + 2)
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
            x = [to_x(step) for step in steps]
            every = max(len(variants), len(x) // 6)
            axis.plot(
                x,
                means,
                color=color,
                linestyle=linestyle,
                marker=marker,
                markevery=(index % every, every) if len(x) > every else None,
                markersize=4,
                linewidth=width,
                alpha=0.85,
                label=f"{name} (n={len(series)})",
            )
            low = [m - s for m, s in zip(means, spreads, strict=True)]
            high = [m + s for m, s in zip(means, spreads, strict=True)]
            axis.fill_between(x, low, high, color=color, alpha=0.15, linewidth=0)
        axis.set_title(label, fontsize=10)
        axis.set_xlabel(x_label)
        if not by_seconds:
            integer_steps(axis)
        axis.grid(alpha=0.3)
    _heldout_over_training(
        dict(zip((key for key, _ in panels), axes.flat, strict=False)), variants, by_seconds, by_completions
    )
    for axis, (name, group) in zip(list(axes.flat)[len(panels) :], timed.items(), strict=False):
        _plot_timing_shares(axis, name, group, _x_of_step(group, by_seconds, by_completions), smoothing)
        axis.set_xlabel(x_label)
        if not by_seconds:
            integer_steps(axis)
        axis.grid(alpha=0.3)
    for axis in list(axes.flat)[count:]:
        axis.axis("off")
    # One legend for the figure, from a training-curve panel: every variant with its line style and run count.
    handles, labels = _legend_entries(axes.flat[: len(panels)])
    # Above the note of the panels not drawn, which takes the figure's bottom line.
    figure.legend(
        handles,
        labels,
        loc="lower center",
        bbox_to_anchor=(0.5, 0.025 if zero else 0.0),
        ncol=min(4, len(labels)) or 1,
        fontsize=8,
        frameon=False,
    )
    suffix = f"mean +- 1 sd over runs; training curves: {smoothing}-step running mean"
    figure.suptitle(f"{title}\n{suffix}" if title else suffix, fontsize=10)
    _note_left_out(figure, zero)
    legend_rows = -(-len(labels) // 4) if labels else 0
    figure.tight_layout(rect=(0, 0.05 * legend_rows + (0.03 if zero else 0), 1, 1))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _has_timing(run: dict) -> bool:
    return any(timing_shares(run["history"]).values())


def _plot_timing_shares(axis, name: str, group: list[dict], to_x, smoothing: int) -> None:
    """One variant's timed regions (`log_timing`) stacked, each its share of the optimizer step's wall time: the mean
    over the variant's runs that logged it, smoothed as the training curves are, at the steps every region has."""
    per_run = [timing_shares(run["history"]) for run in group]
    regions = sorted({region for shares in per_run for region, points in shares.items() if points})
    means = {}
    for region in regions:
        series = []
        for shares in per_run:
            points = shares.get(region) or {}
            if points:
                steps = sorted(points)
                series.append(dict(zip(steps, running_mean([points[s] for s in steps], smoothing), strict=True)))
        steps, values, _ = mean_and_spread(series)
        means[region] = dict(zip(steps, values, strict=True))
    steps = sorted(set.intersection(*(set(points) for points in means.values())))
    axis.stackplot(
        [to_x(step) for step in steps],
        *([means[region][step] for step in steps] for region in regions),
        labels=[timing_label(region) for region in regions],
        alpha=0.8,
    )
    axis.set_title(f"{name}: trl-aspo's own time, share of the step", fontsize=10)
    axis.yaxis.set_major_formatter(_percent_formatter())
    axis.legend(fontsize=7, loc="upper right")


def _has_heldout(run: dict) -> bool:
    heldout = run.get("heldout") or {}
    during = metric_points(run["history"], HELDOUT_ACCURACY)
    return heldout.get("initial") is not None or heldout.get("final") is not None or bool(during)


def _heldout_over_training(axes: dict, variants: dict[str, list[dict]], by_seconds: bool, by_completions: bool):
    """Give the held-out panel the x range of training, from 0 (the starting model) to the last step: its points,
    a few evaluations, would otherwise set the range themselves (one final point at step 128: 122 to 134)."""
    axis = axes.get(HELDOUT_ACCURACY)
    if axis is None:
        return
    ends = [
        _x_of_step(group, by_seconds, by_completions)(max((row.get("step", 0) for row in run["history"]), default=0))
        for group in variants.values()
        for run in group
    ]
    ends = [end for end in ends if math.isfinite(end)]
    lefts_rights = [other.get_xlim() for key, other in axes.items() if key != HELDOUT_ACCURACY]
    left = min([0.0, *(low for low, _ in lefts_rights)])
    right = max([*ends, *(high for _, high in lefts_rights)], default=0.0)
    if right > left:
        if not lefts_rights:
            margin = 0.05 * (right - left)
            left, right = left - margin, right + margin
        axis.set_xlim(left, right)


def _legend_entries(axes) -> tuple[list, list[str]]:
    """Legend handles and labels of the panel naming the most variants, a training curve's (line styles) first."""
    entries = [(axis.get_legend_handles_labels(), axis.get_title() == panel_title(HELDOUT_ACCURACY)) for axis in axes]
    entries.sort(key=lambda entry: (-len(entry[0][1]), entry[1]))
    return entries[0][0] if entries else ([], [])


def _x_of_step(group: list[dict], by_seconds: bool, by_completions: bool):
    """The x of an optimizer step for a variant's runs: mean training seconds at that step, completions generated,
    or the step itself."""
    if by_seconds:
        tables = [step_seconds(run["history"]) for run in group]

        def seconds(step: int) -> float:
            values = [table[step] for table in tables if step in table]
            return sum(values) / len(values) if values else float("nan")

        return seconds
    scale = group[0].get("completions_per_step") if by_completions else 1
    return lambda step: step * scale


def _plot_heldout(
    axis, group: list[dict], to_x, color: str, name: str, marker: str = "o", markersize: float = 6
) -> None:
    """Held-out accuracy before training (x = 0), at each step it was logged during training (`heldout/accuracy`
    rows), and after training, mean with +-1 sd error bars over the runs that have the point."""
    values_at: dict[int, list[float]] = {}
    for run in group:
        heldout = run.get("heldout") or {}
        last_step = max((row.get("step", 0) for row in run["history"]), default=0)
        points = {0: heldout.get("initial"), **metric_points(run["history"], HELDOUT_ACCURACY)}
        points[last_step] = heldout.get("final", points.get(last_step))
        for step, value in points.items():
            if value is not None:
                values_at.setdefault(step, []).append(value)
    points = []
    for step in sorted(values_at):
        _, (mean,), (spread,) = mean_and_spread([{0: v} for v in values_at[step]])
        points.append((0.0 if step == 0 else to_x(step), mean, spread))
    if points:
        xs, means, spreads = zip(*points, strict=True)
        axis.errorbar(
            xs,
            means,
            yerr=spreads,
            color=color,
            marker=marker,
            markersize=markersize,
            capsize=3,
            alpha=0.8,
            label=name,
        )
        axis.yaxis.set_major_formatter(_percent_formatter())


def _percent_formatter():
    """Percent tick labels of a fraction axis with the fewest decimals (0 to 4) that write every tick exactly, so
    that no two labels are alike: an axis spanning 24%-26% in steps of 0.25% is labelled 24.00%, 24.25%, ...
    rather than 24%, 24%, 25%, 25%, 26%."""
    from matplotlib.ticker import PercentFormatter

    def exact(percent: float, decimals: int) -> bool:
        return abs(round(percent, decimals) - percent) <= 1e-9 * max(1.0, abs(percent))

    class ExactPercentFormatter(PercentFormatter):
        def set_locs(self, locs):
            super().set_locs(locs)
            percents = [100.0 * loc for loc in locs]
            self.decimals = next((d for d in range(5) if all(exact(p, d) for p in percents)), 4)

    return ExactPercentFormatter(xmax=1.0, decimals=0)


def mean_weight_grid(grid: dict) -> list[list[float]]:
    """The mean weight ``weight_sum / count`` per cell of one sign's grid of `weight_map.json` (NaN where empty)."""
    return [
        [total / count if count > 0 else float("nan") for total, count in zip(sums, counts, strict=True)]
        for sums, counts in zip(grid["weight_sum"], grid["count"], strict=True)
    ]


def plot_weight_maps(maps: dict[str, dict], path: str) -> str:
    """The ASPO weight map (arXiv 2510.06062) of each run, side by side: a column per run, a row per advantage sign
    (A > 0 on top), each cell the mean gradient weight w of the tokens in that (old probability, current
    probability) bin over the whole run (the `total` of `weight_map.json`), on one colour scale. Tokens on the
    diagonal kept their probability (r = 1); below it (current > old) the ratio r > 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    signs = (("positive", "A > 0"), ("negative", "A < 0"))
    means = {
        label: {sign: np.array(mean_weight_grid(state["total"][sign])) for sign, _ in signs}
        for label, state in maps.items()
    }
    finite = [grid[np.isfinite(grid)] for by_sign in means.values() for grid in by_sign.values()]
    vmax = max([float(values.max()) for values in finite if values.size] or [1.0])
    figure, axes = plt.subplots(
        2, len(maps), figsize=(4.4 * len(maps) + 1.4, 9.0), squeeze=False, layout="constrained"
    )
    image = None
    for column, (label, state) in enumerate(maps.items()):
        for row, (sign, sign_text) in enumerate(signs):
            axis, grid = axes[row, column], means[label][sign]
            image = axis.imshow(
                np.ma.masked_invalid(grid), origin="lower", extent=(0, 1, 0, 1), cmap="viridis", vmin=0.0, vmax=vmax
            )
            bins = state["bins"]
            for i in range(bins):
                for j in range(bins):
                    if np.isfinite(grid[i, j]):
                        color = "black" if grid[i, j] > 0.6 * vmax else "white"
                        axis.text(
                            (j + 0.5) / bins,
                            (i + 0.5) / bins,
                            f"{grid[i, j]:.2f}",
                            ha="center",
                            va="center",
                            fontsize=6,
                            color=color,
                        )
            axis.plot((0, 1), (0, 1), color="white", linewidth=0.6, linestyle=":")
            tokens = int(sum(map(sum, state["total"][sign]["count"])))
            axis.set_title(f"{label} (loss_type={state['loss_type']})\n{sign_text}: {tokens} tokens", fontsize=9)
            axis.set_xlabel("current probability pi")
            axis.set_ylabel("old probability pi_old")
    figure.colorbar(image, ax=axes.ravel().tolist(), label="mean gradient weight w (coefficient of -A grad log pi)")
    figure.suptitle("ASPO weight map: mean per-token gradient weight by (old, current) probability bin")
    figure.savefig(path, dpi=130)
    plt.close(figure)
    return path
