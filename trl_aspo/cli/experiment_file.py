"""The experiment file of `trl-aspo compare --config configs/experiments/NAME.yaml`, read and checked, and the
command line's changes to it (`--seeds`, `--variants`, `key=value` overrides of its base).

An experiment file names a shared `base` training config (the keys of a `trl-aspo train` YAML) and `variants`, each a
set of overrides on it; every variant is trained once per entry of `seeds` (`trl_aspo.cli.compare`). Every variant's
full run config goes through the training parser before anything runs, so a typo in a variant fails at once.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trl_aspo.cli.command_line import typed_config
from trl_aspo.cli.config_errors import shown
from trl_aspo.cli.yaml_loading import load_yaml

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
