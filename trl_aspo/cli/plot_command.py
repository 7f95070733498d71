"""`trl-aspo plot RUN_DIR [RUN_DIR ...]`: the comparison figure of existing runs (any TRL output folder, a
`trl-aspo train` run or a `compare` run), or with `--weights` their ASPO weight maps, written beside the runs: into
the run's folder, or for several runs into the folder that holds them all. The figures are drawn by
`trl_aspo.cli.plot`; the files are read bounded and checked by `trl_aspo.cli.run_files`."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from trl_aspo.cli.config_errors import ConfigurationError, report
from trl_aspo.cli.plot import plot_comparison, plot_weight_maps
from trl_aspo.cli.run_files import SUMMARY_FILE, as_plot_run

# trl_aspo.algorithms.weight_map.WEIGHT_MAP_FILE, named here because that module imports torch and `plot` does not
# need it.
WEIGHT_MAP_FILE = "weight_map.json"


def logged_batch_size(trainer_state: dict, path: Path) -> int | None:
    """`train_batch_size` of a `trainer_state.json` (transformers writes the per-process micro-batch there), or
    None when the file has none (an older transformers, or a run that never started training)."""
    size = trainer_state.get("train_batch_size")
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{path}: train_batch_size must be a positive integer, got {size!r}")
    return size


def load_run(run_dir: str, metrics: tuple[str, ...] = ()) -> dict:
    """A run for `plot_comparison` from any TRL output folder (or one of its checkpoints), its files read bounded
    and checked (trl_aspo.cli.run_files: the panels' metrics and `metrics` must be numbers, accuracies fractions).

    The log history is a compare run's summary's, else `trainer_state.json`'s in the folder, else in its latest
    `checkpoint-<step>` (other `checkpoint-*` names are skipped). Completions per step come from a compare run's
    summary, else from `train_batch_size` in that `trainer_state.json` (one process, one gradient accumulation step
    and one iteration per generation assumed: TRL's defaults). Nothing is unpickled: `training_args.bin` is a
    pickle, and unpickling a file from a folder someone handed over runs their code. Held-out accuracy after
    training comes from a compare run's summary or `summary.json` of `trl-aspo train` with `evaluate_before_after`;
    before training from that `summary.json`, or for a compare run (`<output_dir>/runs/<variant>/seed<S>`) from its
    comparison's `<output_dir>/initial_evaluation.json`; during training from the `heldout/*` rows of the history."""
    from trl_aspo.cli.plot import COMPARISON_PANELS
    from trl_aspo.cli.run_files import (
        latest_checkpoint_file,
        read_before_after,
        read_initial_evaluation,
        read_run_summary,
        read_trainer_state,
    )

    keys = (*(key for key, _ in COMPARISON_PANELS), *metrics)
    folder = Path(run_dir)
    summary_path = folder / SUMMARY_FILE
    if summary_path.exists() or summary_path.is_symlink():
        run = as_plot_run(read_run_summary(summary_path, keys, require_history=True))
        # `compare` adds the starting model's evaluation to the summaries it holds, not to the files it wrote.
        initial = folder.resolve().parent.parent.parent / "initial_evaluation.json"
        in_comparison = folder.resolve().parent.parent.name == "runs"
        if run["heldout"]["initial"] is None and in_comparison and (initial.exists() or initial.is_symlink()):
            run["heldout"]["initial"] = read_initial_evaluation(initial)
        return run
    state = folder / "trainer_state.json"
    if not state.exists() and not state.is_symlink():
        state = latest_checkpoint_file(folder, "trainer_state.json")
        if state is None:
            raise ValueError(f"{run_dir}: no trainer_state.json in the folder or in a checkpoint-<step> subfolder")
    trainer_state = read_trainer_state(state, keys)
    run = {
        "history": trainer_state["log_history"],
        "completions_per_step": logged_batch_size(trainer_state, state),
        "heldout": {},
    }
    before_after = folder / "summary.json"
    if before_after.exists() or before_after.is_symlink():
        run["heldout"] = read_before_after(before_after)
    return run


def load_weight_map(run_dir: str) -> dict:
    """`weight_map.json` (ASPOConfig.log_weight_map) of a training output folder, else of its latest
    `checkpoint-<step>` (other `checkpoint-*` names are skipped), read bounded and checked
    (`run_files.check_weight_map`: bins, grid shapes, weight sums and token counts >= 0)."""
    from trl_aspo.cli.run_files import check_weight_map, latest_checkpoint_file, read_object

    folder = Path(run_dir)
    path = folder / WEIGHT_MAP_FILE
    if not path.exists() and not path.is_symlink():
        path = latest_checkpoint_file(folder, WEIGHT_MAP_FILE)
        if path is None:
            raise ValueError(
                f"{run_dir}: no {WEIGHT_MAP_FILE} in the folder or in a checkpoint-<step> subfolder (train with "
                "log_weight_map=true and an off-policy setting)"
            )
    state = check_weight_map(read_object(path), path)
    if not any(count for sign in ("positive", "negative") for row in state["total"][sign]["count"] for count in row):
        raise ValueError(
            f"{path}: the map holds no tokens (no off-policy pass was logged: set num_iterations > 1 or "
            "steps_per_generation > gradient_accumulation_steps)"
        )
    return state


def pool_weight_maps(states: list[dict], label: str) -> dict:
    """One map from several runs' `weight_map.json` (seeds of one variant): their totals' weight sums and token
    counts added cell by cell, so each cell's mean weight is over all the runs' tokens. The runs must share the loss
    type and the bins."""
    first = states[0]
    for state in states[1:]:
        for key in ("loss_type", "bins"):
            if state.get(key) != first.get(key):
                raise ValueError(
                    f"--labels {label!r}: runs pooled under one label must share {key!r}, got "
                    f"{first.get(key)!r} and {state.get(key)!r}"
                )
    if len(states) == 1:
        return first
    total = {
        sign: {
            quantity: [
                [sum(values) for values in zip(*rows, strict=True)]
                for rows in zip(*(state["total"][sign][quantity] for state in states), strict=True)
            ]
            for quantity in ("weight_sum", "count")
        }
        for sign in ("positive", "negative")
    }
    return {**first, "total": total, "windows": []}


def beside_runs(run_dirs: list[str], name: str) -> str:
    """The default figure path: `name` in the run's folder, or in the deepest folder holding all the runs (the first
    run's folder when only the file system's root holds them all)."""
    folders = [os.path.abspath(run_dir) for run_dir in run_dirs]
    common = os.path.commonpath(folders)
    if os.path.dirname(common) == common:
        common = folders[0]
    return os.path.join(common, name)


def plot_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="trl-aspo plot",
        description="Compare existing runs (any TRL output folder with a trainer_state.json) in one figure.",
    )
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a training output folder")
    parser.add_argument("--labels", nargs="+", help="one legend label per RUN_DIR (default: the folder names)")
    parser.add_argument("--metrics", nargs="+", default=[], help="logged metrics to plot besides the default panels")
    parser.add_argument(
        "--weights",
        action="store_true",
        help="draw each run's ASPO weight map (weight_map.json, written with log_weight_map=true) instead of curves; "
        "runs given the same --labels entry are pooled (their cells added)",
    )
    parser.add_argument(
        "--output",
        help="figure path (default: comparison.png, or weight_map.png with --weights, in the RUN_DIR; for several, "
        "in the folder that holds them all)",
    )
    parser.add_argument("--smoothing", type=int, default=5, help="trailing running-mean window in steps (>= 1)")
    args = parser.parse_args(argv)
    if args.labels and len(args.labels) != len(args.run_dirs):
        parser.error(f"--labels: {len(args.labels)} labels for {len(args.run_dirs)} RUN_DIRs")
    if args.smoothing < 1:
        parser.error(f"--smoothing must be >= 1, got {args.smoothing}")
    missing = [f"RUN_DIR {run_dir!r}: no such directory" for run_dir in args.run_dirs if not Path(run_dir).is_dir()]
    if missing:
        report("trl-aspo plot", ConfigurationError(missing))
    labels = args.labels or [Path(run_dir).resolve().name for run_dir in args.run_dirs]
    if args.weights:
        by_label: dict[str, list[dict]] = {}
        try:
            for label, run_dir in zip(labels, args.run_dirs, strict=True):
                by_label.setdefault(label, []).append(load_weight_map(run_dir))
            maps = {
                (label if len(states) == 1 else f"{label} ({len(states)} runs)"): pool_weight_maps(states, label)
                for label, states in by_label.items()
            }
        except ValueError as error:
            parser.error(str(error))
        path = plot_weight_maps(maps, args.output or beside_runs(args.run_dirs, "weight_map.png"))
        print(f"Figure written to {path}.")
        return 0
    groups: dict[str, list[dict]] = {}
    try:
        for label, run_dir in zip(labels, args.run_dirs, strict=True):
            groups.setdefault(label, []).append(load_run(run_dir, tuple(args.metrics)))
        output = args.output or beside_runs(args.run_dirs, "comparison.png")
        path = plot_comparison(groups, output, tuple(args.metrics), smoothing=args.smoothing)
    except ValueError as error:
        parser.error(str(error))
    print(f"Figure written to {path}.")
    return 0
