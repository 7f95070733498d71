"""ASPOConfig validation: bad values name the field and what is allowed."""

from __future__ import annotations

import warnings

import pytest

from trl_aspo import ASPOConfig

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


def test_prior_strength_follows_rho_unless_set():
    """Issue 11 item 3: N0 = 1/(1-rho_min) for KL-adaptive rho, 1/(1-rho) for constant rho and spo++."""
    assert make(advantage_estimator="spo++").value_prior_strength == 8.0  # 1 / (1 - 0.875)
    assert make(advantage_estimator="spo++", value_rho=0.9).value_prior_strength == pytest.approx(10.0)
    assert make(advantage_estimator="spo", value_rho=0.75).value_prior_strength == 4.0
    kl = make(advantage_estimator="spo", value_rho_mode="kl", value_rho_min=0.8, value_rho_max=0.96)
    assert kl.value_prior_strength == pytest.approx(5.0)  # follows rho_min, not value_rho=0.875
    assert make(advantage_estimator="spo++", value_rho=0.9, value_prior_strength=3.0).value_prior_strength == 3.0
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
