"""`max_completion_length` against the model's context (issue 45 item 7): the context a config gives, the budget
refused at or beyond it, a prompt that does not fit refused naming it."""

from __future__ import annotations

import logging

import pytest
from transformers import LlavaConfig, Qwen2Config

from trl_aspo.algorithms.context_length import check_completion_budget, check_prompts_fit, model_context_length


def test_the_context_of_a_config():
    assert model_context_length(Qwen2Config(max_position_embeddings=512)) == 512
    scaled = Qwen2Config(max_position_embeddings=512, rope_parameters={"rope_type": "linear", "factor": 4.0})
    assert model_context_length(scaled) == 2048
    # A multimodal model's context is its text model's.
    assert (
        model_context_length(LlavaConfig(text_config={"model_type": "qwen2", "max_position_embeddings": 300})) == 300
    )

    class NoPositions:
        pass

    assert model_context_length(NoPositions()) is None


def test_a_budget_at_or_beyond_the_context_is_refused_naming_both(caplog):
    check_completion_budget(511, 512, "here")
    for budget in (512, 10**9):
        with pytest.raises(ValueError) as error:
            check_completion_budget(budget, 512, "the config")
        assert str(error.value).startswith(
            f"max_completion_length={budget} must be smaller than the model's context of 512 tokens (the config)"
        )
    with caplog.at_level(logging.WARNING, logger="trl_aspo.algorithms.context_length"):
        check_completion_budget(10**9, None, "the server")
    assert "The model's context is unknown (the server says nothing)" in caplog.text


def test_a_prompt_that_does_not_fit_is_named():
    check_prompts_fit([12, 500], 12, 512, str)
    check_prompts_fit([10**6], 12, None, str)
    with pytest.raises(ValueError) as error:
        check_prompts_fit([12, 501], 12, 512, lambda index: f"Row {index}")
    assert str(error.value).startswith(
        "Row 1 has 501 tokens: with max_completion_length=12 it needs 513 positions, more than the model's context of "
        "512."
    )
