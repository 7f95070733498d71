"""The checks and help of `trl-aspo train` / `evaluate` command lines, run before torch or TRL is imported.

A command line is a `--config` YAML file plus `--key value` flags over the fields of the dataclasses
`trl_aspo.cli.parsers.config_classes(trainer)` returns. Every mistake in it (a missing file, an unknown key in the YAML
or as a flag, a key of the other trainer, a value its field's type or choices refuse, a scalar where a list belongs,
a local-looking path that does not exist) is collected into one `ConfigurationError`, which `report` prints as one
block and exits with status 2: no traceback, and before any model loads.

The fields come from `train_fields.json`, a table generated from the dataclasses (`python -m trl_aspo.cli.arguments
--write`; a test regenerates it and compares) and recorded with the TRL and transformers versions it was made with.
It answers only when those are the installed versions; otherwise the table is rebuilt from the dataclasses (which
imports them, and so torch). A committed table, rather than parsing the dataclass sources, keeps TRL's and
transformers' fields (defined in their own files, with types HfArgumentParser resolves) exactly as the real parser
sees them, and the version stamp keeps it from answering for a TRL it was not made from.
"""

from __future__ import annotations

import difflib
import json
import shutil
import sys
import textwrap
from importlib import metadata
from pathlib import Path
from typing import Any, NoReturn

FIELD_TABLE = Path(__file__).with_name("train_fields.json")
# Keys of a `trl-aspo train` YAML that are not dataclass fields: TrlParser reads `env` itself.
YAML_ONLY_KEYS = ("env",)
# File suffixes that make a name a path rather than a hub id.
PATH_SUFFIXES = (".yaml", ".yml", ".json", ".jsonl", ".bin", ".pt", ".safetensors", ".txt")
LAUNCH_FLAG_HELP = (
    ("--num_processes N", "run N processes through `accelerate launch` (DDP without a config file)"),
    ("--accelerate_config FILE", "an accelerate config (DeepSpeed, FSDP, several machines): see configs/accelerate/"),
    ("--num_machines, --machine_rank, --main_process_ip, --main_process_port", "several machines"),
    ("--mixed_precision, --multi_gpu", "passed to `accelerate launch`"),
)
TRUE_WORDS, FALSE_WORDS = ("yes", "true", "t", "y", "1"), ("no", "false", "f", "n", "0")


