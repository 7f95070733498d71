"""`trl-aspo compare --config configs/experiments/NAME.yaml`: named variants x seeds of an experiment file
(`trl_aspo.cli.experiment_file`), trained one run after another in this process, on the same data and with the same
completion budget. The output folder gets

- `runs/<variant>/seed<S>/`: the run's `trainer_state.json` (its full log history), model and `run_summary.json`,
  written last, so a finished run is skipped when the comparison is started again;
- `comparison.png`: per metric, each variant's mean curve and +-1 sd band over seeds, against completions generated;
- `results.md` / `results.json`: final numbers and the reward-curve area, mean +- sd over seeds
  (`trl_aspo.cli.results_table`).
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from trl_aspo.cli.command_line import typed_config
from trl_aspo.cli.config_errors import ConfigurationError, report, shown
from trl_aspo.cli.experiment_file import (
    EXPERIMENT_KEYS,
    Experiment,
    apply_command_line,
    format_overrides,
    load_experiment,
    parse_run_config,
)
from trl_aspo.cli.plot import has_train_seconds, plot_comparison
from trl_aspo.cli.results_table import results_table
from trl_aspo.cli.run_files import SUMMARY_FILE, as_plot_run
from trl_aspo.trainers.resume import cli_command


def completions_per_step(training_args, num_processes: int = 1) -> float:
    """Completions generated per optimizer step: GRPOTrainer trains each generation batch `num_iterations` times
    (8 completions per step over 3 iterations: 8/3 generated per step, not rounded); the asynchronous trainer (no
    `num_iterations`) trains each sample it keeps once."""
    consumed = training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps * num_processes
    return consumed / getattr(training_args, "num_iterations", 1)


def run_one(experiment: Experiment, variant: str, seed: int, label: str) -> dict[str, Any]:
    """Train one (variant, seed) run, evaluate it on the held-out split if asked, write and return its summary."""
    from trl_aspo.cli.callbacks import HeldoutDuringTraining, TrainingClock
    from trl_aspo.cli.progress import MetricProgressCallback
    from trl_aspo.cli.train import run

    config = experiment.run_config(variant, seed)
    script_args, training_args, model_args, dataset_args = parse_run_config(config)
    script_args.plot = False
    script_args.evaluate_before_after = False
    shown = {"reward": "reward", "entropy": "entropy", "first_call": "tools/first_call_position"}
    callbacks = [MetricProgressCallback(label, shown)]
    if experiment.evaluation is not None and experiment.evaluation.every_steps:
        parsed = (script_args, training_args, dataset_args)
        heldout_curve = HeldoutDuringTraining(
            experiment.evaluation.every_steps,
            lambda model, tokenizer: evaluate_heldout(experiment, parsed, model, tokenizer, seed),
        )
        callbacks += [heldout_curve, TrainingClock(lambda: heldout_curve.seconds)]
    else:
        callbacks.append(TrainingClock())
    start = time.perf_counter()
    trainer = run(script_args, training_args, model_args, dataset_args, callbacks=callbacks)
    minutes = (time.perf_counter() - start) / 60
    trainer.save_state()
    heldout = None
    if experiment.evaluation is not None:
        from trl_aspo.evaluation.report import generation_model

        # On every rank: a sharded model (FSDP2, ZeRO-3) generates only with all ranks taking part.
        with generation_model(trainer) as model:
            heldout = evaluate_heldout(
                experiment, (script_args, training_args, dataset_args), model, trainer.processing_class, seed
            )
    summary = {
        "variant": variant,
        "seed": seed,
        "config": config,
        "overrides": experiment.overrides,
        "completions_per_step": completions_per_step(training_args, trainer.accelerator.num_processes),
        "train_minutes": minutes,
        "heldout": heldout,
        "history": trainer.state.log_history,
    }
    del trainer
    gc.collect()
    write_json(experiment.run_dir(variant, seed) / SUMMARY_FILE, summary)
    return summary


def evaluate_heldout(experiment: Experiment, parsed: tuple, model, tokenizer, seed: int) -> dict:
    """Tool-use summary of `model` on the held-out split of a run config parsed into (script, training, dataset)
    arguments, with the reward, tools and completion budget training uses (`evaluation.evaluate_tool_use`)."""
    from trl_aspo.builtin.registry import BUILTIN_REWARDS, BUILTIN_TOOLS
    from trl_aspo.cli.parsers import load_datasets, resolve_callable
    from trl_aspo.evaluation.tool_use import evaluate_tool_use

    script_args, training_args, dataset_args = parsed
    _, test = load_datasets(script_args, dataset_args)
    if test is None:
        raise ValueError(
            f"experiment file {experiment.path}: 'evaluation' is set but the run config has no held-out split "
            "(dataset_test_split, or the built-in task)"
        )
    reward = resolve_callable(script_args.reward_funcs[0], BUILTIN_REWARDS, "reward_funcs entry")
    tools = [resolve_callable(name, BUILTIN_TOOLS, "tools entry") for name in script_args.tools or []]
    summary = evaluate_tool_use(
        model,
        tokenizer,
        test,
        reward,
        tools,
        num_samples=experiment.evaluation.samples_per_problem,
        temperature=experiment.evaluation.temperature,
        max_completion_length=training_args.max_completion_length,
        max_tool_calls=training_args.max_tool_calling_iterations,
        seed=seed,
        progress=False,
    )
    summary.pop("records")
    return summary


def evaluate_initial(experiment: Experiment) -> dict | None:
    """The starting model's held-out summary (once per comparison, cached in `initial_evaluation.json`)."""
    if experiment.evaluation is None or not experiment.evaluation.initial:
        return None
    path = experiment.output_dir / "initial_evaluation.json"
    if path.exists():
        from trl_aspo.cli.run_files import evaluation_accuracy, read_object

        summary = read_object(path)
        evaluation_accuracy(summary, path, "the evaluation")
        return summary
    import torch

    from trl_aspo.cli.evaluate import load_model_and_tokenizer

    script_args, training_args, model_args, dataset_args = parse_run_config(
        experiment.run_config(next(iter(experiment.variants)), experiment.seeds[0])
    )
    device = "cuda" if torch.cuda.is_available() and not training_args.use_cpu else "cpu"
    model, tokenizer = load_model_and_tokenizer(model_args.model_name_or_path, device)
    print(f"evaluating the starting model {model_args.model_name_or_path} on the held-out split")
    parsed = (script_args, training_args, dataset_args)
    summary = evaluate_heldout(experiment, parsed, model, tokenizer, experiment.seeds[0])
    write_json(path, summary)
    return summary


