"""The checks of a `trl-aspo train` / `evaluate` command line (a `--config` YAML file plus `--key value` flags over
the fields of `trl_aspo.cli.parsers.config_classes(trainer)`), run before torch or TRL is imported.

Every mistake found (a missing file, a key that is no text, an unknown key in the YAML or as a flag, a key of the
other trainer, a value its field refuses (`trl_aspo.cli.value_checks`), a local-looking path that does not exist) is
collected into one `ConfigurationError`, which `trl_aspo.cli.config_errors.report` prints as one block with exit
status 2. The fields come from the field table (`trl_aspo.cli.field_cache`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trl_aspo.cli.config_errors import ConfigurationError, shown, suggestion
from trl_aspo.cli.field_cache import field_table
from trl_aspo.cli.plugins import plugin_problems
from trl_aspo.cli.value_checks import FALSE_WORDS, TRUE_WORDS, missing_path_problem, typed_value, value_problem
from trl_aspo.cli.yaml_loading import read_config

# Keys of a `trl-aspo train` YAML that are not dataclass fields: TrlParser reads `env` itself.
YAML_ONLY_KEYS = ("env",)


def config_path(argv: list[str]) -> str | None:
    if "--config" in argv:
        index = argv.index("--config")
        return argv[index + 1] if index + 1 < len(argv) else ""
    return None


def without_config(argv: list[str]) -> list[str]:
    """The command line without its `--config FILE`."""
    rest = list(argv)
    if "--config" in rest:
        index = rest.index("--config")
        del rest[index : index + 2]
    return rest


def requested_trainer(argv: list[str], config: dict | None) -> str:
    """The `trainer` a command line asks for: its `--trainer` flag, else the YAML's key, else 'sync'."""
    for index, arg in enumerate(argv):
        if arg == "--trainer" and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith("--trainer="):
            return arg.split("=", 1)[1]
    return (config or {}).get("trainer", "sync")


def requested_plugins(argv: list[str], config: dict | None) -> list[str]:
    """The modules a command line asks to import (`trl_aspo.cli.plugins`): its `--plugins` words, else the YAML's
    `plugins` list; entries that are not text are left to the field's own check, which names them."""
    names = (config or {}).get("plugins")
    for flag, words in flag_values(without_config(argv)):
        if flag == "--plugins":
            names = words
    return [name for name in names if isinstance(name, str)] if isinstance(names, list) else []


def flag_values(argv: list[str]) -> list[tuple[str, list[str]]]:
    """The (flag, values) pairs of a command line without `--config FILE`: each `--flag` (or `--flag=value`) with the
    words that follow it up to the next `--flag`; words before any flag come as the flag ''."""
    pairs: list[tuple[str, list[str]]] = []
    for word in argv:
        if word.startswith("--"):
            flag, equals, value = word.partition("=")
            pairs.append((flag, [value] if equals else []))
        elif pairs:
            pairs[-1][1].append(word)
        else:
            pairs.append(("", [word]))
    return pairs


