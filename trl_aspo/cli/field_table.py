"""The field table: what the `trl-aspo train` / `evaluate` checks and `train --help` know of every field, as data.

It is built from the dataclasses `trl_aspo.cli.parsers.config_classes(trainer)` returns and the parser
`trl-aspo train` builds from them (which imports torch and TRL), so it holds TRL's and transformers' fields exactly
as the real parser sees them; `trl_aspo.cli.field_cache` keeps it between runs, so the checks answer before torch
loads. Per trainer it holds each field (its kind, choices, default, help and options), the declared ranges of the
numbers (`bound_table`) and the dependencies its values alone decide (`dependency_table`).

A field whose choices a registry holds (`loss_type`, `advantage_estimator`: `Section.field(choices=<function>)`)
has no choices in the parser (a name registered later must pass argparse); its choices are the registry's names
when the table is built, and `registry` names the module of the config declaring it, where a process that has
loaded that config reads the names registered since (`trl_aspo.cli.value_checks.field_choices`).
"""

from __future__ import annotations

import itertools
import json
from typing import Any

# Stands for every value of a text switch that its dependency's condition does not name (see `_switch_domain`).
OTHER_TEXT = "\u0000any other value"
# The help group of the fields of each class that no trl-aspo section declares.
GROUP_TITLES = {
    "ASPOScriptArguments": "trl-aspo: what to train on, evaluation and trainer choice (ASPOScriptArguments)",
    "AsyncModelArguments": "trl-aspo: the model (AsyncModelArguments)",
    "ASPOConfig": "TRL GRPOConfig and transformers TrainingArguments",
    "AsyncASPOConfig": "TRL AsyncGRPOConfig and transformers TrainingArguments",
}
# The names argparse's type converters have in HfArgumentParser: TRL wraps an optional number's converter so the
# words 'none' and 'null' give None, and gives the wrapper the inner converter's name.
CONVERTER_KINDS = {"int": "int", "float": "float", "str": "str", "string_to_bool": "bool"}


def build_field_table() -> dict[str, Any]:
    """The field table of every trainer (imports torch and TRL)."""
    from trl_aspo.cli.parsers import TRAINERS, config_classes

    trainers = {trainer: trainer_fields(trainer) for trainer in TRAINERS}
    dependencies = {trainer: dependency_table(config_classes(trainer)[1], trainers[trainer]) for trainer in TRAINERS}
    bounds = {trainer: bound_table(config_classes(trainer)[1]) for trainer in TRAINERS}
    return {"trainers": trainers, "dependencies": dependencies, "bounds": bounds}


def trainer_fields(trainer: str) -> list[dict[str, Any]]:
    """Every field a `trainer` command line may set, in the order of its classes and their fields."""
    import dataclasses

    from trl_aspo.cli.parsers import config_classes, make_parser
    from trl_aspo.config.fields import field_spec

    actions: dict[str, list] = {}
    for action in make_parser(trainer=trainer)._actions:
        actions.setdefault(action.dest, []).append(action)
    fields = []
    for cls in config_classes(trainer):
        for config_field in dataclasses.fields(cls):
            if not config_field.init or config_field.name not in actions:
                continue
            main, *negations = actions[config_field.name]
            spec = field_spec(config_field)
            registry = spec is not None and callable(spec.choices)
            if registry:
                trainer_choices = spec.allowed_choices(getattr(cls, "_trainer", None))
                choices = [*trainer_choices, *([None] if config_field.default is None else [])]
            else:
                choices = None if main.choices is None else [_jsonable(choice) for choice in main.choices]
            converter = CONVERTER_KINDS.get(getattr(main.type, "__name__", None), "other")
            fields.append(
                {
                    "name": config_field.name,
                    "owner": cls.__name__,
                    # trl-aspo's fields by the section each is declared in (trl_aspo.config.fields): help groups by
                    # method.
                    "group": f"trl-aspo: {spec.section.title}"
                    if spec
                    else GROUP_TITLES.get(cls.__name__, f"TRL {cls.__name__}"),
                    "kind": "choice" if choices is not None else converter,
                    "choices": choices,
                    "registry": cls.__module__ if registry else None,
                    "list": main.nargs == "+",
                    "value_optional": main.nargs == "?",
                    # TRL's wrapped converter of an optional number reads 'none' and 'null' as None.
                    "none_words": converter in ("int", "float") and main.type not in (int, float),
                    "default": _jsonable(main.default),
                    "help": " ".join(str(main.help or "").split()),
                    "options": list(main.option_strings),
                    "negations": [option for action in negations for option in action.option_strings],
                }
            )
    return fields


def _jsonable(value):
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return str(value)
    return value


def bound_table(config_class) -> dict[str, dict]:
    """The declared range of each numeric field of `config_class` (`trl_aspo.config.fields.Bound`), as data
    `trl_aspo.cli.run_checks.bound_problems` reads without importing the config."""
    from trl_aspo.config.fields import field_bounds, field_types

    types = field_types(config_class)
    return {
        name: {
            "config": config_class.__name__,
            "low": bound.low,
            "high": bound.high,
            "low_open": bound.low_open,
            "high_open": bound.high_open,
            "excluded": list(bound.excluded),
            "shown": str(bound),
            "optional": "None" in types.get(name, ()),
        }
        for name, bound in field_bounds(config_class).items()
    }


def dependency_table(config_class, fields: list[dict]) -> list[dict]:
    """The refusing dependencies of `config_class` (`trl_aspo.config.fields.Dependency`) that the given values
    alone decide, as data `trl_aspo.cli.run_checks.dependency_problems` reads without importing the config: each
    with the values its switches can take (`_switch_domain`) and the combinations where the option does nothing
    (`fails`).

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
