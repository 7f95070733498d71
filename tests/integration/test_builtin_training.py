"""The calculator warm start trains the built-in tiny model (a few steps)."""

from __future__ import annotations

import math

import pytest
from warmstart.calculator import WarmStartConfig, warm_start

from trl_aspo.builtin import build_random_model, build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_warm_start_runs(tokenizer):
    model = build_random_model(tokenizer, hidden_size=32, num_layers=1)
    config = WarmStartConfig(steps=3, batch_size=4, copy_steps=1, warmup_steps=1, num_train_problems=30)
    losses = warm_start(model, tokenizer, config, progress=False)
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