class ConfigurationError(ValueError):
    """Every mistake found in a configuration, one line each (key or flag first, then what is allowed)."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


def report(prog: str, error: ConfigurationError, hint: str | None = None) -> NoReturn:
    """Print `error` as one block on stderr (one line for one problem) and exit with status 2 (argparse's status for
    a bad command line)."""
    count = len(error.problems)
    if count == 1:
        lines = [f"{prog}: {error.problems[0]}"]
    else:
        lines = [f"{prog}: {count} configuration errors:", *(f"  {problem}" for problem in error.problems)]
    lines.append(hint or f"Run `{prog} --help` for every field.")
    print("\n".join(lines), file=sys.stderr)
    raise SystemExit(2)


# ------------------------------------------------------------------------------------------------- the field table
def installed_versions() -> dict[str, str]:
    """The versions of the libraries whose dataclass fields the table holds (read without importing them)."""
    return {name: metadata.version(name) for name in ("trl", "transformers")}


def build_field_table() -> dict[str, Any]:
    """The field table, from the dataclasses and the parser `trl-aspo train` builds (imports torch and TRL)."""
    import dataclasses

    from trl_aspo.cli.parsers import TRAINERS, config_classes, make_parser
    from trl_aspo.config.fields import field_spec

    titles = {
        "ASPOScriptArguments": "trl-aspo: what to train on, evaluation and trainer choice (ASPOScriptArguments)",
        "AsyncModelArguments": "trl-aspo: the model (AsyncModelArguments)",
        "ASPOConfig": "TRL GRPOConfig and transformers TrainingArguments",
        "AsyncASPOConfig": "TRL AsyncGRPOConfig and transformers TrainingArguments",
    }

    def group(cls, config_field) -> str:
        # trl-aspo's fields by the section each is declared in (trl_aspo.config.fields): help groups by method.
        # `loss_type` (TRL's field in ASPOConfig) is declared with the loss: its value 'aspo' switches it on.
        spec = field_spec(config_field)
        if spec is not None:
            return f"trl-aspo: {spec.section.title}"
        return titles.get(cls.__name__, f"TRL {cls.__name__}")

    def kind(action) -> str:
        if action.choices is not None:
            return "choice"
        if getattr(action.type, "__name__", None) == "string_to_bool":  # TRL's copy of transformers' function
            return "bool"
        return {int: "int", float: "float", str: "str"}.get(action.type, "other")

    def jsonable(value):
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            return str(value)
        return value

    trainers = {}
    for trainer in TRAINERS:
        parser = make_parser(trainer=trainer)
        actions: dict[str, list] = {}
        for action in parser._actions:
            actions.setdefault(action.dest, []).append(action)
        fields = []
        for cls in config_classes(trainer):
            for config_field in dataclasses.fields(cls):
                if not config_field.init or config_field.name not in actions:
                    continue
                main, *negations = actions[config_field.name]
                fields.append(
                    {
                        "name": config_field.name,
                        "owner": cls.__name__,
                        "group": group(cls, config_field),
                        "kind": kind(main),
                        "choices": None if main.choices is None else [jsonable(c) for c in main.choices],
                        "list": main.nargs == "+",
                        "value_optional": main.nargs == "?",
                        "default": jsonable(main.default),
                        "help": " ".join(str(main.help or "").split()),
                        "options": list(main.option_strings),
                        "negations": [option for action in negations for option in action.option_strings],
                    }
                )
        trainers[trainer] = fields
    return {"versions": installed_versions(), "trainers": trainers}


def field_table() -> dict[str, Any]:
    """The committed table when it was made from the installed TRL and transformers, else one built now."""
    try:
        table = json.loads(FIELD_TABLE.read_text())
    except (OSError, ValueError):
        table = None
    if table is not None and table.get("versions") == installed_versions():
        return table
    return build_field_table()


def write_field_table() -> None:
    FIELD_TABLE.write_text(json.dumps(build_field_table(), indent=1, ensure_ascii=False) + "\n")


# ------------------------------------------------------------------------------------------------------- paths
def looks_local(name: str) -> bool:
    """Whether `name` means a local path rather than a hub id ('org/name'): it is absolute, starts with '.' or '~',
    has a backslash or several '/', ends with a file suffix, or its first component is a local folder."""
    if name.startswith(("/", ".", "~")) or "\\" in name or name.count("/") > 1 or name.endswith(PATH_SUFFIXES):
        return True
    return "/" in name and Path(name.split("/", 1)[0]).is_dir()


def missing_path_problem(what: str, name: str, kind: str = "directory") -> str | None:
    """The message for a local-looking `name` that does not exist (None when it exists or is no local path)."""
    if not isinstance(name, str) or name.startswith("builtin:") or not looks_local(name):
        return None
    if Path(name).expanduser().exists():
        return None
    return f"{what} {name!r}: no such {kind}"


# --------------------------------------------------------------------------------------------- the command line
def config_path(argv: list[str]) -> str | None:
    if "--config" in argv:
        index = argv.index("--config")
        return argv[index + 1] if index + 1 < len(argv) else ""
    return None


def read_config(path: str) -> dict[str, Any]:
    """The mapping of a `--config` YAML file; ConfigurationError naming the file when it cannot be one."""
    import yaml

    if path == "":
        raise ConfigurationError(["--config: needs a YAML file"])
    if not Path(path).expanduser().is_file():
        raise ConfigurationError([f"--config {path!r}: no such file"])
    try:
        with open(Path(path).expanduser()) as handle:
            config = yaml.safe_load(handle)
    except yaml.YAMLError as error:
        raise ConfigurationError([f"--config {path!r}: not valid YAML: {' '.join(str(error).split())}"]) from None
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise ConfigurationError(
            [f"--config {path!r}: must hold a mapping of keys to values, not a {type(config).__name__}"]
        )
    env = config.get("env", {})
    if not isinstance(env, dict):
        raise ConfigurationError([f"env (in {path}): must be a mapping of variable names to values"])
    return config


def requested_trainer(argv: list[str], config: dict | None) -> str:
    """The `trainer` a command line asks for: its `--trainer` flag, else the YAML's key, else 'sync'."""
    for index, arg in enumerate(argv):
        if arg == "--trainer" and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith("--trainer="):
            return arg.split("=", 1)[1]
    return (config or {}).get("trainer", "sync")


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


def _suggest(word: str, names) -> str:
    match = difflib.get_close_matches(word, list(names), n=1)
    return f"; did you mean {match[0]}?" if match else ""


