"""The files of a training output folder that `trl-aspo plot` and `trl-aspo compare` read, read bounded and checked.

Every file goes through `trl_aspo.infra.json_files.read_json` (regular files only, at most `MAX_JSON_BYTES`, bad
JSON named with its line), and every field the figures or tables use is checked for its type and range; a bad one is
a `ValueError` naming the file, the field, the value and what is allowed:

- `trainer_state.json`: `log_history` a list of objects, `step` an integer >= 0, each drawn metric a number (NaN
  allowed: a diverged loss is drawn as a gap), shares and held-out accuracies in [0, 1] (or NaN, the mean over
  nothing), `train_seconds` and every `timing/*` (seconds, `log_timing`) >= 0;
- `run_summary.json` (compare) and `initial_evaluation.json`: the same history, held-out accuracies in [0, 1],
  `completions_per_step` > 0;
- `summary.json` (`trl-aspo train` with `evaluate_before_after`): held-out accuracies in [0, 1];
- `weight_map.json`: `bins` an integer in [1, `MAX_WEIGHT_MAP_BINS`], two `bins` x `bins` grids per advantage sign
  of weight sums (finite, >= 0: every loss's weight w is >= 0, trl_aspo.algorithms.weight_map) and token counts
  (whole numbers >= 0).

Checkpoint folders are `checkpoint-<step>` as transformers names them; any other `checkpoint-*` name
(`checkpoint-abc`) is skipped, as `transformers.trainer_utils.get_last_checkpoint` skips it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from trl_aspo.cli.plot import TIMING_PREFIX
from trl_aspo.infra.checkpoint_files import CHECKPOINT_NAME
from trl_aspo.infra.json_files import read_json, require_int, require_list, require_number, require_object

# Held-out accuracies and shares of samples: fractions.
FRACTION_METRICS = ("heldout/accuracy", "heldout/tool_call_rate", "zero_advantage_share")
TRAIN_SECONDS = "train_seconds"
# The summary `trl-aspo compare` writes last into each run's folder (so a finished run is skipped on a restart).
SUMMARY_FILE = "run_summary.json"
# The largest weight-map grid drawn: the trainers write 10 x 10 (WEIGHT_MAP_BINS); each cell is labelled in the figure.
MAX_WEIGHT_MAP_BINS = 100


def latest_checkpoint_file(folder: Path, name: str) -> Path | None:
    """`name` in the highest-numbered `checkpoint-<step>` subfolder of `folder` that has it (other names skipped)."""
    found = [
        (int(match.group(1)), path)
        for path in folder.glob(f"checkpoint-*/{name}")
        if (match := CHECKPOINT_NAME.fullmatch(path.parent.name))
    ]
    return max(found)[1] if found else None


def read_object(path: Path) -> dict:
    """The JSON object in `path` (bounded, checked read)."""
    return require_object(read_json(path), str(path))


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float)


def _fraction(value: Any, path: str, field: str, what: str) -> float:
    """A fraction in [0, 1], or NaN: the mean over nothing (an empty held-out split, a step without samples)."""
    if isinstance(value, float) and math.isnan(value):
        return value
    return require_number(value, path, field, 0.0, 1.0, what)


def check_log_history(history: Any, path: Path, field: str, metrics: tuple[str, ...]) -> list[dict]:
    """`history` (a `log_history`) if it is a list of objects whose `step` is an integer >= 0 and whose `metrics`
    are numbers (NaN allowed), fractions in [0, 1] for `FRACTION_METRICS` and >= 0 for `train_seconds` and the
    `timing/*` seconds."""
    where = str(path)
    for index, row in enumerate(require_list(history, where, field)):
        require_object(row, where, f"{field}[{index}]")
        if "step" in row:
            require_int(row["step"], where, f"{field}[{index}].step", low=0)
        timings = [key for key in row if key.startswith(TIMING_PREFIX)]
        for key in (*metrics, *FRACTION_METRICS, TRAIN_SECONDS, *timings):
            value = row.get(key)
            if value is None:
                continue
            name = f"{field}[{index}][{key!r}]"
            if key in FRACTION_METRICS:
                _fraction(value, where, name, "a fraction in [0, 1]")
            elif key == TRAIN_SECONDS or key.startswith(TIMING_PREFIX):
                require_number(value, where, name, 0.0, None, "a number of seconds >= 0")
            elif not _is_number(value) or (isinstance(value, int) and abs(value) >= 2**1023):
                raise ValueError(f"{where}: {name} must be a number (a logged metric), got {value!r:.60}.")
    return history


def check_accuracy(value: Any, path: Path, field: str) -> float | None:
    """A held-out accuracy: None, or a fraction in [0, 1]."""
    if value is None:
        return None
    return _fraction(value, str(path), field, "a held-out accuracy, a fraction in [0, 1]")


def evaluation_accuracy(evaluation: Any, path: Path, field: str) -> float | None:
    """The `accuracy` of an `evaluate_tool_use` summary stored at `field` of `path` (None where absent)."""
    if evaluation is None:
        return None
    return check_accuracy(require_object(evaluation, str(path), field).get("accuracy"), path, f"{field}.accuracy")


def read_trainer_state(path: Path, metrics: tuple[str, ...]) -> dict:
    """`trainer_state.json` with its `log_history` (default []) checked by `check_log_history`."""
    state = read_object(path)
    state["log_history"] = check_log_history(state.get("log_history", []), path, "log_history", metrics)
    return state


def read_run_summary(path: Path, metrics: tuple[str, ...] = (), require_history: bool = False) -> dict:
    """A compare run's `run_summary.json`: an object whose `history` (required for a figure) is a checked log
    history, `heldout` and `heldout_initial` evaluation summaries (or null) with accuracies in [0, 1], and
    `completions_per_step` a number > 0 (or null)."""
    summary = read_object(path)
    if require_history and "history" not in summary:
        raise ValueError(f"{path}: history is missing (the run's log history, a JSON list).")
    if "history" in summary:
        check_log_history(summary["history"], path, "history", metrics)
    for name in ("heldout", "heldout_initial"):
        evaluation_accuracy(summary.get(name), path, name)
    size = summary.get("completions_per_step")
    if size is not None and (not _is_number(size) or not math.isfinite(size) or size <= 0):
        raise ValueError(f"{path}: completions_per_step must be a number > 0 (or null), got {size!r:.60}.")
    return summary


def read_before_after(path: Path) -> dict[str, float | None]:
    """`{"initial", "final"}` accuracies of the `summary.json` of `trl-aspo train` with `evaluate_before_after`."""
    evaluated = read_object(path)
    return {
        "initial": evaluation_accuracy(evaluated.get("before"), path, "before"),
        "final": evaluation_accuracy(evaluated.get("after"), path, "after"),
    }


def read_initial_evaluation(path: Path) -> float | None:
    """The starting model's held-out accuracy from a comparison's `initial_evaluation.json`."""
    return evaluation_accuracy(read_object(path), path, "the evaluation")


def _grid(value: Any, path: str, field: str, bins: int, whole: bool) -> list[list[float]]:
    rows = require_list(value, path, field)
    if len(rows) != bins or any(not isinstance(row, list) or len(row) != bins for row in rows):
        raise ValueError(f"{path}: {field} must be {bins} lists of {bins} numbers (bins = {bins}).")
    what = "a token count, a whole number >= 0" if whole else "a sum of weights w >= 0, a finite number >= 0"
    for i, row in enumerate(rows):
        for j, cell in enumerate(row):
            number = require_number(cell, path, f"{field}[{i}][{j}]", 0.0, None, what)
            if whole and number != int(number):
                raise ValueError(f"{path}: {field}[{i}][{j}] must be {what}, got {cell!r}.")
    return rows


def check_weight_map(state: Any, path: Path) -> dict:
    """A `weight_map.json` state (`WeightMapLog.state_dict`): `loss_type` a string, `bins` an integer in [1, 100],
    and per advantage sign of `total` a `weight_sum` and a `count` grid of `bins` x `bins` cells."""
    where = str(path)
    require_object(state, where)
    if not isinstance(state.get("loss_type"), str):
        raise ValueError(
            f"{where}: loss_type must be the training loss type (a string), got {state.get('loss_type')!r}."
        )
    bins = require_int(state.get("bins"), where, "bins", 1, MAX_WEIGHT_MAP_BINS, " (probability bins per axis)")
    total = require_object(state.get("total"), where, "total")
    for sign in ("positive", "negative"):
        grids = require_object(total.get(sign), where, f"total.{sign}")
        _grid(grids.get("weight_sum"), where, f"total.{sign}.weight_sum", bins, whole=False)
        _grid(grids.get("count"), where, f"total.{sign}.count", bins, whole=True)
    return state


def as_plot_run(summary: dict) -> dict:
    """The `plot_comparison` run of a compare run's summary (checked on reading: `run_files.read_run_summary`)."""
    heldout = summary.get("heldout") or {}
    initial = summary.get("heldout_initial") or {}
    return {
        "history": summary["history"],
        "completions_per_step": summary.get("completions_per_step"),
        "heldout": {"initial": initial.get("accuracy"), "final": heldout.get("accuracy")},
    }
