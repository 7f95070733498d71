"""Reward function calls (trl_aspo.trainers.reward_checks): a return value TRL cannot use named with the function and
the value, and `reward_with_timeout` (the `reward_timeout_s` of `trl-aspo train`). The trainer runs:
tests/integration/test_reward_checks_trainer.py."""

from __future__ import annotations

import asyncio
import functools
import threading
import time

import numpy as np
import pytest
import torch
from trl.trainer.utils import get_callable_name, is_async_callable

from trl_aspo.trainers.reward_checks import RewardTimeoutError, reward_output_problem, reward_with_timeout

ALLOWED = "it must return a list with one number (int or float) or None (no score) per completion."


@pytest.mark.parametrize(
    "output",
    [[1.0, 0, True, None], (0.5,), np.array([0.5, 1.0]), [np.float32(0.5), np.int64(1)], [torch.tensor(0.5)], []],
)
def test_what_trl_converts_passes(output):
    assert reward_output_problem("f", output) is None


def test_strings_and_other_values_are_named_with_the_function():
    assert reward_output_problem("grade", [1.0, "0.5"]) == (
        f"reward function 'grade' returned [1.0, '0.5']: its value at position 1 is str '0.5'; {ALLOWED}"
    )
    assert reward_output_problem("grade", [{"score": 1}]) == (
        f"reward function 'grade' returned [{{'score': 1}}]: its value at position 0 is dict {{'score': 1}}; {ALLOWED}"
    )
    for output, shown in (("1.0", "str '1.0'"), (0.5, "float 0.5"), (None, "NoneType None"), ({"a": 1}, "dict")):
        assert reward_output_problem("grade", output).startswith(f"reward function 'grade' returned {shown}")


def hangs(release: threading.Event):
    def slow_reward(completions, **kwargs):
        release.wait()
        return [1.0] * len(completions)

    return slow_reward


def test_a_synchronous_call_past_the_limit_raises_naming_the_function():
    release = threading.Event()
    limited = reward_with_timeout(hangs(release), 0.2)
    assert get_callable_name(limited) == "slow_reward" and not is_async_callable(limited)
    start = time.monotonic()
    with pytest.raises(RewardTimeoutError) as error:
        limited(completions=["a"])
    assert 0.2 <= time.monotonic() - start < 5
    assert str(error.value) == (
        "reward function 'slow_reward' did not return within 0.2 s (reward_timeout_s); the run stops here. Raise "
        "reward_timeout_s if the function is only slow. The call was abandoned, not stopped: its thread runs on "
        "until the process exits."
    )
    release.set()
    # Within the limit: the value, or the function's own exception, as without the limit.
    assert limited(completions=["a", "b"]) == [1.0, 1.0]
    with pytest.raises(KeyError):
        reward_with_timeout(lambda **kwargs: {}["missing"], 5)(completions=[])


def test_an_async_call_past_the_limit_is_cancelled():
    cancelled = []

    async def slow_async_reward(completions, **kwargs):
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    limited = reward_with_timeout(slow_async_reward, 0.1)
    assert is_async_callable(limited) and get_callable_name(limited) == "slow_async_reward"
    with pytest.raises(RewardTimeoutError, match="'slow_async_reward' did not return within 0.1 s"):
        asyncio.run(limited(completions=["a"]))
    assert cancelled == [True]


def test_a_partial_keeps_the_name_trl_gives_it():
    def scaled(completions, factor, **kwargs):
        return [factor] * len(completions)

    limited = reward_with_timeout(functools.partial(scaled, factor=2.0), 5)
    assert get_callable_name(limited) == "scaled" and limited(completions=["a"]) == [2.0]


@pytest.mark.parametrize("seconds", [0, -1, True, "5"])
def test_the_limit_is_a_positive_number(seconds):
    with pytest.raises(ValueError, match=f"seconds must be a number > 0, got {seconds!r}"):
        reward_with_timeout(lambda **kwargs: [], seconds)


def test_reward_timeout_s_is_a_positive_number_of_the_synchronous_trainer():
    from trl_aspo.cli.parsers import ASPOScriptArguments

    assert ASPOScriptArguments(reward_timeout_s=30).reward_timeout_s == 30
    with pytest.raises(
        ValueError, match=r"^reward_timeout_s=0: seconds a reward call may take, so a finite number > 0"
    ):
        ASPOScriptArguments(reward_timeout_s=0)
    with pytest.raises(ValueError, match=r"^reward_timeout_s=5 is a setting of the synchronous trainer"):
        ASPOScriptArguments(trainer="async", reward_timeout_s=5)