def check_command_line(argv: list[str]) -> tuple[dict[str, Any], str]:
    """Check a `trl-aspo train` command line (the `--config` file and the flags) without importing torch.

    Returns (the YAML mapping, the trainer); raises ConfigurationError listing every problem found."""
    problems: list[str] = []
    path = config_path(argv)
    config = read_config(path) if path is not None else {}
    trainer = requested_trainer(argv, config)
    table = field_table()
    if trainer not in table["trainers"]:
        choices = list(table["trainers"])
        raise ConfigurationError(
            [f"trainer={trainer!r} is not one of the choices {choices}{suggestion(str(trainer), choices)}"]
        )
    fields = {field["name"]: field for field in table["trainers"][trainer]}
    # Before the values: a loss or estimator a plugin registers is a name its field accepts.
    problems += plugin_problems(requested_plugins(argv, config), fields)
    others = {
        other: {field["name"]: field["owner"] for field in table["trainers"][other]}
        for other in table["trainers"]
        if other != trainer
    }

    def unknown(key: str, where: str, written: str) -> str:
        for other, owners in others.items():
            if key in owners:
                return (
                    f"{written} ({where}): {key!r} is a field of {owners[key]} (trainer: {other}), which trainer: "
                    f"{trainer} does not take; remove it, or set trainer: {other}"
                )
        prefix = "--" if written.startswith("--") else ""
        return f"{written} ({where}): unknown {'flag' if prefix else 'key'}{suggestion(key, fields, prefix)}"

    where = f"in {path}"
    for key, value in config.items():
        if not isinstance(key, str):
            problems.append(
                f"key {shown(key)} ({where}): keys are field names (text), not the {type(key).__name__} {shown(key)}"
            )
            continue
        if key in YAML_ONLY_KEYS:
            continue
        if key not in fields:
            problems.append(unknown(key, where, key))
            continue
        problem = value_problem(fields[key], value, where)
        if problem:
            problems.append(problem)
        elif key == "model_name_or_path":
            problems.append(missing_path_problem(f"model_name_or_path ({where})", value))
        elif key == "resume_from_checkpoint" and isinstance(value, str):
            problems.append(missing_checkpoint(value, f"resume_from_checkpoint ({where})"))

    by_option = {option: field for field in fields.values() for option in field["options"]}
    negations = {option: field for field in fields.values() for option in field["negations"]}
    for flag, values in flag_values(without_config(argv)):
        if flag == "":
            problems.append(f"{' '.join(values)!r} (command line): a word without a --flag before it")
            continue
        if flag in negations:
            if values:
                problems.append(f"{flag} (command line): takes no value, got {' '.join(values)!r}")
            continue
        field = by_option.get(flag)
        if field is None:
            problems.append(unknown(flag[2:].replace("-", "_"), "command line", flag))
            continue
        if field["list"]:
            value = values
            if not values:
                problems.append(f"{flag} (command line): needs one or more values")
                continue
        elif field["value_optional"] and not values:
            continue
        elif len(values) != 1:
            got = f"got {' '.join(values)!r}" if values else "got none"
            problems.append(f"{flag} (command line): takes one value, {got}")
            continue
        else:
            value = values[0]
        problem = value_problem(field, value, "command line")
        if problem:
            problems.append(problem)
        elif field["name"] == "model_name_or_path":
            problems.append(missing_path_problem(f"{flag} (command line)", value))
        elif field["name"] == "resume_from_checkpoint":
            problems.append(missing_checkpoint(value, f"{flag} (command line)"))
    problems = [problem for problem in problems if problem]
    if problems:
        raise ConfigurationError(problems)
    return config, trainer


def missing_checkpoint(value: str, what: str) -> str | None:
    # Trainer.train reads a true value as "the latest checkpoint in output_dir"; anything else is a folder.
    if value.lower() in TRUE_WORDS + FALSE_WORDS or Path(value).expanduser().is_dir():
        return None
    return f"{what} {value!r}: no such directory"


def given_values(argv: list[str], config: dict[str, Any], fields: dict[str, dict]) -> dict[str, Any]:
    """The fields a checked command line sets, typed (`typed_value`): the YAML's keys, then its flags over them."""
    values = {key: typed_value(fields[key], value) for key, value in config.items() if key in fields}
    by_option = {option: field for field in fields.values() for option in field["options"]}
    negations = {option: field for field in fields.values() for option in field["negations"]}
    for flag, words in flag_values(without_config(argv)):
        if flag in negations:
            values[negations[flag]["name"]] = False
        elif flag in by_option:
            field = by_option[flag]
            if field["list"]:
                value = words
            elif not words:
                value = "true"  # a boolean flag given alone (`--use_cpu`)
            else:
                value = words[0]
            values[field["name"]] = typed_value(field, value)
    return values


def config_value_problems(config: dict[str, Any], where: str) -> list[str]:
    """`value_problem` of every key of a config mapping that is a field of its trainer's config (other keys are
    left to the parser, which names them)."""
    trainers = field_table()["trainers"]
    fields = {field["name"]: field for field in trainers.get(config.get("trainer", "sync"), [])}
    found = (value_problem(fields[key], value, where) for key, value in config.items() if key in fields)
    return [problem for problem in found if problem]


def typed_config(config: dict[str, Any], trainer: str | None = None) -> dict[str, Any]:
    """A config mapping with every value of a known field typed (`typed_value`), for comparing two configs as the
    runs they make: `learning_rate: '2e-4'` and `learning_rate: 0.0002` are one run."""
    trainers = field_table()["trainers"]
    fields = {field["name"]: field for field in trainers.get(trainer or config.get("trainer", "sync"), [])}
    return {key: typed_value(fields[key], value) if key in fields else value for key, value in config.items()}
