"""Shared fixtures: one locally built tiny tokenizer per session, fresh tiny models and small datasets per test."""

from __future__ import annotations

import importlib.util
import os

import pytest
from helpers import tiny_run_fields

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The vLLM tier needs vLLM's CPU build, which only the environment of `make test-vllm` has.
collect_ignore = [] if importlib.util.find_spec("vllm") else ["vllm_tier"]


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from trl.chat_template_utils import add_response_schema

    from trl_aspo.builtin import build_tokenizer

    return add_response_schema(build_tokenizer())


@pytest.fixture(scope="session", name="calculator_tokenizer")
def calculator_tokenizer_fixture():
    """The built-in checkpoint's tokenizer with TRL's response schema (`helpers.calculator_tokenizer`), once."""
    from helpers import calculator_tokenizer

    return calculator_tokenizer()


@pytest.fixture
def tiny_model(tiny_tokenizer):
    """A fresh random tiny Qwen2 per test (trainers mutate their model), built with a fixed seed."""
    from trl_aspo.builtin import build_random_model

    return build_random_model(tiny_tokenizer, seed=0)


@pytest.fixture(scope="session")
def calculator_dataset():
    from trl_aspo.builtin.task import make_dataset

    return make_dataset("train", 32, seed=0)


@pytest.fixture
def tiny_config(tmp_path):
    """An ASPOConfig for a few fast CPU steps; keyword overrides replace any field."""
    from trl_aspo import ASPOConfig

    def make(**overrides):
        return ASPOConfig(
            **tiny_run_fields(**{"output_dir": tmp_path / "out", "dataloader_num_workers": 0, **overrides})
        )

    return make
