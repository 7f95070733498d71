"""Issue 17 item 10: a non-finite advantage stops the run where it is made, naming what fed it (the check and its
sources; the trainers stopping on one: tests/integration/test_advantage_guard_trainer.py)."""

from __future__ import annotations

import pytest
import torch

from trl_aspo import ASPOConfig
from trl_aspo.algorithms.advantage_checks import NonFiniteAdvantageError, advantage_sources, check_finite_advantages


def test_finite_advantages_pass_and_others_name_their_inputs():
    advantages = torch.tensor([0.5, -0.5, 0.0])
    assert check_finite_advantages(advantages, {}) is advantages
    sources = {"reward": torch.tensor([1.0, 2.0, 3.0]), "ASPOConfig.tool_shaping_penalty": "my.penalty"}
    for bad in (float("nan"), float("inf"), 1e308):
        values = torch.tensor([0.5, bad, 0.0], dtype=torch.float64)
        with pytest.raises(
            NonFiniteAdvantageError,
            match=r"1 of 3 advantages are not finite in float32 \(sample 1: .*\).*computed from: reward\[1\]=2\.0; "
            r"ASPOConfig\.tool_shaping_penalty='my\.penalty'",
        ):
            check_finite_advantages(values, sources)
    assert issubclass(NonFiniteAdvantageError, ValueError)


def test_sources_name_the_shaping_fields_only_when_shaping():
    plain = ASPOConfig(output_dir="unused", per_device_train_batch_size=4, num_generations=2, use_cpu=True)
    assert set(advantage_sources(plain, {"reward": torch.zeros(1)})) == {
        "reward",
        "ASPOConfig.advantage_estimator",
        "ASPOConfig.advantage_normalization",
    }
    shaped = ASPOConfig(
        output_dir="unused", per_device_train_batch_size=4, num_generations=2, use_cpu=True, tool_shaping=True
    )
    assert "ASPOConfig.tool_shaping_penalty" in advantage_sources(shaped, {})
