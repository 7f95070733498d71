"""`trl-aspo train --help`, written from the field table (`trl_aspo.cli.field_cache`) without importing torch:
usage, the launcher flags, then every field of the trainer's config, trl-aspo's fields first (grouped by method),
TRL's and transformers' after; each with its type, choices and default."""

from __future__ import annotations

import shutil
import textwrap
from typing import Any

from trl_aspo.cli.command_line import config_path, requested_trainer
from trl_aspo.cli.config_errors import ConfigurationError
from trl_aspo.cli.field_cache import field_table
from trl_aspo.cli.value_checks import field_choices
from trl_aspo.cli.yaml_loading import read_config

LAUNCH_FLAG_HELP = (
    ("--num_processes N", "run N processes through `accelerate launch` (DDP without a config file)"),
    ("--accelerate_config FILE", "an accelerate config (DeepSpeed, FSDP, several machines): see configs/accelerate/"),
    ("--num_machines, --machine_rank, --main_process_ip, --main_process_port", "several machines"),
    ("--mixed_precision, --multi_gpu", "passed to `accelerate launch`"),
)
TRAINER_CLASSES = {
    "sync": "ASPOTrainer, on TRL's GRPOTrainer",
    "async": "AsyncASPOTrainer, on TRL's AsyncGRPOTrainer",
}


def format_train_help(trainer: str = "sync", table: dict[str, Any] | None = None, width: int | None = None) -> str:
    """The help of `trainer`'s fields (the module docstring)."""
    table = table or field_table()
    width = width or min(shutil.get_terminal_size((100, 24)).columns, 119)
    other = "async" if trainer == "sync" else "sync"
    description = (
        f"The fields of trainer: {trainer} ({TRAINER_CLASSES.get(trainer, trainer)}). Each may be a key of the "
        "--config YAML (key: value) or a flag (--key value); flags override the YAML. Booleans take true/false; lists "
        f"take several words (--reward_funcs a b) or a YAML list ([a, b]). For trainer: {other}, run `trl-aspo train "
        f"--trainer {other} --help`."
    )
    lines = [
        "usage: trl-aspo train --config X.yaml [--key value ...]",
        "       trl-aspo train [--num_processes N | --accelerate_config FILE] --config X.yaml [--key value ...]",
        "",
        *textwrap.wrap(description, width=width),
        "",
        "command line:",
    ]
    lines += _entry(
        "--config FILE", "the YAML file of the run (an `env:` mapping in it sets environment variables)", width
    )
    lines += [line for option, text in LAUNCH_FLAG_HELP for line in _entry(option, f"{text} (before --config)", width)]
    groups: dict[str, list[dict]] = {}
    for field in table["trainers"][trainer]:
        groups.setdefault(field["group"], []).append(field)
    ordered = [name for name in groups if name.startswith("trl-aspo")] + [
        name for name in groups if not name.startswith("trl-aspo")
    ]
    for group in ordered:
        lines += ["", f"{group}:"]
        for field in groups[group]:
            lines += _entry(_field_usage(field), _field_help(field), width)
    return "\n".join(lines) + "\n"


def train_help(argv: list[str]) -> str:
    """The help of the trainer a command line asks for (`--trainer`, or its `--config` YAML's `trainer`)."""
    path = config_path(argv)
    try:
        config = read_config(path) if path else {}
    except ConfigurationError:
        config = {}
    table = field_table()
    trainer = requested_trainer(argv, config)
    return format_train_help(trainer if trainer in table["trainers"] else "sync", table)


def _field_usage(field: dict[str, Any]) -> str:
    metavar = {"bool": "true|false", "int": "INT", "float": "FLOAT"}.get(field["kind"], "VALUE")
    if field["kind"] == "choice":
        metavar = "{" + ",".join(str(choice) for choice in field_choices(field)) + "}"
    return f"--{field['name']} {metavar}" + (" [...]" if field["list"] else "")


def _field_help(field: dict[str, Any]) -> str:
    text = field["help"]
    if field["negations"]:
        text += f" ({field['negations'][0]} sets it false.)"
    return f"{text} (default: {field['default']})"


def _entry(usage: str, text: str, width: int) -> list[str]:
    return [f"  {usage}", *textwrap.wrap(text, width=width, initial_indent=" " * 8, subsequent_indent=" " * 8)]
