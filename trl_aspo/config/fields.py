"""How a trl-aspo config field is declared, and the one checker that applies the declarations.

A field is declared once, with everything about it: `SECTION.field(default, help=..., bound=..., choices=...,
depends=..., checks=..., resume=..., ...)` in the class body, where `SECTION` is the `Section` it belongs to. Its help
and choices go in `dataclasses.field(metadata=...)`: those are the keys `HfArgumentParser` hands to
`argparse.add_argument`, which refuses any other, so the rest of the declaration is the field's `FieldSpec`, read
with `field_spec(field)`.

`check_values` (before the TRL base config's `__post_init__`) and `check_dependencies` (after it, which derives fields
some conditions read) apply the declarations of a config's fields, for `ASPOConfig` and `AsyncASPOConfig` alike. A
rule for one trainer only says so with `only=SYNC` or `only=ASYNC` (the config's `_trainer`). The tables of
trl_aspo.config.aspo_config (`FIELD_BOUNDS`, `FIELD_DEPENDENCIES`, ...) are views of the declarations.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import textwrap
import types as types_module
import typing
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# The trainers of `trl-aspo train --trainer`: the `_trainer` of ASPOConfig and AsyncASPOConfig.
SYNC, ASYNC = "sync", "async"


@dataclass(frozen=True)
class Bound:
    """The range a numeric field accepts: [low, high], with either end open. Every number a config accepts is bounded,
    so no combination of accepted values overflows float32 in the advantage or the loss (1e308 is finite, but a bonus
    of 1e308 makes every advantage it touches infinite and the weights NaN after one step)."""

    low: float
    high: float
    low_open: bool = False
    high_open: bool = False
    # Values inside the range that are not allowed (TRL's max_inflight_tasks: -1 means automatic, 0 never generates).
    excluded: tuple[float, ...] = ()

    def holds(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below and value not in self.excluded

    def __str__(self) -> str:
        shown = f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        return shown + "".join(f" except {value:g}" for value in self.excluded)


# Fields of TRL's and transformers' configs whose documented domain neither checks when the config is built: outside
# it a run fails once the model has loaded, with a message that names no field (torch's sampler: "batch_size should
# be a positive integer value"; generate: "`temperature` (=0.0) has to be a strictly positive float"), or never ends
# (max_staleness < 0 drops every sample). Checked like the declared fields, by both configs and before torch loads.
TRL_FIELD_BOUNDS = {
    "per_device_train_batch_size": Bound(1, 10**9),
    "gradient_accumulation_steps": Bound(1, 10**9),
    "max_completion_length": Bound(1, 10**9),
    "temperature": Bound(0, 1e6, low_open=True),  # the trainers divide the logits by it
    "top_p": Bound(0, 1, low_open=True),  # TRL's documented (0, 1]
    "top_k": Bound(-1, 10**9),  # 0 turns top-k off, and -1 under vLLM (transformers' generate refuses it by name)
    "epsilon": Bound(0, 1e6),
    "epsilon_high": Bound(0, 1e6),
    "beta": Bound(0, 1e6),
    "num_iterations": Bound(1, 10**9),
    "steps_per_generation": Bound(1, 10**9),
    "generation_batch_size": Bound(1, 10**9),
    "max_staleness": Bound(0, 10**9),
    "weight_sync_steps": Bound(1, 10**9),
    "max_inflight_tasks": Bound(-1, 10**9, excluded=(0,)),  # -1: sized from max_staleness and the batch
}


@dataclass(frozen=True)
class Dependency:
    """`option`, set away from its default, acts only while `holds(config)`; otherwise it is refused with a
    `ValueError` (it would do nothing or be wrong) or, where the combination can be intentional, warned about. Both
    messages name `option` and the `switches` the condition reads, with their values."""

    option: str
    switches: tuple[str, ...]
    needs: str
    holds: typing.Callable[[typing.Any], bool]
    why: str
    refuse: bool = True


@dataclass(frozen=True)
class Needs:
    """A `Dependency` as its option's field declares it (the field is the option). `only`: one trainer's rule."""

    switches: tuple[str, ...]
    needs: str
    holds: Callable[[Any], bool]
    why: str
    refuse: bool = True
    only: str | None = None

    def of(self, option: str) -> Dependency:
        return Dependency(option, self.switches, self.needs, self.holds, self.why, self.refuse)


@dataclass(frozen=True)
class Check:
    """A rule between fields that no bound, choice or dependency states: `ok(config)` must hold, else the `ValueError`
    `Config.name=value is invalid: allowed.`, where `name` is the declaring field unless given and `allowed` may be
    a function of the config. A field's `checks` may also hold plain functions `(config, field_name) -> None`."""

    ok: Callable[[Any], bool]
    allowed: str | Callable[[Any], str]
    name: str | None = None
    only: str | None = None
    alone: bool = False  # a check of one value on its own: run before the bounds, not with the relations

    def __call__(self, config, field_name: str) -> None:
        if not self.ok(config):
            raise invalid(
                config, self.name or field_name, self.allowed(config) if callable(self.allowed) else self.allowed
            )


