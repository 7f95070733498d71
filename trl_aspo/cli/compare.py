"""Comparisons over seeds: `trl-aspo compare --config configs/experiments/NAME.yaml` and `trl-aspo plot RUN_DIR ...`.

An experiment file names a shared `base` training config (the keys of a `trl-aspo train` YAML) and `variants`, each a
set of overrides on it; every variant is trained once per entry of `seeds`, one run after another in this process,
on the same data and with the same completion budget. The output folder gets

- `runs/<variant>/seed<S>/`: the run's `trainer_state.json` (its full log history), model and `run_summary.json`,
  written last, so a finished run is skipped when the comparison is started again;
- `comparison.png`: per metric, each variant's mean curve and +-1 sd band over seeds, against completions generated;
- `results.md` / `results.json`: final numbers and the reward-curve area, mean +- sd over seeds.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import re
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trl_aspo.cli.arguments import ConfigurationError, load_yaml, report, shown, typed_config
from trl_aspo.cli.plot import has_train_seconds, plot_comparison, plot_weight_maps
from trl_aspo.trainers.resume import cli_command

EXPERIMENT_KEYS = {
    "description": "free text, printed at the top of results.md",
    "output_dir": "folder of the comparison (required)",
    "seeds": "list of distinct non-negative integers, one run per seed and variant (required)",
    "base": "training config shared by every variant: the keys of a `trl-aspo train` YAML (required)",
    "variants": "mapping of variant name to its overrides of `base` (required, at least one)",
    "metrics": "extra logged metrics to plot and tabulate, e.g. [repetition_rate, clip_ratio/region_mean]",
    "evaluation": "held-out evaluation after each run: {samples_per_problem, temperature, initial}",
    "threads": "torch CPU threads of the runs (default 1)",
}
EVALUATION_KEYS = {
    "samples_per_problem": "completions per held-out problem (>= 1)",
    "temperature": "sampling temperature, 0 = greedy (>= 0)",
    "initial": "also evaluate the starting model once, drawn at 0 completions (true/false)",
    "every_steps": "also evaluate every this many optimizer steps during training, logged as heldout/* (>= 1)",
}
# Set by `compare` itself for each run.
RESERVED_KEYS = ("seed", "output_dir")
SUMMARY_FILE = "run_summary.json"
# trl_aspo.algorithms.weight_map.WEIGHT_MAP_FILE, named here because that module imports torch and `plot` does not
# need it.
WEIGHT_MAP_FILE = "weight_map.json"
# Logged metrics whose end-of-training value goes into the table (when logged).
TABLE_METRICS = ("reward", "entropy", "tools/first_call_position", "tools/tool_call_frac", "zero_advantage_share")
HELDOUT_METRICS = (
    ("accuracy", "held-out accuracy"),
    ("tool_call_rate", "held-out tool-call rate"),
    ("mean_first_call_position", "held-out first-call position"),
)
# Table rows that are fractions, shown as percentages as in docs/experiments.md (results.json keeps the fractions).
PERCENT_ROWS = ("held-out accuracy", "held-out tool-call rate")


@dataclass
class Evaluation:
    samples_per_problem: int = 1
    temperature: float = 0.0
    initial: bool = True
    every_steps: int | None = None


@dataclass
class Experiment:
    path: str
    output_dir: Path
    seeds: list[int]
    base: dict[str, Any]
    variants: dict[str, dict[str, Any]]
    description: str = ""
    metrics: list[str] = field(default_factory=list)
    evaluation: Evaluation | None = None
    threads: int = 1
    # `key=value` overrides of `base` from the command line (`apply_command_line`), recorded in every run summary.
    overrides: dict[str, Any] = field(default_factory=dict)

    def run_dir(self, variant: str, seed: int) -> Path:
        return self.output_dir / "runs" / slug(variant) / f"seed{seed}"

    def run_config(self, variant: str, seed: int) -> dict[str, Any]:
        """The `trl-aspo train` keys of one run: base, the command-line overrides of base, the variant's overrides,
        then the run's seed and folder."""
        return {
            **self.base,
            **self.overrides,
            **self.variants[variant],
            "seed": seed,
            "output_dir": str(self.run_dir(variant, seed)),
        }


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")


