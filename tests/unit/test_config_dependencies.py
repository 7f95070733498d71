"""Issue 17 items 5 and 10: every option that acts only with another switch is refused (or warned about) naming both
fields, from one table (trl_aspo.config.aspo_config.FIELD_DEPENDENCIES and each config's own); every numeric field has
a range (trl_aspo.config.aspo_config.FIELD_BOUNDS) given in the message."""

from __future__ import annotations

import dataclasses
import re
import warnings

import pytest

from trl_aspo import ASPOConfig
from trl_aspo.config.aspo_config import (
    FIELD_BOUNDS,
    GROUP_ESTIMATOR_ON,
    INDEPENDENT_FIELDS,
    PER_VISIT_FORGETTING_ON,
    REGISTERED_LOSS_ON,
    TRACKER_ON,
    ASPOFieldsMixin,
    aspo_field_types,
)
from trl_aspo.config.async_config import ASYNC_INDEPENDENT_FIELDS, ASYNC_UNSUPPORTED_FIELDS, AsyncASPOConfig

SYNC_BASE = dict(output_dir="unused", per_device_train_batch_size=4, num_generations=2, report_to="none", use_cpu=True)
ASYNC_BASE = dict(output_dir="unused", use_cpu=True, token_budget=0, report_to="none")

# A valid value away from the default, for every field a dependency names.
SET = {
    "proximal_policy": "loglinear",
    "ppo_dual_clip": 2.0,
    "max_inflight_per_prompt": 1,
    "aspo_dual_clip": 2.0,
    "aspo_dual_clip_pos": 2.0,
    "aspo_dual_clip_neg": 2.0,
    "aspo_aggregation": "sequence",
    "aspo_entropy_quantile": 0.8,
    "aspo_epsilon_high_entropy": 0.5,
    "aspo_flip_threshold_start": 1.0,
    "aspo_flip_decay_steps": 10,
    "aspo_unflipped_fraction": 0.1,
    "aspo_adaptive_kl_beta": 0.1,
    "aspo_adaptive_kl_entropy_target": 0.5,
    "kl_clamp": 10.0,
    "vllm_importance_sampling_mode": "token_mask",
    "vllm_importance_sampling_clip_max": 2.0,
    "vllm_importance_sampling_clip_min": 0.5,
    "lr_schedule_per_generation": True,
    "log_weight_map": True,
    "overlong_penalty_factor": 0.5,
    "filter_zero_variance_groups": True,
    "tool_shaping_delta": -1.0,
    "tool_shaping_k": 0.5,
    "tool_shaping_correct_threshold": 0.9,
    "tool_shaping_correct_reward": "accuracy",
    "tool_shaping_interactive_bonus": 0.1,
    "tool_shaping_penalty": "my_module.penalty",
    "tool_call_opener": "<call>",
    "value_rho": 0.9,
    "value_rho_mode": "kl",
    "value_kl_half": 0.1,
    "value_rho_min": 0.8,
    "value_rho_max": 0.95,
    "value_prior_strength": 3.0,
    "value_init_samples": 4,
    "value_init_file": "counts.json",
    "value_reward_range": [-1.0, 1.0],
    "prompt_id_column": "id",
    "prioritized_sampling": True,
    "priority_epsilon": 0.1,
}

ASPO = {"loss_type": "aspo", "num_iterations": 2}  # off-policy: no on-policy warning
SPO = {"advantage_estimator": "spo"}