@dataclass(frozen=True)
class Section:
    """What a group of fields belongs to (as TRL's "Parameters that control ..."): its title heads the group in
    `trl-aspo train --help` and in the config's docstring, `about` introduces it there. `depends` applies to every
    field the section declares, except a `switch` (the field the section's rules read, as loss_type)."""

    title: str
    about: str = ""
    depends: tuple[Needs, ...] = ()

    def field(
        self,
        default: Any,
        *,
        help: str,
        bound: Bound | None = None,
        choices: tuple | Callable[[str | None], tuple] | None = None,
        depends: Needs | tuple[Needs, ...] = (),
        checks: Callable | tuple[Callable, ...] = (),
        derived: Callable[[Any], Any] | None = None,
        resume: bool = False,
        independent: str | dict[str, str] | None = None,
        unsupported: dict[str, str] | None = None,
        switch: bool = False,
    ) -> Any:
        """A dataclass field with its declaration. `bound`: the range of a number (of each element of a list).
        `choices`: the values allowed (None too when it is the default); a function of the trainer (SYNC, ASYNC or
        None for both) for a set that grows at run time (the registered losses and estimators): read at each check,
        and left out of the parser's metadata so a name registered after import is not refused by argparse.
        `depends`: the switches it needs.
        `checks`: its rules between fields. `derived`: the value that replaces a default None in `__post_init__` (a
        dependency counts it as the default). `resume`: a resumed run compares it with the checkpoint's.
        `independent`: why it needs no switch (per trainer: a dict). `unsupported`: trainer -> why it is refused."""
        metadata = {"help": help}
        if choices is not None and not callable(choices):
            metadata["choices"] = [*choices, None] if default is None else list(choices)
        config_field = dataclasses.field(default=default, metadata=metadata)
        _SPECS[config_field] = FieldSpec(
            section=self,
            bound=bound,
            choices=choices if choices is None or callable(choices) else tuple(choices),
            depends=(depends,) if isinstance(depends, Needs) else tuple(depends),
            checks=(checks,) if callable(checks) else tuple(checks),
            derived=derived,
            resume=resume,
            independent=independent,
            unsupported=dict(unsupported or {}),
            switch=switch,
        )
        return config_field


@dataclass(frozen=True)
class FieldSpec:
    """Everything `Section.field` declares about a field besides its help text and choices (see there)."""

    section: Section
    bound: Bound | None
    choices: tuple | Callable[[str | None], tuple] | None
    depends: tuple[Needs, ...]
    checks: tuple[Callable, ...]
    derived: Callable[[Any], Any] | None
    resume: bool
    independent: str | dict[str, str] | None
    unsupported: dict[str, str]
    switch: bool

    def allowed_choices(self, trainer: str | None = None) -> tuple | None:
        """The values `trainer`'s config allows now (a registry's names are read at each call)."""
        return tuple(self.choices(trainer)) if callable(self.choices) else self.choices

    def dependencies(self, option: str, trainer: str | None) -> tuple[Dependency, ...]:
        """The dependencies of `option` (this field) in `trainer`'s config: its section's, then its own."""
        needs = (*(() if self.switch else self.section.depends), *self.depends)
        return tuple(need.of(option) for need in needs if need.only in (None, trainer))


