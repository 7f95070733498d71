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
import importlib.util
import itertools
import json
import reprlib
import shlex
import shutil
import sys
import textwrap
from importlib import metadata
from pathlib import Path
from typing import Any, NoReturn

from trl_aspo.trainers.resume import existing_checkpoints, resolve_resume_checkpoint

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
# Nodes that YAML aliases may add beyond those written in a file: a config holds a few hundred values, while nine
# nested lists of ten aliases each (the "billion laughs") stand for 10^9.
ALIAS_EXPANSION_LIMIT = 100_000
# A value in a message is shown at most this long (a repr is built only up to its bounds: see `shown`).
SHOWN_CHARACTERS = 120
_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxlevel, _SHORT_REPR.maxstring, _SHORT_REPR.maxother = 3, 80, 80
_SHORT_REPR.maxlist = _SHORT_REPR.maxtuple = _SHORT_REPR.maxdict = _SHORT_REPR.maxset = 6
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
# Stands for every value of a text switch that its dependency's condition does not name (see `_switch_domain`).
OTHER_TEXT = "\u0000any other value"


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


def shown(value: Any) -> str:
    """A bounded repr of `value` for a message: nested containers are cut after a few items and levels while the repr
    is built (so an enormous value costs no memory), then the text after `SHOWN_CHARACTERS`."""
    text = _SHORT_REPR.repr(value)
    return text if len(text) <= SHOWN_CHARACTERS else text[: SHOWN_CHARACTERS - 3] + "..."