# (option, needs) -> the other fields that switch the condition off (the option itself is set to SET[option]).
# Every `aspo_` field's loss_type rule breaks with the base configs' loss_type (TRL's 'dapo' / 'ppo').
SWITCHED_OFF = {
    **{(name, "loss_type='aspo'"): {} for name in SET if name.startswith("aspo_")},
    # aspo_aggregation applies to every loss trl-aspo computes (a registered loss_type), not to TRL's.
    ("aspo_aggregation", REGISTERED_LOSS_ON.needs): {},
    ("aspo_dual_clip", "aspo_dual_clip_pos or aspo_dual_clip_neg left at None"): {
        **ASPO,
        "aspo_dual_clip_pos": 3.0,
        "aspo_dual_clip_neg": 3.0,
    },
    ("aspo_epsilon_high_entropy", "aspo_entropy_quantile set"): ASPO,
    ("aspo_flip_threshold_start", "aspo_flip_decay_steps > 0"): ASPO,
    ("aspo_flip_decay_steps", "aspo_flip_threshold_start > 0"): ASPO,
    ("aspo_adaptive_kl_entropy_target", "aspo_adaptive_kl_beta set"): ASPO,
    ("overlong_penalty_factor", "overlong_buffer_length set"): {},
    ("filter_zero_variance_groups", GROUP_ESTIMATOR_ON.needs): {"advantage_estimator": "spo++"},
    **{
        (name, "tool_shaping=True"): {}
        for name in (
            "tool_shaping_delta",
            "tool_shaping_k",
            "tool_shaping_correct_threshold",
            "tool_shaping_correct_reward",
            "tool_shaping_interactive_bonus",
            "tool_shaping_penalty",
        )
    },
    ("tool_call_opener", "tool_call_pattern=None"): {"tool_call_pattern": "```python"},
    **{
        (name, TRACKER_ON.needs): {}
        for name in (
            "value_rho",
            "value_kl_half",
            "value_rho_min",
            "value_rho_max",
            "value_prior_strength",
            "value_reward_range",
            "prompt_id_column",
            "value_init_samples",
            "value_init_file",
            "prioritized_sampling",
        )
    },
    ("value_rho_mode", PER_VISIT_FORGETTING_ON.needs): {"advantage_estimator": "spo++"},
    ("value_rho", "value_rho_mode='constant'"): {**SPO, "value_rho_mode": "kl"},
    **{(name, "value_rho_mode='kl'"): SPO for name in ("value_kl_half", "value_rho_min", "value_rho_max")},
    ("value_prior_strength", "value_init_samples > 0 or value_init_file set"): SPO,
    ("priority_epsilon", "prioritized_sampling=True"): SPO,
    # AsyncASPOConfig's own
    ("proximal_policy", "vllm_importance_sampling_correction=True"): {},
    ("ppo_dual_clip", "loss_type='ppo'"): {"loss_type": "aspo"},
    ("max_inflight_per_prompt", "num_generations=1"): {},  # TRL's default num_generations is 8
    # ASPOConfig's own
    ("aspo_adaptive_kl_beta", "beta > 0"): ASPO,
    ("kl_clamp", REGISTERED_LOSS_ON.needs): {"beta": 0.01},
    ("kl_clamp", "beta > 0"): ASPO,
    ("aspo_unflipped_fraction", "aspo_unflipped_fraction x generation_batch_size > 0.5"): ASPO,  # 0.1 x 4
    ("lr_schedule_per_generation", "steps_per_generation x num_iterations divisible by gradient_accumulation_steps"): {
        "gradient_accumulation_steps": 2,
        "steps_per_generation": 3,
    },
    ("lr_schedule_per_generation", "a lambda schedule other than 'constant'"): {"lr_scheduler_type": "constant"},
    (
        "log_weight_map",
        "loss_type in ('grpo', 'bnpo', 'dr_grpo', 'dapo', 'luspo') or a registered loss with a weight "
        "(registered: 'aspo')",
    ): {
        "loss_type": "cispo",
        "num_iterations": 2,
    },
    ("log_weight_map", "importance_sampling_level='token'"): {
        "importance_sampling_level": "sequence",
        "num_iterations": 2,
    },
    (
        "log_weight_map",
        "gradient_accumulation_steps not a multiple of steps_per_generation x num_iterations (or vLLM "
        "with its IS correction)",
    ): {},
    # AsyncASPOConfig's own
    **{
        (name, "vllm_importance_sampling_correction=True"): {}
        for name in (
            "vllm_importance_sampling_mode",
            "vllm_importance_sampling_clip_max",
            "vllm_importance_sampling_clip_min",
        )
    },
    ("aspo_unflipped_fraction", "aspo_unflipped_fraction x per_device_train_batch_size > 0.5 (or token_budget > 0)"): {
        **ASPO,
        "per_device_train_batch_size": 4,
    },
}


def _cases():
    cases = []
    for config_class, base in ((ASPOConfig, SYNC_BASE), (AsyncASPOConfig, ASYNC_BASE)):
        for dependency in config_class(**base).field_dependencies():
            fields_set = {dependency.option, *SWITCHED_OFF.get((dependency.option, dependency.needs), {})}
            if config_class is AsyncASPOConfig and fields_set & set(ASYNC_UNSUPPORTED_FIELDS):
                continue  # refused by name before any dependency is checked
            name = f"{config_class.__name__}.{dependency.option}:{dependency.needs}"
            cases.append(pytest.param(config_class, base, dependency, id=name))
    return cases