# Field -> its declaration (a dataclass field object is shared by every class that inherits it).
_SPECS: dict[dataclasses.Field, FieldSpec] = {}


def field_spec(config_field: dataclasses.Field) -> FieldSpec | None:
    """The declaration of a field `Section.field` made; None for any other field (TRL's, transformers')."""
    return _SPECS.get(config_field)


def declared_fields(cls) -> list[tuple[dataclasses.Field, FieldSpec]]:
    """The declared fields of the dataclass `cls`, in field order, with their declarations."""
    return [(config_field, _SPECS[config_field]) for config_field in dataclasses.fields(cls) if config_field in _SPECS]


# ------------------------------------------------------------------------------------- views of the declarations
def field_bounds(cls) -> dict[str, Bound]:
    """The range of each bounded field of `cls`: the declared fields' own, and `TRL_FIELD_BOUNDS` for TRL's."""
    declared = {config_field.name: spec.bound for config_field, spec in declared_fields(cls) if spec.bound}
    return {**declared, **trl_field_bounds(cls)}


def trl_field_bounds(cls) -> dict[str, Bound]:
    """`TRL_FIELD_BOUNDS` for the fields `cls` has (and does not declare itself)."""
    declared = {config_field.name for config_field, _ in declared_fields(cls)}
    names = {config_field.name for config_field in dataclasses.fields(cls)} - declared
    return {name: bound for name, bound in TRL_FIELD_BOUNDS.items() if name in names}


def field_sections(cls) -> dict[str, str]:
    return {config_field.name: spec.section.title for config_field, spec in declared_fields(cls)}


def shared_dependencies(cls) -> tuple[Dependency, ...]:
    """The dependencies the fields of `cls` declare themselves for every trainer (no section's, no `only` one)."""
    return tuple(
        need.of(config_field.name)
        for config_field, spec in declared_fields(cls)
        for need in spec.depends
        if need.only is None
    )


def config_dependencies(cls, trainer: str | None) -> tuple[Dependency, ...]:
    """Every dependency `trainer`'s config `cls` checks, field by field."""
    return tuple(
        dependency
        for config_field, spec in declared_fields(cls)
        for dependency in spec.dependencies(config_field.name, trainer)
    )


def derived_defaults(cls) -> dict[str, Callable[[Any], Any]]:
    """The derived defaults a dependency compares with (of the fields with both)."""
    return {
        config_field.name: spec.derived
        for config_field, spec in declared_fields(cls)
        if spec.derived is not None and spec.dependencies(config_field.name, None)
    }


def independent_fields(cls, trainer: str | None = None) -> dict[str, str]:
    """Why each field that needs no switch needs none: in every config (trainer None), or in `trainer`'s only."""
    found = {}
    for config_field, spec in declared_fields(cls):
        reason = spec.independent
        if trainer is None and isinstance(reason, str):
            found[config_field.name] = reason
        elif trainer is not None and isinstance(reason, dict) and trainer in reason:
            found[config_field.name] = reason[trainer]
    return found


def unsupported_fields(cls, trainer: str) -> dict[str, str]:
    """The fields `trainer`'s trainer cannot honour yet (name -> why), refused away from their default."""
    return {
        config_field.name: spec.unsupported[trainer]
        for config_field, spec in declared_fields(cls)
        if trainer in spec.unsupported
    }


def resume_fields(cls) -> tuple[str, ...]:
    return tuple(config_field.name for config_field, spec in declared_fields(cls) if spec.resume)


