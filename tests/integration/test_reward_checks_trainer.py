"""The synchronous trainer's reward calls: a reward function that returns strings stops the run with an error naming
it and the value (before: torch's "too many dimensions 'str'", naming neither), and a call that never returns stops
the run after `reward_timeout_s` (before: the run waited forever), in Python and through `trl-aspo train`."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
from helpers import REPO_ROOT, digit_share_reward

from trl_aspo import ASPOTrainer
from trl_aspo.trainers.reward_checks import RewardTimeoutError, reward_with_timeout

HANGING_REWARD = """
import threading


def hanging_reward(completions, **kwargs):
    threading.Event().wait()
"""


def strings_reward(completions, **kwargs):
    return ["1.0"] * len(completions)


def trainer(tiny_config, tiny_model, tiny_tokenizer, calculator_dataset, reward_funcs) -> ASPOTrainer:
    return ASPOTrainer(
        model=tiny_model,
        reward_funcs=reward_funcs,
        args=tiny_config(max_steps=1),
        train_dataset=calculator_dataset.select(range(8)),
        processing_class=tiny_tokenizer,
    )


def test_a_reward_function_returning_strings_is_named(tiny_config, tiny_model, tiny_tokenizer, calculator_dataset):
    run = trainer(tiny_config, tiny_model, tiny_tokenizer, calculator_dataset, [digit_share_reward, strings_reward])
    with pytest.raises(ValueError) as error:
        run.train()
    assert str(error.value) == (
        f"reward function 'strings_reward' returned {['1.0'] * 8!r}: its value at position 0 is str '1.0'; it must "
        "return a list with one number (int or float) or None (no score) per completion."
    )
    assert run.reward_funcs == [digit_share_reward, strings_reward]  # the checking wrappers are gone after the call


def test_a_reward_call_past_its_time_limit_stops_the_run(tiny_config, tiny_model, tiny_tokenizer, calculator_dataset):
    release = threading.Event()

    def slow_reward(completions, **kwargs):
        release.wait()
        return [0.0] * len(completions)

    limited = reward_with_timeout(slow_reward, 1)
    run = trainer(tiny_config, tiny_model, tiny_tokenizer, calculator_dataset, [limited])
    assert run.reward_func_names == ["slow_reward"]
    try:
        with pytest.raises(RewardTimeoutError, match=r"^reward function 'slow_reward' did not return within 1 s"):
            run.train()
    finally:
        release.set()


@pytest.mark.slow
def test_trl_aspo_train_stops_a_hanging_reward_after_reward_timeout_s(tmp_path):
    (tmp_path / "hanging.py").write_text(HANGING_REWARD)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [
        sys.executable, "-m", "trl_aspo.cli.main", "train", "--config", str(REPO_ROOT / "configs" / "smoke.yaml"),
        "--output_dir", str(tmp_path / "run"), "--max_steps", "1", "--plot", "false",
        "--reward_funcs", "hanging.hanging_reward", "--reward_timeout_s", "2",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "trl_aspo.trainers.reward_checks.RewardTimeoutError: reward function 'hanging_reward' did not return within "
        "2 s (reward_timeout_s); the run stops here. Raise reward_timeout_s if the function is only slow. The call "
        "was abandoned, not stopped: its thread runs on until the process exits."
    )
