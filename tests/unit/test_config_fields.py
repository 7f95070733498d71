"""The config fields are declared once (trl_aspo.config.fields): help, section, bound, choices, dependencies and checks
in the field's own declaration; the tables (FIELD_BOUNDS, FIELD_DEPENDENCIES, ...) are views of the declarations, and
one checker gives the same message for the same bad value in ASPOConfig and AsyncASPOConfig."""

from __future__ import annotations

import dataclasses
import re

import pytest

from trl_aspo.config import (
    DERIVED_DEFAULTS,
    FIELD_BOUNDS,
    FIELD_DEPENDENCIES,
    INDEPENDENT_FIELDS,
    RESUME_FIELDS,
    ASPOConfig,
    ASPOFieldsMixin,
    Bound,
    aspo_field_types,
)
from trl_aspo.config import fields as fields_module
from trl_aspo.config.aspo_config import ASPO_LOSS, FIELD_SECTIONS, POLICY_LOSS
from trl_aspo.config.async_config import ASYNC_INDEPENDENT_FIELDS, ASYNC_UNSUPPORTED_FIELDS, AsyncASPOConfig
from trl_aspo.config.fields import ASYNC, SYNC, field_spec

MIXIN_FIELDS = dataclasses.fields(ASPOFieldsMixin)
BY_NAME = {config_field.name: config_field for config_field in MIXIN_FIELDS}
NUMERIC = {"int", "float", "list[float]"}


def spec(name: str):
    return field_spec(BY_NAME[name])


SYNC_BASE = dict(per_device_train_batch_size=4, num_generations=2, report_to="none", use_cpu=True)


def sync_config(tmp_path, **overrides):
    return ASPOConfig(output_dir=str(tmp_path), **{**SYNC_BASE, **overrides})


def async_config(tmp_path, **overrides):
    return AsyncASPOConfig(output_dir=str(tmp_path), use_cpu=True, token_budget=0, report_to="none", **overrides)


# ------------------------------------------------------------------------------------------ the declarations
@pytest.mark.parametrize("name", list(BY_NAME))
def test_every_field_declares_its_help_section_and_a_bound_if_numeric(name):
    config_field = BY_NAME[name]
    declaration = field_spec(config_field)
    assert declaration is not None, f"declare {name} with SECTION.field(...)"
    assert config_field.metadata["help"].strip()
    assert declaration.section.title
    if NUMERIC & set(aspo_field_types()[name]):
        assert isinstance(declaration.bound, Bound), f"{name} is numeric: declare its bound"
    else:
        assert declaration.bound is None


@pytest.mark.parametrize(("config_class", "trainer"), [(ASPOConfig, SYNC), (AsyncASPOConfig, ASYNC)])
def test_loss_type_is_declared_once_as_the_policy_loss_switch(config_class, trainer):
    declaration = field_spec(config_class.__dataclass_fields__["loss_type"])
    assert declaration.section is POLICY_LOSS and declaration.switch
    # One declaration for both configs: the mixin's field, with the TRL trainer's default loss when left at None.
    assert config_class.__dataclass_fields__["loss_type"] is ASPOFieldsMixin.__dataclass_fields__["loss_type"]
    dependencies = fields_module.config_dependencies(config_class, trainer)
    assert all(dependency.option != "loss_type" for dependency in dependencies)


def test_the_metadata_holds_only_what_hfargumentparser_hands_to_argparse():
    """HfArgumentParser passes every metadata key to argparse.add_argument, which refuses unknown keywords."""
    for config_class in (ASPOConfig, AsyncASPOConfig):
        for config_field, _ in fields_module.declared_fields(config_class):
            assert set(config_field.metadata) <= {"help", "choices"}, config_field.name


def test_choices_in_the_metadata_are_the_declared_ones():
    for name, config_field in BY_NAME.items():
        choices = spec(name).choices
        if choices is None or callable(choices):
            assert "choices" not in config_field.metadata
        else:
            assert config_field.metadata["choices"] == [*choices] + [None] * (config_field.default is None), name


