"""ASPOConfig validation: bad values name the field and what is allowed."""

from __future__ import annotations

import warnings

import pytest

from trl_aspo import ASPOConfig
from trl_aspo.config.aspo_config import aspo_field_types

BASE = dict(output_dir="unused", per_device_train_batch_size=4, num_generations=2, report_to="none", use_cpu=True)


def make(**overrides):
    return ASPOConfig(**{**BASE, **overrides})


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"aspo_dual_clip": 1.0}, "aspo_dual_clip"),
        ({"aspo_aggregation": "mean"}, "aspo_aggregation"),
        ({"aspo_entropy_quantile": 1.5}, "aspo_entropy_quantile"),
        ({"aspo_epsilon_high_entropy": 0.0}, "aspo_epsilon_high_entropy"),
        ({"aspo_flip_threshold_start": -1.0}, "aspo_flip_threshold_start"),
        ({"aspo_flip_decay_steps": -3}, "aspo_flip_decay_steps"),
        ({"aspo_unflipped_fraction": 1.2}, "aspo_unflipped_fraction"),
        ({"aspo_adaptive_kl_beta": 0.1}, "aspo_adaptive_kl_beta"),  # beta is 0: no reference model
        ({"loss_type": "aspo", "importance_sampling_level": "sequence"}, "importance_sampling_level"),
        ({"loss_type": "aspo", "entropy_coef": 0.01}, "entropy_coef"),
        ({"tool_shaping_delta": 0.0}, "tool_shaping_delta"),
        ({"tool_shaping_k": -0.1}, "tool_shaping_k"),
        ({"tool_call_pattern": "(unclosed"}, "tool_call_pattern"),
        ({"advantage_estimator": "ppo"}, "advantage_estimator"),
        ({"advantage_normalization": "median"}, "advantage_normalization"),
        ({"advantage_estimator": "spo", "advantage_normalization": "group"}, "advantage_normalization"),
        ({"num_generations": 1}, "num_generations"),
        ({"value_rho": 0.0}, "value_rho"),
        ({"value_rho_mode": "kl"}, "value_rho_mode"),  # needs advantage_estimator='spo'
        ({"advantage_estimator": "spo++", "value_rho_mode": "kl"}, "value_rho_mode"),
        ({"value_rho_min": 0.99}, "value_rho_min"),
        ({"value_prior_strength": 0.0}, "value_prior_strength"),
        ({"value_init_samples": -1}, "value_init_samples"),
        ({"value_init_samples": 4}, "value_init_samples"),  # the group estimator has no tracker to initialize
        ({"value_init_file": "counts.json"}, "value_init_file"),
        ({"value_reward_range": [1.0, 0.0]}, "value_reward_range"),
        ({"prioritized_sampling": True}, "prioritized_sampling"),
        ({"priority_epsilon": 0.0}, "priority_epsilon"),
        ({"aspo_dual_clip_pos": 1.0}, "aspo_dual_clip_pos"),
        ({"loss_type": "aspo", "aspo_dual_clip_neg": 0.5}, "aspo_dual_clip_neg"),
        # Issue 11 item 9: options that would do nothing are refused, naming the field.
        ({"aspo_dual_clip": 2.0}, "aspo_dual_clip"),  # loss_type is TRL's 'dapo'
        ({"loss_type": "grpo", "aspo_entropy_quantile": 0.8}, "aspo_entropy_quantile"),
        (
            {"advantage_normalization": "batch", "multi_objective_aggregation": "normalize_then_sum"},
            "multi_objective_aggregation",
        ),
        ({"filter_zero_variance_groups": True, "advantage_estimator": "spo++"}, "filter_zero_variance_groups"),
        ({"overlong_buffer_length": 0}, "overlong_buffer_length"),
        ({"overlong_buffer_length": 1000, "max_completion_length": 256}, "overlong_buffer_length"),
        ({"overlong_buffer_length": 8, "overlong_penalty_factor": 0.0}, "overlong_penalty_factor"),
    ],
)
def test_bad_values_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=f"ASPOConfig.{field}="):
        make(**overrides)


def test_single_stream_accepts_one_generation():
    config = make(advantage_estimator="spo++", num_generations=1, per_device_train_batch_size=3)
    assert config.num_generations == 1
    assert config.generation_batch_size == 3
    assert config.advantage_normalization == "token"
    assert make(advantage_estimator="spo", num_generations=1).advantage_normalization == "batch"


def test_defaults_leave_grpo_untouched():
    config = make()
    assert config.loss_type == "dapo"
    assert config.advantage_estimator == "group" and config.advantage_normalization == "group"
    assert not config.tool_shaping and not config.prioritized_sampling