# ----------------------------------------------------------------------------------------------------------- YAML
def load_yaml(text: str, source: str) -> Any:
    """The value of one YAML document, read as every `trl-aspo` command reads YAML (`--config` files of train,
    evaluate and compare, `compare key=value` overrides): YAML's safe types only, and aliases that stand for at most
    `ALIAS_EXPANSION_LIMIT` nodes beyond those written. ConfigurationError naming `source` (and the line) otherwise.

    Aliases are bounded rather than refused: a variant written as `<<: *common` plus its own keys is plain YAML.
    An alias does not copy its node (the loaded value shares it), but every consumer of a config walks it as a
    tree (the dataclass checks, `json.dumps` of a run config, a repr in a message), and a tree of 10^9 nodes ends
    in MemoryError there; the walk here counts each distinct node once (linear in the file)."""
    import yaml

    class BoundedLoader(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                self.aliases.setdefault(f"*{event.anchor}", event.start_mark.line + 1)
            return super().compose_node(parent, index)

    loader = BoundedLoader(text)
    loader.aliases = {}  # alias -> the line it is first used on
    try:
        node = loader.get_single_node()
        if node is not None and loader.aliases:
            written, expanded = _node_counts(node)
            if expanded - written > ALIAS_EXPANSION_LIMIT:
                named = [f"{alias} (line {line})" for alias, line in list(loader.aliases.items())[:3]]
                raise ConfigurationError(
                    [
                        f"{source}: its aliases ({', '.join(named)}"
                        f"{', ...' if len(loader.aliases) > 3 else ''}) expand to {expanded:,} values for the "
                        f"{written:,} written; at most {ALIAS_EXPANSION_LIMIT:,} more are allowed (an alias bomb?): "
                        "write the values out"
                    ]
                )
        return None if node is None else loader.construct_document(node)
    except yaml.constructor.ConstructorError as error:
        mark = error.problem_mark
        line = "" if mark is None else f" (line {mark.line + 1})"
        problem = " ".join(str(error.problem or error).split()).replace("tag:yaml.org,2002:", "!!")
        if "python/" in problem:
            problem = f"{problem}: trl-aspo reads plain YAML only, and python tags would build objects or run code"
        raise ConfigurationError([f"{source}{line}: {problem}"]) from None
    except RecursionError:
        raise ConfigurationError([f"{source}: nested too deeply, or an alias inside its own anchor"]) from None
    except yaml.YAMLError as error:
        raise ConfigurationError([f"{source}: not valid YAML: {' '.join(str(error).split())}"]) from None
    finally:
        loader.dispose()


def _node_counts(root) -> tuple[int, int]:
    """(distinct nodes, nodes counting each alias as a copy of its anchor's node) of a composed YAML node graph, each
    distinct node visited once; RecursionError for an alias inside its own anchor (a cycle)."""
    import yaml

    expanded: dict[int, int] = {}  # id of a distinct node -> its size counting aliases as copies
    visiting: set[int] = set()

    def walk(node) -> int:
        key = id(node)
        if key in expanded:
            return expanded[key]
        if key in visiting:
            raise RecursionError("an alias inside its own anchor")
        visiting.add(key)
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [item for pair in node.value for item in pair]
        else:
            children = []
        expanded[key] = 1 + sum(walk(child) for child in children)
        visiting.discard(key)
        return expanded[key]

    total = walk(root)
    return len(expanded), total


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
    dependencies = {trainer: dependency_table(config_classes(trainer)[1], trainers[trainer]) for trainer in TRAINERS}
    bounds = {trainer: bound_table(config_classes(trainer)[1]) for trainer in TRAINERS}
    return {"versions": installed_versions(), "trainers": trainers, "dependencies": dependencies, "bounds": bounds}


def bound_table(config_class) -> dict[str, dict]:
    """The declared range of each numeric field of `config_class` (`trl_aspo.config.fields.Bound`), as data
    `bound_problems` reads without importing the config."""
    from trl_aspo.config.fields import field_bounds, field_types

    types = field_types(config_class)
    return {
        name: {
            "config": config_class.__name__,
            "low": bound.low,
            "high": bound.high,
            "low_open": bound.low_open,
            "high_open": bound.high_open,
            "shown": str(bound),
            "optional": "None" in types.get(name, ()),
        }
        for name, bound in field_bounds(config_class).items()
    }


def dependency_table(config_class, fields: list[dict]) -> list[dict]:
    """The refusing dependencies of `config_class` (`trl_aspo.config.fields.Dependency`) that the given values
    alone decide, as data `dependency_problems` reads without importing the config: each with the values its
    switches can take (`_switch_domain`) and the combinations where the option does nothing (`fails`).

    Left out: dependencies with a numeric switch (no finite table), of an option whose default is derived in
    `__post_init__`, or whose condition reads more than its switches (it fails on the stand-in object)."""
    import dataclasses
    import types

    from trl_aspo.config.fields import config_dependencies, field_spec

    by_name = {field["name"]: field for field in fields}
    config_fields = {config_field.name: config_field for config_field in dataclasses.fields(config_class)}
    rows = []
    for dependency in config_dependencies(config_class, config_class._trainer):
        spec = field_spec(config_fields[dependency.option]) if dependency.option in config_fields else None
        if not dependency.refuse or dependency.option not in by_name or (spec is not None and spec.derived):
            continue
        domains = [_switch_domain(by_name.get(switch), dependency.holds) for switch in dependency.switches]
        if any(domain is None for domain in domains):
            continue
        try:
            fails = [
                list(values)
                for values in itertools.product(*domains)
                if not dependency.holds(types.SimpleNamespace(**dict(zip(dependency.switches, values, strict=True))))
            ]
        except Exception:  # noqa: BLE001 - a condition that reads more than its switches: left to the config
            continue
        rows.append(
            {
                "config": config_class.__name__,
                "option": dependency.option,
                "switches": list(dependency.switches),
                "needs": dependency.needs,
                "why": dependency.why,
                "domains": domains,
                "fails": fails,
            }
        )
    return rows


def _switch_domain(field: dict | None, holds) -> list | None:
    """The values a switch of `holds` is tabulated over: a boolean's two, a choice's choices, and for text the
    default, the strings the condition names (its constants, and the strings of the tuples and sets it reads) and
    `OTHER_TEXT` standing for any other string (a condition that only compares with named strings treats them
    alike). None for any other kind of switch."""
    if field is None:
        return None
    if field["kind"] == "bool":
        return [True, False]
    if field["kind"] == "choice":
        return list(field["choices"])
    if field["kind"] != "str" or field["list"]:
        return None
    code = holds.__code__
    named = [value for value in code.co_consts if isinstance(value, str)]
    for name in code.co_names:
        value = holds.__globals__.get(name)
        if isinstance(value, tuple | frozenset | set | list):
            named += [item for item in value if isinstance(item, str)]
    return list(dict.fromkeys([field["default"], *named, OTHER_TEXT]))


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
    if path == "":
        raise ConfigurationError(["--config: needs a YAML file"])
    if not Path(path).expanduser().is_file():
        raise ConfigurationError([f"--config {path!r}: no such file"])
    try:
        text = Path(path).expanduser().read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigurationError([f"--config {path!r}: cannot be read: {error}"]) from None
    config = load_yaml(text, f"--config {path!r}")
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


_KIND_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false", "choice": "one of its choices"}
# The built-in names of trl_aspo.builtin.registry, spelled out: importing `trl_aspo.builtin` loads the built-in
# models (torch), which these checks must not (tests/unit/test_cli_first_hour.py compares them with the registry).
BUILTIN_REWARD_NAMES = ("builtin:correctness",)
BUILTIN_TOOL_NAMES = ("builtin:calculator", "builtin:one-op-calculator")
BUILTIN_DATASET_NAMES = ("builtin:calculator", "builtin:multicall")
# List fields whose entries name functions: the built-in names each accepts.
NAME_LISTS = {"reward_funcs": BUILTIN_REWARD_NAMES, "tools": BUILTIN_TOOL_NAMES}


def _suggest(word: str, names) -> str:
    match = difflib.get_close_matches(word, list(names), n=1)
    return f"; did you mean {match[0]}?" if match else ""


def value_problem(field: dict[str, Any], value: Any, where: str) -> str | None:
    """Why `value` (a YAML value or a flag's words) does not fit `field`, as argparse would convert it; None if
    it fits. Only text is converted (as argparse converts only text): other YAML values go to the dataclass, except
    a list or mapping for a number, a boolean or a choice, and a non-text entry of a list of function names."""
    name = field["name"]
    if field["list"]:
        if not isinstance(value, list):
            example = f"[{value}]" if isinstance(value, str) else "[...]"
            return f"{name} ({where}): a list, e.g. {example}; got the {type(value).__name__} {shown(value)}"
        items = value
    else:
        items = [value]
        if isinstance(value, list | dict) and field["kind"] in ("int", "float", "bool", "choice"):
            return f"{name} ({where}): one value ({_KIND_WORDS[field['kind']]}), not the {type(value).__name__} " + (
                shown(value)
            )
    if name in NAME_LISTS:
        for item in items:
            if not isinstance(item, str):
                return (
                    f"{name} ({where}): entry {shown(item)} ({type(item).__name__}) is not a name; each entry is a "
                    f"built-in name {sorted(NAME_LISTS[name])} or a dotted import path 'module.function'"
                )
    for item in items:
        if not isinstance(item, str):
            continue
        kind = field["kind"]
        if kind == "choice":
            allowed = [str(choice) for choice in field["choices"]]
            if item not in allowed:
                return f"{name} ({where}): {shown(item)} is not one of {allowed}{_suggest(item, allowed)}"
        elif kind == "bool" and item.lower() not in TRUE_WORDS + FALSE_WORDS:
            return f"{name} ({where}): {shown(item)} is not true or false"
        elif kind in ("int", "float"):
            try:
                (int if kind == "int" else float)(item)
            except ValueError:
                return f"{name} ({where}): {shown(item)} is not {_KIND_WORDS[kind]}"
    return None


def config_value_problems(config: dict[str, Any], where: str) -> list[str]:
    """`value_problem` of every key of a config mapping that is a field of its trainer's config (other keys are
    left to the parser, which names them)."""
    trainers = field_table()["trainers"]
    fields = {field["name"]: field for field in trainers.get(config.get("trainer", "sync"), [])}
    found = (value_problem(fields[key], value, where) for key, value in config.items() if key in fields)
    return [problem for problem in found if problem]


def typed_value(field: dict[str, Any], value: Any) -> Any:
    """`value` with the type its field gives it, as argparse converts a flag's text (and TrlParser a YAML default
    that is text: YAML 1.1 reads `2e-4` as a string): numbers, booleans and choices; anything else unchanged."""
    if field["list"] and isinstance(value, list):
        return [typed_value({**field, "list": False}, item) for item in value]
    if not isinstance(value, str):
        return value
    kind = field["kind"]
    try:
        if kind == "int":
            return int(value)
        if kind == "float":
            return float(value)
    except ValueError:
        return value
    if kind == "bool" and value.lower() in TRUE_WORDS + FALSE_WORDS:
        return value.lower() in TRUE_WORDS
    if kind == "choice":
        return next((choice for choice in field["choices"] if str(choice) == value), value)
    return value


def typed_config(config: dict[str, Any], trainer: str | None = None) -> dict[str, Any]:
    """A config mapping with every value of a known field typed (`typed_value`), for comparing two configs as the
    runs they make: `learning_rate: '2e-4'` and `learning_rate: 0.0002` are one run."""
    trainers = field_table()["trainers"]
    fields = {field["name"]: field for field in trainers.get(trainer or config.get("trainer", "sync"), [])}
    return {key: typed_value(fields[key], value) if key in fields else value for key, value in config.items()}


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


# ------------------------------------------------------------------------------------- `trl-aspo train` as a whole
def given_values(argv: list[str], config: dict[str, Any], fields: dict[str, dict]) -> dict[str, Any]:
    """The fields a checked command line sets, typed (`typed_value`): the YAML's keys, then its flags over them."""
    values = {key: typed_value(fields[key], value) for key, value in config.items() if key in fields}
    by_option = {option: field for field in fields.values() for option in field["options"]}
    negations = {option: field for field in fields.values() for option in field["negations"]}
    without_config = list(argv)
    if "--config" in without_config:
        index = without_config.index("--config")
        del without_config[index : index + 2]
    for flag, words in flag_values(without_config):
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


def check_train_command_line(argv: list[str]) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """`check_command_line`, then what a training run needs that only the values show, all before torch loads: a
    model, reward functions and a dataset; each `report_to` integration installed; the loss-dependent options
    (`dependency_problems`); a checkpoint to resume from when `resume_from_checkpoint` is true.

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
    out_of_range = bound_problems(values, table.get("bounds", {}).get(trainer, {}))
    problems += out_of_range.values()
    # An option out of its range is refused for that alone (the config checks ranges before dependencies).
    unbounded = {name: value for name, value in values.items() if name not in out_of_range}
    problems += dependency_problems(unbounded, fields, table.get("dependencies", {}).get(trainer, []))
    try:
        resolve_resume_checkpoint(values.get("resume_from_checkpoint"), output_dir(values))
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
            problems.append(f"report_to: {shown(name)} is not one of {allowed}{_suggest(str(name), allowed)}")
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
    return above and below


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