# ----------------------------------------------------------------------------------------------------- the views
def test_field_bounds_is_the_declared_bounds():
    declared = {name: spec(name).bound for name in BY_NAME if spec(name).bound is not None}
    assert declared == FIELD_BOUNDS
    assert all(FIELD_BOUNDS[name] is declared[name] for name in declared)
    assert list(FIELD_BOUNDS) == [name for name in BY_NAME if name in declared]  # in field order


def test_field_dependencies_is_the_declared_dependencies_of_every_config():
    declared = [need.of(name) for name in BY_NAME for need in spec(name).depends if need.only is None]
    assert list(FIELD_DEPENDENCIES) == declared
    for dependency in FIELD_DEPENDENCIES:
        assert any(need.holds is dependency.holds for need in spec(dependency.option).depends)


@pytest.mark.parametrize(("config_class", "trainer"), [(ASPOConfig, SYNC), (AsyncASPOConfig, ASYNC)])
def test_each_config_checks_the_section_rule_then_the_fields_own(config_class, trainer):
    dependencies = fields_module.config_dependencies(config_class, trainer)
    # aspo_aggregation applies to every registered loss: it is declared with loss_type, in the "Policy loss" section.
    aspo = [name for name in BY_NAME if name.startswith("aspo_") and name != "aspo_aggregation"]
    # The section rule replaces the old naming rule: every other `aspo_` field, and only those, needs loss_type='aspo'.
    assert [name for name in BY_NAME if spec(name).section is ASPO_LOSS] == aspo
    loss_rule = [dependency.option for dependency in dependencies if dependency.needs == "loss_type='aspo'"]
    assert loss_rule[: len(aspo)] == aspo
    shared = set(FIELD_DEPENDENCIES)
    own = [dependency for dependency in dependencies if dependency not in shared and dependency.option not in aspo]
    for dependency in own:  # every other dependency is this trainer's own, declared in its field or its section
        if dependency.option in BY_NAME:
            needs = spec(dependency.option).depends
            assert any(need.only == trainer and need.holds is dependency.holds for need in needs)
        else:  # a field of this config alone (AsyncASPOConfig's off-policy correction), under its section's rule
            declared = field_spec(config_class.__dataclass_fields__[dependency.option])
            assert any(need.holds is dependency.holds for need in (*declared.section.depends, *declared.depends))


def test_the_other_tables_are_views_too():
    assert {"value_prior_strength": spec("value_prior_strength").derived} == DERIVED_DEFAULTS
    independent = {name: spec(name).independent for name in BY_NAME if isinstance(spec(name).independent, str)}
    assert independent == INDEPENDENT_FIELDS
    assert {
        name: spec(name).independent[ASYNC] for name in BY_NAME if isinstance(spec(name).independent, dict)
    } == ASYNC_INDEPENDENT_FIELDS
    assert {
        name: spec(name).unsupported[ASYNC] for name in BY_NAME if ASYNC in spec(name).unsupported
    } == ASYNC_UNSUPPORTED_FIELDS
    assert {name: spec(name).section.title for name in BY_NAME} == FIELD_SECTIONS


def test_resume_fields_are_those_a_resume_compares():
    from trl_aspo.trainers import project_state

    assert (*(name for name in BY_NAME if spec(name).resume), "seed") == RESUME_FIELDS
    assert set(RESUME_FIELDS) == set(project_state.RESUME_FIELDS)


def test_fields_that_are_no_part_of_the_aspo_loss_are_grouped_by_what_they_do():
    assert FIELD_SECTIONS["kl_clamp"] == "Recipe options of the ASPO reference (Archer2.0)"
    assert FIELD_SECTIONS["log_weight_map"] == "Logging"
    assert FIELD_SECTIONS["lr_schedule_per_generation"] == "Optimization"
    assert FIELD_SECTIONS["prioritized_sampling"] == FIELD_SECTIONS["priority_epsilon"] == "Prioritized sampling"


