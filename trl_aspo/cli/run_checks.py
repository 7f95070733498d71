"""What a `trl-aspo train` run needs that only the values of its command line show, checked before torch loads: a
model, reward functions and a dataset; each `report_to` integration installed; the numbers within their declared
ranges and the options their switches allow (the config's own messages, from the field table); a checkpoint to resume
from. And the warning for a fresh run in a folder that already holds checkpoints."""

from __future__ import annotations

import importlib.util
import shlex
import sys
from typing import Any

from trl_aspo.cli.command_line import check_command_line, config_path, given_values
from trl_aspo.cli.config_errors import ConfigurationError, shown, suggestion
from trl_aspo.cli.field_cache import field_table
from trl_aspo.cli.field_table import OTHER_TEXT
from trl_aspo.cli.value_checks import BUILTIN_DATASET_NAMES, BUILTIN_REWARD_NAMES, FALSE_WORDS
from trl_aspo.trainers.resume import existing_checkpoints, resolve_resume_checkpoint

# `report_to` integration -> (the modules transformers' callback imports, any one of them; the pip package).
REPORT_TO_PACKAGES = {
    "azure_ml": (("azureml.core",), "azureml-sdk"),
    "clearml": (("clearml",), "clearml"),
    "codecarbon": (("codecarbon",), "codecarbon"),
    "comet_ml": (("comet_ml",), "comet-ml"),
    "dagshub": (("dagshub",), "dagshub"),
    "dvclive": (("dvclive",), "dvclive"),
    "flyte": (("flytekitplugins.deck",), "flytekitplugins-deck-standard"),
    "mlflow": (("mlflow",), "mlflow"),
    "neptune": (("neptune",), "neptune"),
    "swanlab": (("swanlab",), "swanlab"),
    "tensorboard": (("tensorboard", "tensorboardX"), "tensorboard"),
    "trackio": (("trackio",), "trackio"),
    "wandb": (("wandb",), "wandb"),
}
# transformers' own integrations that need no package (kubeflow reads environment variables).
REPORT_TO_WITHOUT_PACKAGE = ("all", "none", "kubeflow")


def check_train_command_line(argv: list[str]) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """`check_command_line`, then what a training run needs that only the values show (the module docstring).

    Returns (the YAML mapping, the trainer, the fields the command line sets); raises ConfigurationError."""
    if config_path(argv) is None and not argv:
        raise ConfigurationError(
            [
                "no --config and no fields: give the run's YAML file, e.g. `trl-aspo train --config "
                "configs/quickstart.yaml`, or at least --model_name_or_path, --dataset_name and --reward_funcs"
            ]
        )
    config, trainer = check_command_line(argv)
    table = field_table()
    fields = {field["name"]: field for field in table["trainers"][trainer]}
    values = given_values(argv, config, fields)
    where = "no --config" if config_path(argv) is None else f"neither in {config_path(argv)} nor a flag"
    problems = []
    if not values.get("model_name_or_path"):
        problems.append(
            f"model_name_or_path: not set ({where}); give a local model directory, a hub id or "
            "'builtin:tiny-calculator'"
        )
    if not values.get("reward_funcs"):
        problems.append(
            f"reward_funcs: not set ({where}); give dotted import paths or built-in names "
            f"{sorted(BUILTIN_REWARD_NAMES)}"
        )
    if not values.get("dataset_name") and not values.get("datasets"):
        problems.append(
            f"dataset_name: not set ({where}); give a dataset name or one of {sorted(BUILTIN_DATASET_NAMES)} (or "
            "`datasets`)"
        )
    problems += report_to_problems(values.get("report_to"))
    out_of_range = bound_problems(values, table["bounds"].get(trainer, {}))
    problems += out_of_range.values()
    # An option out of its range is refused for that alone (the config checks ranges before dependencies).
    unbounded = {name: value for name, value in values.items() if name not in out_of_range}
    problems += dependency_problems(unbounded, fields, table["dependencies"].get(trainer, []))
    if values.get("enable_jit_checkpoint") and values.get("stop_signals") != []:
        problems.append(
            "enable_jit_checkpoint: true installs transformers' own SIGTERM handler, and trl-aspo train stops on "
            f"stop_signals ({values.get('stop_signals') or 'TERM, USR1, INT by default'}); one handler only: remove "
            "enable_jit_checkpoint (the stop_signals checkpoint holds what a save_steps one does), or set "
            "stop_signals: [] to keep transformers'"
        )
    try:
        resolve_resume_checkpoint(values.get("resume_from_checkpoint"), output_dir(values), values.get("max_steps"))
    except ValueError as error:
        problems.append(str(error))
    if problems:
        raise ConfigurationError(problems)
    return config, trainer, values