def value_problem(field: dict[str, Any], value: Any, where: str) -> str | None:
    """Why `value` (a YAML value or a flag's words) does not fit `field`, as argparse would convert it; None if
    it fits. Only text is converted (as argparse converts only text): other YAML values go to the dataclass."""
    name = field["name"]
    if field["list"]:
        if not isinstance(value, list):
            shown = f"[{value}]" if isinstance(value, str) else "[...]"
            return f"{name} ({where}): a list, e.g. {shown}; got the {type(value).__name__} {value!r}"
        items = value
    else:
        items = [value]
    for item in items:
        if not isinstance(item, str):
            continue
        kind = field["kind"]
        if kind == "choice":
            allowed = [str(choice) for choice in field["choices"]]
            if item not in allowed:
                return f"{name} ({where}): {item!r} is not one of {allowed}{_suggest(item, allowed)}"
        elif kind == "bool" and item.lower() not in TRUE_WORDS + FALSE_WORDS:
            return f"{name} ({where}): {item!r} is not true or false"
        elif kind in ("int", "float"):
            try:
                (int if kind == "int" else float)(item)
            except ValueError:
                return f"{name} ({where}): {item!r} is not {'an integer' if kind == 'int' else 'a number'}"
    return None


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
            [f"trainer={trainer!r} is not one of the choices {choices}{_suggest(str(trainer), choices)}"]
        )
    fields = {field["name"]: field for field in table["trainers"][trainer]}
    others = {
        other: {field["name"]: field["owner"] for field in table["trainers"][other]}
        for other in table["trainers"]
        if other != trainer
    }

    def unknown(key: str, where: str, shown: str) -> str:
        for other, owners in others.items():
            if key in owners:
                return (
                    f"{shown} ({where}): {key!r} is a field of {owners[key]} (trainer: {other}), which trainer: "
                    f"{trainer} does not take; remove it, or set trainer: {other}"
                )
        match = difflib.get_close_matches(key, list(fields), n=1)
        prefix = "--" if shown.startswith("--") else ""
        return f"{shown} ({where}): unknown {'flag' if prefix else 'key'}" + (
            f"; did you mean {prefix}{match[0]}?" if match else ""
        )

    where = f"in {path}"
    for key, value in config.items():
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
            problems.append(_missing_checkpoint(value, f"resume_from_checkpoint ({where})"))

    by_option = {option: field for field in fields.values() for option in field["options"]}
    negations = {option: field for field in fields.values() for option in field["negations"]}
    without_config = list(argv)
    if path is not None:
        index = without_config.index("--config")
        del without_config[index : index + 2]
    for flag, values in flag_values(without_config):
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
            problems.append(_missing_checkpoint(value, f"{flag} (command line)"))
    problems = [problem for problem in problems if problem]
    if problems:
        raise ConfigurationError(problems)
    return config, trainer


def _missing_checkpoint(value: str, what: str) -> str | None:
    # Trainer.train reads a true value as "the latest checkpoint in output_dir"; anything else is a folder.
    if value.lower() in TRUE_WORDS + FALSE_WORDS or Path(value).expanduser().is_dir():
        return None
    return f"{what} {value!r}: no such directory"


# --------------------------------------------------------------------------------------------------------- help
def format_train_help(trainer: str = "sync", table: dict[str, Any] | None = None, width: int | None = None) -> str:
    """`trl-aspo train --help`: usage, the launcher flags, then every field of `trainer`'s config, trl-aspo's
    fields first (grouped by method), TRL's and transformers' after; each with its type, choices and default."""
    table = table or field_table()
    width = width or min(shutil.get_terminal_size((100, 24)).columns, 119)
    other = "async" if trainer == "sync" else "sync"
    trainer_class = {
        "sync": "ASPOTrainer, on TRL's GRPOTrainer",
        "async": "AsyncASPOTrainer, on TRL's AsyncGRPOTrainer",
    }
    description = (
        f"The fields of trainer: {trainer} ({trainer_class.get(trainer, trainer)}). Each may be a key of the --config "
        "YAML (key: value) or a flag (--key value); flags override the YAML. Booleans take true/false; lists take "
        f"several words (--reward_funcs a b) or a YAML list ([a, b]). For trainer: {other}, run `trl-aspo train "
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
        metavar = "{" + ",".join(str(choice) for choice in field["choices"]) + "}"
    usage = f"--{field['name']} {metavar}" + (" [...]" if field["list"] else "")
    return usage


def _field_help(field: dict[str, Any]) -> str:
    text = field["help"]
    if field["negations"]:
        text += f" ({field['negations'][0]} sets it false.)"
    return f"{text} (default: {field['default']})"


def _entry(usage: str, text: str, width: int) -> list[str]:
    return [f"  {usage}", *textwrap.wrap(text, width=width, initial_indent=" " * 8, subsequent_indent=" " * 8)]


def main(argv: list[str] | None = None) -> int:
    """`python -m trl_aspo.cli.arguments --write` regenerates train_fields.json; `--check` says whether it is
    current."""
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--write"]:
        write_field_table()
        return 0
    if argv == ["--check"]:
        current = json.loads(FIELD_TABLE.read_text()) == json.loads(
            json.dumps(build_field_table(), ensure_ascii=False)
        )
        if not current:
            print(f"{FIELD_TABLE} is stale: run `python -m trl_aspo.cli.arguments --write`.")
        return 0 if current else 1
    print("usage: python -m trl_aspo.cli.arguments --write | --check", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