@pytest.mark.parametrize("config_class", [ASPOConfig, AsyncASPOConfig])
def test_the_docstring_lists_every_field_under_its_section(config_class):
    doc = config_class.__doc__
    titles = list(dict.fromkeys(field_spec(f).section.title for f, _ in fields_module.declared_fields(config_class)))
    positions = [doc.index(f"> {title}\n") for title in titles]
    assert positions == sorted(positions)
    for config_field, declaration in fields_module.declared_fields(config_class):
        at = doc.index(f"    {config_field.name} (`")
        section = max(i for i, position in enumerate(positions) if position < at)
        assert titles[section] == declaration.section.title, config_field.name


# -------------------------------------------------------------------------------------------------- messages
def test_a_bound_violation_names_the_field_and_the_declared_range(tmp_path):
    assert str(spec("value_rho").bound) == "(0, 1]"
    with pytest.raises(ValueError, match=r"^ASPOConfig\.value_rho=1\.5 is invalid: must lie in \(0, 1\]\.$"):
        sync_config(tmp_path, value_rho=1.5)


def test_the_message_follows_the_declaration(tmp_path, monkeypatch):
    """The range in the message is generated from the field's Bound, and its choices from its declared choices."""
    rho = BY_NAME["value_rho"]
    monkeypatch.setitem(fields_module._SPECS, rho, dataclasses.replace(spec("value_rho"), bound=Bound(0, 0.5)))
    with pytest.raises(ValueError, match=r"ASPOConfig\.value_rho=0\.6 is invalid: must lie in \[0, 0\.5\]\.$"):
        sync_config(tmp_path, value_rho=0.6)
    monkeypatch.undo()
    aggregation = BY_NAME["aspo_aggregation"]
    replaced = dataclasses.replace(spec("aspo_aggregation"), choices=("token",))
    monkeypatch.setitem(fields_module._SPECS, aggregation, replaced)
    with pytest.raises(
        ValueError, match=re.escape("aspo_aggregation='sequence' is invalid: must be one of ('token',).")
    ):
        sync_config(tmp_path, aspo_aggregation="sequence")


# One bad value per kind of rule: a bound, a list bound, choices, a check between fields, a check of its own.
SAME_BAD_VALUES = [
    {"value_rho": 1.5},
    {"aspo_dual_clip": 1.0},
    {"value_reward_range": [0.0, 1e12]},
    {"tool_shaping_interactive_bonus": 1e308},
    {"aspo_aggregation": "mean"},
    {"advantage_estimator": "ppo"},
    {"advantage_normalization": "median"},
    {"value_rho_min": 0.99},
    {"value_reward_range": [1.0, 0.0]},
    {"tool_shaping_delta": 0.0},
    {"tool_call_opener": ""},
    {"tool_call_pattern": "(unclosed"},
    {"num_generations": 0},
    {"advantage_estimator": "spo", "advantage_normalization": "group"},
    {"priority_epsilon": 2.0},  # a dependency: prioritized_sampling is off
    {"value_rho": "high"},  # a type
]


@pytest.mark.parametrize("overrides", SAME_BAD_VALUES, ids=repr)
def test_the_same_bad_value_gives_the_same_message_in_both_configs(tmp_path, overrides):
    messages = []
    for make in (sync_config, async_config):
        with pytest.raises(ValueError) as caught:
            make(tmp_path, **overrides)
        messages.append(str(caught.value))
    sync_message, async_message = messages
    assert sync_message.startswith("ASPOConfig.") and async_message.startswith("AsyncASPOConfig.")
    assert sync_message.removeprefix("ASPOConfig.") == async_message.removeprefix("AsyncASPOConfig."), messages
    name = next(iter(overrides)) if len(overrides) == 1 else "advantage_normalization"
    assert sync_message.startswith(f"ASPOConfig.{name}=")


def test_a_trainer_specific_rule_is_declared_for_that_trainer_only(tmp_path):
    """aspo_unflipped_fraction reads a different batch field in each config, both declared in the field."""
    needs = {need.only: need.needs for need in spec("aspo_unflipped_fraction").depends}
    assert set(needs) == {SYNC, ASYNC}
    for make, trainer in ((sync_config, SYNC), (async_config, ASYNC)):
        with pytest.raises(ValueError, match=re.escape(f"so it needs {needs[trainer]} (got")):
            make(tmp_path, loss_type="aspo", aspo_unflipped_fraction=0.1, per_device_train_batch_size=4)