def write_json(path: Path, value: Any) -> None:
    from trl_aspo.cli.evaluate import json_ready
    from trl_aspo.infra.json_files import write_json_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, json_ready(value), indent=1, default=str)


def finished_summary(experiment: Experiment, variant: str, seed: int) -> dict | None:
    """The summary of a finished run, or None; a finished run made with a different config is an error."""
    from trl_aspo.cli.run_files import read_run_summary

    path = experiment.run_dir(variant, seed) / SUMMARY_FILE
    if not path.exists() and not path.is_symlink():
        return None
    summary = read_run_summary(path, tuple(experiment.metrics))
    # Both sides with their fields' types: `learning_rate: '2e-4'` (text to YAML 1.1) trained the run 0.0002 does.
    expected = typed_config(json.loads(json.dumps(experiment.run_config(variant, seed))))
    trained = typed_config(summary.get("config") or {}, expected.get("trainer", "sync"))
    if trained != expected:
        changed = sorted(
            (key for key in set(expected) | set(trained) if expected.get(key) != trained.get(key)), key=str
        )
        differences = "; ".join(
            f"{key}: {shown(trained.get(key))} then, {shown(expected.get(key))} now" for key in changed
        )
        raise ValueError(
            f"{path} was trained with a different config (keys {changed}) than variant {variant!r} of "
            f"{experiment.path} now gives ({differences}; command-line overrides then: "
            f"{format_overrides(summary.get('overrides') or {}) or 'none'}, now: "
            f"{format_overrides(experiment.overrides) or 'none'}): use the same overrides, choose another output_dir, "
            "or delete that run folder to retrain it."
        )
    return summary


def compare(experiment: Experiment) -> dict[str, list[dict]]:
    """Run every (variant, seed) not finished yet, then write the figure and tables; returns variant -> summaries."""
    import torch

    torch.set_num_threads(experiment.threads)
    experiment.output_dir.mkdir(parents=True, exist_ok=True)
    initial = evaluate_initial(experiment)
    jobs = [(variant, seed) for variant in experiment.variants for seed in experiment.seeds]
    results: dict[str, list[dict]] = {variant: [] for variant in experiment.variants}
    trained_minutes = []
    for index, (variant, seed) in enumerate(jobs, start=1):
        label = f"[{index}/{len(jobs)}] {variant} seed {seed}"
        summary = finished_summary(experiment, variant, seed)
        if summary is not None:
            print(f"{label}: finished before, skipped ({experiment.run_dir(variant, seed)})", flush=True)
        else:
            summary = run_one(experiment, variant, seed, label)
            trained_minutes.append(summary["train_minutes"])
            left = sum(finished_summary(experiment, v, s) is None for v, s in jobs[index:])
            print(
                f"{label}: done in {summary['train_minutes']:.1f} min; about "
                f"{left * sum(trained_minutes) / len(trained_minutes):.0f} min left for {left} runs",
                flush=True,
            )
        if initial is not None and summary.get("heldout") is not None:
            summary["heldout_initial"] = initial
        results[variant].append(summary)
        # Rewritten after every run, so a long comparison shows its results so far.
        write_outputs(experiment, {name: runs for name, runs in results.items() if runs}, initial, quiet=True)
    write_outputs(experiment, results, initial)
    return results