# ------------------------------------------------------------------------------------------------------ types
def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# Annotation -> (accepts the value, what is allowed): the type checks of every declared field.
_TYPE_CHECKS = {
    "bool": (lambda value: isinstance(value, bool), "true or false"),
    "int": (lambda value: isinstance(value, int) and not isinstance(value, bool), "an integer"),
    "float": (_is_number, "a finite number"),
    "str": (lambda value: isinstance(value, str), "a string"),
    "list[str]": (
        lambda value: isinstance(value, list | tuple) and all(isinstance(item, str) for item in value),
        "a list of names",
    ),
    "list[float]": (
        lambda value: isinstance(value, list | tuple) and all(_is_number(item) for item in value),
        "a list of finite numbers",
    ),
}


def _type_name(hint) -> str:
    if hint is type(None):
        return "None"
    if typing.get_origin(hint) is list:
        return f"list[{', '.join(_type_name(arg) for arg in typing.get_args(hint))}]"
    return getattr(hint, "__name__", str(hint))


def field_types(cls) -> dict[str, list[str]]:
    """For each field of the dataclass `cls`, the names of the types its annotation allows ('float', 'None',
    'list[float]', ...), read with `typing.get_type_hints` (dataclass annotations are strings here, and
    `HfArgumentParser` rewrites `Field.type`)."""
    hints = typing.get_type_hints(cls)
    types = {}
    for config_field in dataclasses.fields(cls):
        hint = hints[config_field.name]
        union = typing.get_origin(hint) in (typing.Union, types_module.UnionType)
        types[config_field.name] = [_type_name(arg) for arg in (typing.get_args(hint) if union else (hint,))]
    return types


@functools.cache
def declared_field_types(cls) -> dict[str, list[str]]:
    """`field_types` of the fields `check_values` checks in `cls`: the declared ones (those `Section.field` made,
    wherever in the class they are declared) and those of `TRL_FIELD_BOUNDS` it has."""
    types = field_types(cls)
    names = [config_field.name for config_field, _ in declared_fields(cls)] + list(trl_field_bounds(cls))
    return {name: types[name] for name in names}


# ---------------------------------------------------------------------------------------------------- checker
def invalid(config, name: str, allowed: str) -> ValueError:
    """The error for `config.name`: `Config.name=value is invalid: allowed.`"""
    return ValueError(f"{type(config).__name__}.{name}={getattr(config, name)!r} is invalid: {allowed}.")


def _check_types(config, types: dict[str, list[str]]) -> None:
    """Type-check every field of `types` against its annotation, before any range check compares values: values
    from YAML arrive unconverted (a number for a list, a list for a number, 1 for true)."""
    for name, alternatives in types.items():
        value = getattr(config, name)
        if "None" in alternatives and value is None:
            continue
        checks = [_TYPE_CHECKS[kind] for kind in alternatives if kind in _TYPE_CHECKS]
        if len(checks) + ("None" in alternatives) < len(alternatives):
            continue  # an annotation this table does not know: the field's own checks apply
        if not any(accepts(value) for accepts, _ in checks):
            allowed = " or ".join([what for _, what in checks] + (["None"] * ("None" in alternatives)))
            raise invalid(config, name, f"must be {allowed}")


def _check_bound(config, name: str, bound: Bound, types: dict[str, list[str]]) -> None:
    """A number within its bound (a list: each element); None passes where the annotation allows it."""
    value = getattr(config, name)
    values = value if isinstance(value, list | tuple) else [value]
    if value is None or all(bound.holds(item) for item in values):
        return
    each = " each" if isinstance(value, list | tuple) else ""
    optional = " or be None" if "None" in types.get(name, ()) else ""
    raise invalid(config, name, f"must{each} lie in {bound}{optional}")


