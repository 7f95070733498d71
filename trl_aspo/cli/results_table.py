"""The results table of `trl-aspo compare`: per variant, the mean +- sd over seeds of each run's reward-curve area,
end-of-training metric levels, held-out numbers and training minutes (`results.md` / `results.json`)."""

from __future__ import annotations

import math

# Logged metrics whose end-of-training value goes into the table (when logged).
TABLE_METRICS = ("reward", "entropy", "tools/first_call_position", "tools/tool_call_frac", "zero_advantage_share")
HELDOUT_METRICS = (
    ("accuracy", "held-out accuracy"),
    ("tool_call_rate", "held-out tool-call rate"),
    ("mean_first_call_position", "held-out first-call position"),
)
# Table rows that are fractions, shown as percentages as in docs/experiments.md (results.json keeps the fractions).
PERCENT_ROWS = ("held-out accuracy", "held-out tool-call rate")


def tail_mean(history: list[dict], key: str, fraction: float = 0.1) -> float:
    """Mean of the last `fraction` of a metric's logged values (at least one): the end-of-training level."""
    values = [row[key] for row in history if row.get(key) is not None and "step" in row]
    if not values:
        return math.nan
    tail = values[-max(1, round(fraction * len(values))) :]
    return sum(tail) / len(tail)


def run_numbers(summary: dict, metrics: list[str]) -> dict[str, float]:
    """One run's table row: reward-curve area, end-of-training metric levels, held-out numbers, minutes."""
    history = summary["history"]
    rewards = [row["reward"] for row in history if row.get("reward") is not None and "step" in row]
    numbers = {"reward-curve area (mean training reward)": sum(rewards) / len(rewards) if rewards else math.nan}
    for key in dict.fromkeys([*TABLE_METRICS, *metrics]):
        numbers[f"{key}, last 10% of steps"] = tail_mean(history, key)
    for key, label in HELDOUT_METRICS:
        numbers[label] = (summary.get("heldout") or {}).get(key, math.nan)
    numbers["training minutes"] = summary["train_minutes"]
    return numbers


def mean_sd(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return math.nan, math.nan
    mean = sum(values) / len(values)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return mean, sd


def results_table(results: dict[str, list[dict]], metrics: list[str], initial: dict | None) -> tuple[str, dict]:
    """Markdown table, mean +- sd over seeds per variant (rows nothing logged are left out), and its numbers."""
    numbers = {variant: [run_numbers(summary, metrics) for summary in runs] for variant, runs in results.items()}
    rows = list(next(iter(numbers.values()))[0]) if numbers and next(iter(numbers.values())) else []
    aggregated = {
        variant: {row: mean_sd([run.get(row, math.nan) for run in runs]) for row in rows}
        for variant, runs in numbers.items()
    }
    seeds = {variant: len(runs) for variant, runs in results.items()}
    names = list(results)
    with_initial = initial is not None
    header = "| metric |" + (" initial |" if with_initial else "") + "".join(f" {n} (n={seeds[n]}) |" for n in names)
    lines = [header, "|---|" + ("---:|" if with_initial else "") + "---:|" * len(names)]
    heldout_keys = {label: key for key, label in HELDOUT_METRICS}
    for row in rows:
        if all(math.isnan(aggregated[name][row][0]) for name in names):
            continue
        cells = []
        percent = row in PERCENT_ROWS
        if with_initial:
            value = initial.get(heldout_keys[row], math.nan) if row in heldout_keys else math.nan
            cells.append(_cell(value, math.nan, percent))
        cells += [_cell(*aggregated[name][row], percent) for name in names]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines), {"per_run": numbers, "mean_sd": aggregated}


def _cell(mean: float, sd: float, percent: bool = False) -> str:
    """'0.412 ± 0.031', or '41.2% ± 3.1' (sd in percentage points, as docs/experiments.md tables) for a fraction shown
    as a percentage; 'n/a' for no number."""
    if mean is None or math.isnan(mean):
        return "n/a"
    if percent:
        return f"{mean:.1%}" if math.isnan(sd) else f"{mean:.1%} ± {100 * sd:.1f}"
    return f"{mean:.3f}" if math.isnan(sd) else f"{mean:.3f} ± {sd:.3f}"