def write_outputs(
    experiment: Experiment, results: dict[str, list[dict]], initial: dict | None, quiet: bool = False
) -> None:
    groups = {variant: [as_plot_run(summary) for summary in runs] for variant, runs in results.items()}
    figure = plot_comparison(
        groups,
        str(experiment.output_dir / "comparison.png"),
        tuple(experiment.metrics),
        title=Path(experiment.path).stem,
    )
    if all(has_train_seconds(run["history"]) for runs in groups.values() for run in runs):
        plot_comparison(
            groups,
            str(experiment.output_dir / "comparison_wallclock.png"),
            tuple(experiment.metrics),
            title=Path(experiment.path).stem,
            x_axis="seconds",
        )
    table, numbers = results_table(results, experiment.metrics, initial)
    budget = ", ".join(f"{variant} {runs[0]['completions_per_step']:.4g}" for variant, runs in results.items())
    header = (
        f"{experiment.description.strip()}\n\n" if experiment.description else ""
    ) + f"Seeds {experiment.seeds}; mean ± sd over seeds; completions generated per optimizer step: {budget}.\n"
    if experiment.overrides:
        header += f"Command-line overrides of base: {format_overrides(experiment.overrides)}.\n"
    (experiment.output_dir / "results.md").write_text(f"{header}\n{table}\n")
    write_json(
        experiment.output_dir / "results.json", {"initial": initial, "overrides": experiment.overrides, **numbers}
    )
    if not quiet:
        print(f"\n{header}\n{table}\n\nFigure {figure}; tables results.md, results.json; raw logs under runs/.")


def compare_main(argv: list[str]) -> int:
    from trl_aspo.infra.notices import ignore_known_notices

    ignore_known_notices()
    parser = argparse.ArgumentParser(
        prog="trl-aspo compare",
        description="Train named variants x seeds from an experiment file and compare them (figure, tables, logs). "
        "Rerunning skips finished runs. Experiment file keys: "
        + "; ".join(f"{key}: {text}" for key, text in EXPERIMENT_KEYS.items()),
    )
    parser.add_argument("--config", required=True, help="experiment YAML, e.g. configs/experiments/tool_shaping.yaml")
    parser.add_argument("--output_dir", help="override the file's output_dir")
    parser.add_argument("--seeds", nargs="+", help="run only these seeds (default: the file's seeds)")
    parser.add_argument("--variants", nargs="+", metavar="NAME", help="run only these variants of the file")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="override a key of the file's base, value read as YAML (e.g. max_steps=2); recorded in each run's "
        "summary and results.md, and a resumed comparison refuses runs made with other overrides",
    )
    args = parser.parse_args(argv)
    if not Path(args.config).expanduser().is_file():
        report("trl-aspo compare", ConfigurationError([f"--config {args.config!r}: no such file"]))
    # `--variants a b max_steps=2`: argparse gives the KEY=VALUE words after a list flag to the flag.
    overrides = list(args.overrides)
    for name in ("seeds", "variants"):
        if getattr(args, name) is not None:
            overrides += [word for word in getattr(args, name) if "=" in word]
            setattr(args, name, [word for word in getattr(args, name) if "=" not in word])
    try:
        seeds = None if args.seeds is None else [int(seed) for seed in args.seeds]
    except ValueError:
        parser.error(f"--seeds must be integers, got {args.seeds}")
    try:
        experiment = apply_command_line(load_experiment(args.config), seeds, args.variants, overrides)
    except ValueError as error:
        parser.error(str(error))
    if args.output_dir:
        experiment.output_dir = Path(args.output_dir)
    try:
        compare(experiment)
    except ValueError as error:
        parser.exit(2, f"trl-aspo compare: error: {error}\n")
    except KeyboardInterrupt:
        # Finished runs have their run_summary.json; the interrupted one starts again from its beginning.
        command = shlex.join([*cli_command(), "compare", *argv])
        print(f"\nInterrupted; finished runs are kept. Continue with: {command}", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    return 0