# Per annotation, values of the wrong type as YAML would deliver them (a number where a list is expected, a list
# where a number is expected, 1 for true, a non-finite number).
WRONG_VALUES = {
    "bool": [1, "yes", None],
    "int": [1.5, True, [1], "2", None],
    "float": [[1.0], "0.5", True, float("inf"), float("nan"), None],
    "str": [5, ["a"], True, None],
    "list[float]": [5, [0.0, "1"], [0.0, float("inf")]],
    "list[str]": [5, "TERM", ["TERM", 15]],
}


def _wrong_values():
    cases = []
    for name, alternatives in aspo_field_types().items():
        for kind in alternatives:
            for value in WRONG_VALUES.get(kind, []):
                if value is None and "None" in alternatives:
                    continue
                cases.append(pytest.param(name, value, id=f"{name}={value!r}"))
    return cases


def test_every_field_of_aspo_config_has_a_type_check():
    kinds = {kind for alternatives in aspo_field_types().values() for kind in alternatives}
    assert kinds - {"None"} <= set(WRONG_VALUES), kinds


@pytest.mark.parametrize(("name", "value"), _wrong_values())
def test_wrong_types_are_refused_with_the_field_name(name, value):
    with pytest.raises(ValueError, match=rf"ASPOConfig\.{name}=.* is invalid: must be"):
        make(**{name: value})


@pytest.mark.parametrize("estimator", ["spo", "spo++"])
def test_zero_generations_are_refused_with_the_field_name(estimator):
    with pytest.raises(ValueError, match=r"ASPOConfig\.num_generations=0 is invalid: must be a positive integer"):
        make(advantage_estimator=estimator, num_generations=0)


@pytest.mark.parametrize("name", ["value_prior_strength", "value_kl_half", "tool_shaping_interactive_bonus"])
def test_infinite_numbers_are_refused_at_config_time(name):
    with pytest.raises(ValueError, match=rf"ASPOConfig\.{name}=inf is invalid"):
        make(advantage_estimator="spo++", num_generations=1, **{name: float("inf")})


def test_wrong_yaml_types_are_refused_by_the_parser(tmp_path):
    from trl_aspo.cli.parsers import make_parser

    config = tmp_path / "run.yaml"
    config.write_text("output_dir: out\nadvantage_estimator: spo\nnum_generations: 1\nvalue_reward_range: 5\n")
    with pytest.raises(ValueError, match=r"ASPOConfig\.value_reward_range=5 is invalid: must be a list"):
        make_parser().parse_args_and_config(args=["--config", str(config), "--use_cpu", "true"])


def test_prior_strength_follows_rho_unless_set():
    """Issue 11 item 3: N0 = 1/(1-rho_min) for KL-adaptive rho, 1/(1-rho) for constant rho and spo++."""
    assert make(advantage_estimator="spo++").value_prior_strength == 8.0  # 1 / (1 - 0.875)
    assert make(advantage_estimator="spo++", value_rho=0.9).value_prior_strength == pytest.approx(10.0)
    assert make(advantage_estimator="spo", value_rho=0.75).value_prior_strength == 4.0
    kl = make(advantage_estimator="spo", value_rho_mode="kl", value_rho_min=0.8, value_rho_max=0.96)
    assert kl.value_prior_strength == pytest.approx(5.0)  # follows rho_min, not value_rho=0.875
    explicit = make(advantage_estimator="spo++", value_prior_strength=3.0, value_init_file="counts.json")
    assert explicit.value_prior_strength == 3.0
    assert make(advantage_estimator="spo++", value_rho=1.0).value_prior_strength is None  # nothing to initialize
    with pytest.raises(ValueError, match="ASPOConfig.value_prior_strength=None"):
        make(advantage_estimator="spo++", value_rho=1.0, value_init_file="counts.json")


def test_on_policy_aspo_warns_how_to_make_the_flip_act():
    """Issue 11 item 9: with every optimizer step on-policy the flip changes nothing; the warning says what to set."""
    with pytest.warns(UserWarning, match="on-policy.*num_iterations > 1 or steps_per_generation >"):
        make(loss_type="aspo")
    for off_policy in ({"num_iterations": 2}, {"steps_per_generation": 2}):
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            make(loss_type="aspo", **off_policy)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        make()  # TRL's loss: nothing to warn about
        make(multi_objective_aggregation="normalize_then_sum")  # honoured by TRL's group scaling


def test_pinned_memory_is_off_where_no_accelerator_can_use_it(tmp_path):
    """torch's data loader warns on every run that pinned memory is unused without an accelerator (issue 25, item
    13); where one exists the TRL default (True) stays."""
    import torch

    from trl_aspo import ASPOConfig

    assert ASPOConfig(output_dir=str(tmp_path), use_cpu=True).dataloader_pin_memory is False
    default = ASPOConfig(output_dir=str(tmp_path), bf16=False).dataloader_pin_memory
    assert default is torch.accelerator.is_available()