@pytest.mark.parametrize(("config_class", "base", "dependency"), _cases())
def test_every_dependency_names_both_fields(config_class, base, dependency):
    key = (dependency.option, dependency.needs)
    assert key in SWITCHED_OFF, f"add a case for {key} to SWITCHED_OFF"
    overrides = {**base, **SWITCHED_OFF[key], dependency.option: SET[dependency.option]}
    if config_class is AsyncASPOConfig:
        overrides.pop("num_iterations", None)
    got = ", ".join(rf"{switch}=.*" for switch in dependency.switches)
    message = rf"{config_class.__name__}\.{dependency.option}=.*needs {re.escape(dependency.needs)} \(got {got}\)"
    if dependency.refuse:
        with pytest.raises(ValueError, match=message + r".*Remove " + dependency.option):
            config_class(**overrides)
    else:
        with pytest.warns(UserWarning, match=message):
            config_class(**overrides)


@pytest.mark.parametrize(("config_class", "base"), [(ASPOConfig, SYNC_BASE), (AsyncASPOConfig, ASYNC_BASE)])
def test_every_field_has_a_dependency_or_is_declared_independent(config_class, base):
    """A field added without an entry in the table (or a reason in INDEPENDENT_FIELDS) fails here."""
    added = {f.name for f in dataclasses.fields(ASPOFieldsMixin)}
    independent = set(INDEPENDENT_FIELDS)
    if config_class is AsyncASPOConfig:
        added = added - set(ASYNC_UNSUPPORTED_FIELDS) | {"loss_type"}  # unsupported ones are refused by name
        independent |= set(ASYNC_INDEPENDENT_FIELDS)
    listed = {dependency.option for dependency in config_class(**base).field_dependencies()}
    assert added - listed - independent == set()
    assert not listed & independent


@pytest.mark.parametrize(("config_class", "base"), [(ASPOConfig, SYNC_BASE), (AsyncASPOConfig, ASYNC_BASE)])
def test_an_option_given_at_its_default_is_never_complained_about(config_class, base):
    defaults = {f.name: f.default for f in dataclasses.fields(ASPOFieldsMixin)}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        config_class(**base, **defaults)


def test_the_flip_threshold_without_decay_steps_is_refused():
    """The reviewers' example: a start of 1.0 with the default 0 decay steps gave threshold 0 at every step."""
    with pytest.raises(
        ValueError,
        match=r"ASPOConfig\.aspo_flip_threshold_start=1\.0 is invalid: with aspo_flip_decay_steps=0 the threshold is "
        r"0 at every step .* needs aspo_flip_decay_steps > 0 \(got aspo_flip_decay_steps=0\)",
    ):
        ASPOConfig(**SYNC_BASE, **ASPO, aspo_flip_threshold_start=1.0)
    ASPOConfig(**SYNC_BASE, **ASPO, aspo_flip_threshold_start=1.0, aspo_flip_decay_steps=10)


# ---------------------------------------------------------------- bounds (item 10)
def test_every_numeric_field_has_bounds():
    numeric = {
        name
        for name, alternatives in aspo_field_types().items()
        if {"int", "float", "list[float]"} & set(alternatives)
    }
    assert numeric == set(FIELD_BOUNDS)


def _beyond_bounds():
    cases = []
    for name, bound in FIELD_BOUNDS.items():
        integer = "int" in aspo_field_types()[name]
        above = int(bound.high * 2 + 1) if integer else bound.high * 2 + 1
        value = [0.0, above] if name == "value_reward_range" else above
        cases.append(pytest.param(name, value, str(bound), id=f"{name}={value!r}"))
    return cases


@pytest.mark.parametrize(("name", "value", "allowed"), _beyond_bounds())
def test_values_beyond_the_bounds_are_refused_with_the_range(name, value, allowed):
    with pytest.raises(
        ValueError, match=rf"ASPOConfig\.{name}=.* is invalid: must( each)? lie in {re.escape(allowed)}"
    ):
        ASPOConfig(**SYNC_BASE, **{name: value})


@pytest.mark.parametrize("config_class", [ASPOConfig, AsyncASPOConfig])
def test_an_overflowing_bonus_is_refused_at_config_time(config_class):
    """1e308 is finite, so the finite-number check let it through; it made every shaped advantage NaN."""
    base = SYNC_BASE if config_class is ASPOConfig else ASYNC_BASE
    with pytest.raises(
        ValueError,
        match=rf"{config_class.__name__}\.tool_shaping_interactive_bonus=1e\+308 is invalid: must lie in "
        r"\[0, 100\]",
    ):
        config_class(**base, tool_shaping=True, tool_shaping_interactive_bonus=1e308)