def _fail(path: str, message: str) -> None:
    raise ValueError(f"experiment file {path}: {message}")


def _check_keys(path: str, where: str, mapping: dict, allowed: dict[str, str]) -> None:
    unknown = sorted(set(mapping) - set(allowed))
    if unknown:
        _fail(path, f"unknown key {unknown[0]!r} in {where}; allowed: {', '.join(sorted(allowed))}")


def load_experiment(path: str) -> Experiment:
    """Read and validate an experiment file; every error names the file and the key, and says what is allowed.

    Each variant's full run config goes through the training parser before anything runs, so a typo in a variant
    fails at once rather than after the runs before it."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"experiment file {path}: cannot be read: {error}") from None
    spec = load_yaml(text, f"experiment file {path}")
    if not isinstance(spec, dict):
        _fail(path, "must be a YAML mapping with the keys " + ", ".join(sorted(EXPERIMENT_KEYS)))
    _check_keys(path, "the file", spec, EXPERIMENT_KEYS)
    for key in ("output_dir", "seeds", "base", "variants"):
        if spec.get(key) is None:
            _fail(path, f"missing key {key!r}: {EXPERIMENT_KEYS[key]}")

    seeds = spec["seeds"]
    if not isinstance(seeds, list) or not seeds:
        _fail(path, f"'seeds' must be a non-empty list of integers, got {shown(seeds)}")
    for seed in seeds:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            _fail(path, f"'seeds' entry {shown(seed)} is not a non-negative integer")
    if len(set(seeds)) != len(seeds):
        _fail(path, f"'seeds' has a repeated seed: {shown(seeds)}")

    base = spec["base"]
    if not isinstance(base, dict):
        _fail(path, f"'base' must be a mapping of training keys, got {type(base).__name__}")
    variants = spec["variants"]
    if not isinstance(variants, dict) or not variants:
        _fail(path, "'variants' must be a non-empty mapping of variant name to overrides (use {} for the base)")
    variants = {str(name): overrides or {} for name, overrides in variants.items()}
    slugs: dict[str, str] = {}
    for name, overrides in variants.items():
        if not isinstance(overrides, dict):
            _fail(path, f"variant {name!r} must be a mapping of overrides, got {shown(overrides)}")
        if not slug(name) or slug(name) in slugs:
            _fail(path, f"variant name {name!r} gives the same folder name as {slugs.get(slug(name))!r}; rename it")
        slugs[slug(name)] = name
    for where, mapping in [("'base'", base), *((f"variant {name!r}", o) for name, o in variants.items())]:
        for key in RESERVED_KEYS:
            if key in mapping:
                _fail(
                    path, f"key {key!r} in {where}: set by compare per run (use 'seeds' / the top-level 'output_dir')"
                )

    evaluation = None
    if spec.get("evaluation") is not None:
        settings = spec["evaluation"]
        if not isinstance(settings, dict):
            _fail(path, f"'evaluation' must be a mapping with keys {', '.join(EVALUATION_KEYS)}")
        _check_keys(path, "'evaluation'", settings, EVALUATION_KEYS)
        evaluation = Evaluation(**settings)
        samples = evaluation.samples_per_problem
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            _fail(path, f"'evaluation.samples_per_problem' must be an integer >= 1, got {shown(samples)}")
        temperature = evaluation.temperature
        if isinstance(temperature, bool) or not isinstance(temperature, int | float) or temperature < 0:
            _fail(path, f"'evaluation.temperature' must be a number >= 0, got {shown(temperature)}")
        if not isinstance(evaluation.initial, bool):
            _fail(path, f"'evaluation.initial' must be true or false, got {shown(evaluation.initial)}")
        every = evaluation.every_steps
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            _fail(path, f"'evaluation.every_steps' must be an integer >= 1 (or left out), got {shown(every)}")
    metrics = spec.get("metrics") or []
    if not isinstance(metrics, list) or not all(isinstance(m, str) for m in metrics):
        _fail(path, f"'metrics' must be a list of logged metric names, got {shown(metrics)}")
    threads = spec.get("threads", 1)
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        _fail(path, f"'threads' must be an integer >= 1, got {shown(threads)}")

    experiment = Experiment(
        path=path,
        output_dir=Path(str(spec["output_dir"])),
        seeds=seeds,
        base=base,
        variants=variants,
        description=str(spec.get("description") or ""),
        metrics=metrics,
        evaluation=evaluation,
        threads=threads,
    )
    for name in variants:
        try:
            parse_run_config(experiment.run_config(name, seeds[0]))
        except ValueError as error:
            _fail(path, f"variant {name!r} (base + its overrides): {error}")
    return experiment


def parse_override(text: str) -> tuple[str, Any]:
    """`key=value` of the command line: the value read as YAML (`max_steps=2` is the integer 2, `tools=[]` a list),
    by the loader of every trl-aspo YAML (`load_yaml`: safe types, bounded aliases)."""
    key, separator, value = text.partition("=")
    if not separator or not key.strip():
        raise ValueError(f"override {shown(text)} is not of the form key=value (e.g. max_steps=2)")
    return key.strip(), load_yaml(value, f"override {shown(text)}")


def apply_command_line(
    experiment: Experiment,
    seeds: list[int] | None = None,
    variants: list[str] | None = None,
    overrides: list[str] | None = None,
) -> Experiment:
    """The experiment shrunk or changed from the command line: only `seeds` and the named `variants` (in the file's
    order), and `key=value` `overrides` of `base`, each with its field's type (`learning_rate=2e-4`, which YAML 1.1
    reads as text, is the number 0.0002, as in a run's config); every variant's run config is parsed again."""
    path = experiment.path
    if seeds is not None:
        if not seeds or any(seed < 0 for seed in seeds) or len(set(seeds)) != len(seeds):
            raise ValueError(f"--seeds must be distinct non-negative integers, got {seeds}")
        experiment.seeds = list(seeds)
    if variants is not None:
        unknown = [name for name in variants if name not in experiment.variants]
        if unknown:
            raise ValueError(
                f"--variants: {unknown[0]!r} is not a variant of {path}; it has: "
                + ", ".join(repr(name) for name in experiment.variants)
            )
        experiment.variants = {name: spec for name, spec in experiment.variants.items() if name in variants}
    for text in overrides or []:
        key, value = parse_override(text)
        if key in RESERVED_KEYS:
            raise ValueError(f"override {shown(text)}: {key!r} is set by compare per run (use --seeds / --output_dir)")
        experiment.overrides[key] = value
    trainer = {**experiment.base, **experiment.overrides}.get("trainer", "sync")
    experiment.overrides = typed_config(experiment.overrides, trainer if isinstance(trainer, str) else "sync")
    for name in experiment.variants:
        try:
            parse_run_config(experiment.run_config(name, experiment.seeds[0]))
        except ValueError as error:
            raise ValueError(f"variant {name!r} (base + overrides {shown(experiment.overrides)}): {error}") from None
    return experiment


def format_overrides(overrides: dict[str, Any]) -> str:
    return " ".join(f"{key}={json.dumps(value)}" for key, value in overrides.items())


def parse_run_config(config: dict[str, Any]):
    """(script_args, training_args, model_args, dataset_args) of a run config, as `trl-aspo train` parses a YAML
    (its `trainer` key picks the config classes)."""
    from trl_aspo.cli.train import parse_config

    return parse_config(config)


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


def as_plot_run(summary: dict) -> dict:
    """The `plot_comparison` run of a compare run's summary (checked on reading: `run_files.read_run_summary`)."""
    heldout = summary.get("heldout") or {}
    initial = summary.get("heldout_initial") or {}
    return {
        "history": summary["history"],
        "completions_per_step": summary.get("completions_per_step"),
        "heldout": {"initial": initial.get("accuracy"), "final": heldout.get("accuracy")},
    }


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
    parser.add_argument("--output", help="figure path (default: comparison.png, or weight_map.png with --weights)")
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
        path = plot_weight_maps(maps, args.output or "weight_map.png")
        print(f"Figure written to {path}.")
        return 0
    groups: dict[str, list[dict]] = {}
    try:
        for label, run_dir in zip(labels, args.run_dirs, strict=True):
            groups.setdefault(label, []).append(load_run(run_dir, tuple(args.metrics)))
        path = plot_comparison(groups, args.output or "comparison.png", tuple(args.metrics), smoothing=args.smoothing)
    except ValueError as error:
        parser.error(str(error))
    print(f"Figure written to {path}.")
    return 0
