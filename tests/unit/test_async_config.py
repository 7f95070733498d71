"""AsyncASPOConfig: the fields of ASPOConfig, defined once in ASPOFieldsMixin, on TRL's AsyncGRPOConfig."""

from __future__ import annotations

import dataclasses

import pytest
from trl.experimental.async_grpo import AsyncGRPOConfig

import trl_aspo
from trl_aspo import ASPOConfig
from trl_aspo.config.aspo_config import ASPOFieldsMixin
from trl_aspo.config.async_config import ASYNC_UNSUPPORTED_FIELDS, AsyncASPOConfig


def make(tmp_path, **overrides):
    return AsyncASPOConfig(output_dir=str(tmp_path), use_cpu=True, token_budget=0, **overrides)


def test_one_definition_of_the_fields():
    shared = {f.name for f in dataclasses.fields(ASPOFieldsMixin)}
    for config in (ASPOConfig, AsyncASPOConfig):
        by_name = {f.name: f for f in dataclasses.fields(config)}
        for name in shared:
            assert by_name[name] is ASPOFieldsMixin.__dataclass_fields__[name], (config, name)
    assert set(ASYNC_UNSUPPORTED_FIELDS) <= shared
    assert trl_aspo.AsyncASPOConfig is AsyncASPOConfig


def test_defaults_mean_async_grpo(tmp_path):
    config = make(tmp_path)
    base = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, token_budget=0)
    assert config.loss_type == "ppo"
    assert config.advantage_estimator == "group" and config.advantage_normalization == "group"
    assert not config.scores_on_trainer
    for base_field in dataclasses.fields(AsyncGRPOConfig):
        assert getattr(config, base_field.name) == getattr(base, base_field.name), base_field.name


def test_single_stream_defaults(tmp_path):
    config = make(tmp_path, advantage_estimator="spo++", num_generations=1, loss_type="aspo")
    assert config.num_generations == 1
    assert config.advantage_normalization == "token"
    assert config.value_prior_strength == pytest.approx(8.0)
    assert config.scores_on_trainer
    assert make(tmp_path, advantage_estimator="spo", num_generations=1).advantage_normalization == "batch"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"loss_type": "grpo"}, r"AsyncASPOConfig.loss_type='grpo' is invalid: must be one of \('aspo', 'ppo'\)"),
        (
            {"aspo_dual_clip": 2.0},
            r"AsyncASPOConfig.aspo_dual_clip=2.0 is invalid: it only acts in the aspo loss, so it needs "
            r"loss_type='aspo' "
            r"\(got loss_type='ppo'\)",
        ),
        ({"loss_type": "aspo", "aspo_dual_clip": 1.0}, r"aspo_dual_clip=1.0 is invalid: must lie in \(1, 100\]"),
        ({"num_generations": 1}, r"num_generations=1 is invalid: advantage_estimator='group' needs at least 2"),
        ({"advantage_estimator": "spo++", "advantage_normalization": "group"}, r"advantage_normalization='group'"),
        ({"prioritized_sampling": True}, r"prioritized_sampling=True is invalid: priorities come from the value"),
        ({"advantage_estimator": "spo", "value_rho_mode": "kl"}, r"value_rho_mode='kl' is invalid"),
        ({"value_rho": 1.5}, r"value_rho=1.5 is invalid: must lie in \(0, 1\]"),
        ({"value_rho": "high"}, r"value_rho='high' is invalid: must be a finite number"),
    ],
)
def test_bad_values_name_the_field(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        make(tmp_path, **overrides)


def test_trainer_side_scoring_needs_fixed_count_batches(tmp_path):
    with pytest.raises(ValueError, match=r"AsyncASPOConfig.token_budget=None is invalid: .* set token_budget=0"):
        AsyncASPOConfig(output_dir=str(tmp_path), use_cpu=True, advantage_estimator="spo++")
    assert AsyncASPOConfig(output_dir=str(tmp_path), use_cpu=True).token_budget is None