def check_values(config, types: dict[str, list[str]]) -> None:
    """Check the declared fields of `config` before its TRL base config's `__post_init__`: first each value on its
    own (the types of the fields in `types`, the fields this trainer refuses, the checks marked `alone`, every
    field's bound), then, field by field, its choices, its derived default and its other checks. Raises the
    `ValueError` of the first violation."""
    trainer = config._trainer
    declared = [
        (config_field, spec, [check for check in spec.checks if getattr(check, "only", None) in (None, trainer)])
        for config_field, spec in declared_fields(type(config))
    ]
    _check_types(config, types)
    for config_field, spec, _ in declared:
        reason = spec.unsupported.get(trainer)
        if reason is not None and getattr(config, config_field.name) != config_field.default:
            raise invalid(config, config_field.name, f"{reason}; remove it (default {config_field.default!r})")
    for config_field, _, checks in declared:
        for check in checks:
            if getattr(check, "alone", False):
                check(config, config_field.name)
    for name, bound in field_bounds(type(config)).items():
        _check_bound(config, name, bound, types)
    for config_field, spec, checks in declared:
        value = getattr(config, config_field.name)
        choices = spec.allowed_choices(trainer)
        if choices is not None and value not in choices and not (value is None is config_field.default):
            raise invalid(config, config_field.name, f"must be one of {choices}")
        if spec.derived is not None and value is None:
            setattr(config, config_field.name, spec.derived(config))
        for check in checks:
            if not getattr(check, "alone", False):
                check(config, config_field.name)


def check_dependencies(config) -> None:
    """Refuse (or warn about) every option set away from its default whose switch is off, in the order of
    `config.field_dependencies()`: call it from `__post_init__` itself, after the TRL base config's, so the warning
    points at the line that built the config."""
    name = type(config).__name__
    config_fields = type(config).__dataclass_fields__
    for dependency in config.field_dependencies():
        value = getattr(config, dependency.option)
        spec = field_spec(config_fields[dependency.option])
        derived = spec.derived if spec is not None else None
        at_default = value == config_fields[dependency.option].default or (
            derived is not None and value == derived(config)
        )
        if at_default or dependency.holds(config):
            continue
        got = ", ".join(f"{switch}={getattr(config, switch)!r}" for switch in dependency.switches)
        reason = f"{dependency.why}, so it needs {dependency.needs} (got {got})"
        if dependency.refuse:
            raise ValueError(
                f"{name}.{dependency.option}={value!r} is invalid: {reason}. Remove {dependency.option} or change "
                f"{', '.join(dependency.switches)}."
            )
        warnings.warn(f"{name}.{dependency.option}={value!r} may do nothing: {reason}.", UserWarning, stacklevel=4)


# ------------------------------------------------------------------------------------------------------ docstring
def fields_docstring(cls, indent: str = "    ") -> str:
    """The "Parameters:" part of the docstring of the config `cls`, as TRL writes its configs': its declared fields
    by section, each with its type, default and help text, generated so it cannot drift from the declarations."""
    by_section: dict[Section, list[dataclasses.Field]] = {}
    for config_field, spec in declared_fields(cls):
        by_section.setdefault(spec.section, []).append(config_field)
    width = 119 - len(indent)

    def paragraph(text: str, depth: int) -> list[str]:
        pad = "    " * depth
        return textwrap.wrap(
            " ".join(text.split()),
            width=width,
            initial_indent=pad,
            subsequent_indent=pad,
            break_long_words=False,
            break_on_hyphens=False,
        )

    lines = ["", "Parameters:"]
    for section, section_fields in by_section.items():
        lines += ["", f"    > {section.title}", ""]
        if section.about:
            lines += [*paragraph(section.about, 1), ""]
        for config_field in section_fields:
            default = config_field.default
            shown = f'"{default}"' if isinstance(default, str) else repr(default)
            defaults = "" if default is None else f", defaults to `{shown}`"
            lines.append(f"    {config_field.name} (`{config_field.type}`, *optional*{defaults}):")
            lines += paragraph(config_field.metadata["help"], 2)
    return "\n".join(f"{indent}{line}" if line else "" for line in lines) + "\n"