def output_dir(values: dict[str, Any]) -> str:
    """The run's `output_dir`: transformers' default 'trainer_output' when none is given."""
    return str(values.get("output_dir") or "trainer_output")


def report_to_problems(report_to: Any) -> list[str]:
    """A line for each `report_to` integration whose package is not installed (transformers would fail only when
    the trainer is built, after the model loads), naming the package to install."""
    names = report_to if isinstance(report_to, list) else [report_to] if isinstance(report_to, str) else []
    problems = []
    for name in names:
        if name in REPORT_TO_WITHOUT_PACKAGE:
            continue
        if name not in REPORT_TO_PACKAGES:
            allowed = sorted([*REPORT_TO_PACKAGES, *REPORT_TO_WITHOUT_PACKAGE])
            problems.append(f"report_to: {shown(name)} is not one of {allowed}{suggestion(str(name), allowed)}")
        elif not any(_installed(module) for module in REPORT_TO_PACKAGES[name][0]):
            package = REPORT_TO_PACKAGES[name][1]
            problems.append(
                f"report_to: {name!r} needs the package {package!r}, which is not installed: "
                f"`{shlex.join([sys.executable, '-m', 'pip', 'install', package])}`, or remove it from report_to"
            )
    return problems


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a dotted name whose parent package is missing
        return False


def bound_problems(values: dict[str, Any], bounds: dict[str, dict]) -> dict[str, str]:
    """Field -> message for each number outside its field's declared range (`trl_aspo.config.fields.check_values`'
    bound check, with its message), before torch loads; values that are not numbers are left to the config's type
    check."""
    problems = {}
    for name, bound in bounds.items():
        value = values.get(name)
        items = value if isinstance(value, list) else [value]
        if value is None or not all(isinstance(item, int | float) and not isinstance(item, bool) for item in items):
            continue
        if not all(_within(item, bound) for item in items):
            each = " each" if isinstance(value, list) else ""
            optional = " or be None" if bound["optional"] else ""
            problems[name] = (
                f"{bound['config']}.{name}={shown(value)} is invalid: must{each} lie in {bound['shown']}{optional}."
            )
    return problems


def _within(value: float, bound: dict) -> bool:
    above = value > bound["low"] if bound["low_open"] else value >= bound["low"]
    below = value < bound["high"] if bound["high_open"] else value <= bound["high"]
    return above and below and value not in bound["excluded"]


def dependency_problems(values: dict[str, Any], fields: dict[str, dict], dependencies: list[dict]) -> list[str]:
    """The refusals of `trl_aspo.config.fields.check_dependencies` that the values alone decide: an option set away
    from its default while its switches (booleans, choices or text, tabulated in the field table) say it does
    nothing. The same message as the config's, before torch loads; anything else the config checks itself."""
    problems = []
    for dependency in dependencies:
        option = dependency["option"]
        if option not in values or option not in fields or values[option] == fields[option]["default"]:
            continue
        switches = dependency["switches"]
        current = [values.get(switch, fields[switch]["default"]) for switch in switches]
        domains = dependency["domains"]
        key = [value if value in domain else OTHER_TEXT for value, domain in zip(current, domains, strict=True)]
        if any(value not in domain for value, domain in zip(key, domains, strict=True)):
            continue  # a value the table has no row for (a number for a boolean): the config decides
        if key in dependency["fails"]:
            got = ", ".join(f"{switch}={shown(value)}" for switch, value in zip(switches, current, strict=True))
            problems.append(
                f"{dependency['config']}.{option}={shown(values[option])} is invalid: {dependency['why']}, so it "
                f"needs {dependency['needs']} (got {got}). Remove {option} or change {', '.join(switches)}."
            )
    return problems


def existing_checkpoints_warning(values: dict[str, Any]) -> str | None:
    """The warning for a run that starts afresh (no `resume_from_checkpoint`) in an `output_dir` already holding
    `checkpoint-*` folders: transformers deletes none of them, but this run's saves overwrite those of the same
    step, and `save_total_limit` may delete the old ones."""
    resume = values.get("resume_from_checkpoint")
    if resume is not None and str(resume).lower() not in FALSE_WORDS + ("", "none"):
        return None
    folder = output_dir(values)
    checkpoints = [path.name for path in existing_checkpoints(folder)]
    if not checkpoints:
        return None
    listed = ", ".join(checkpoints[:5]) + (f" and {len(checkpoints) - 5} more" if len(checkpoints) > 5 else "")
    return (
        f"output_dir {folder!r} already holds {listed}, and no resume_from_checkpoint is set: this run starts at "
        "step 0, and its checkpoints overwrite those of the same step (the others stay, unless save_total_limit "
        "deletes them). To continue that run, add --resume_from_checkpoint true; to keep it, give another "
        "--output_dir."
    )
