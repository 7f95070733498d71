"""Reward functions for the reference recipes that TRL does not ship, and the asynchronous trainer's reward sum."""

from __future__ import annotations

import asyncio
import inspect
import math
import re
import subprocess
import sys
from collections.abc import Callable

_PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def _last_python_block(completion) -> str | None:
    text = completion[-1]["content"] if isinstance(completion, list) else completion
    blocks = _PYTHON_BLOCK.findall(text or "")
    return blocks[-1] if blocks else None


def code_unit_test_reward(completions, tests, timeout: float = 10.0, **kwargs) -> list[float]:
    """1.0 when the completion's last ```python block passes every assert of its row's `tests`, else 0.0.

    Each program runs in a fresh `python -I` subprocess with a time limit. Its output is discarded unread (only the
    return code counts), so a program printing without end costs no memory. This isolates crashes and hangs, not
    malicious code: run untrusted generations inside a sandbox."""
    rewards = []
    for completion, row_tests in zip(completions, tests, strict=True):
        code = _last_python_block(completion)
        if code is None:
            rewards.append(0.0)
            continue
        program = code + "\n\n" + "\n".join(row_tests) + "\n"
        try:
            result = subprocess.run(
                [sys.executable, "-I", "-c", program],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=timeout,
                check=False,
            )
            rewards.append(1.0 if result.returncode == 0 else 0.0)
        except subprocess.TimeoutExpired:
            rewards.append(0.0)
    return rewards


def summed_rewards(reward_funcs: list[Callable]) -> Callable[..., list[float]]:
    """One TRL-style reward function returning, per completion, the sum of `reward_funcs` with weight 1 each, as
    TRL's asynchronous rollout worker scores (None counts as NaN and is skipped; NaN when every function abstains).
    Coroutine functions are awaited."""

    def total(**kwargs) -> list[float]:
        columns = []
        for func in reward_funcs:
            values = asyncio.run(func(**kwargs)) if inspect.iscoroutinefunction(func) else func(**kwargs)
            columns.append([math.nan if value is None else float(value) for value in values])
        totals = []
        for values in zip(*columns, strict=True):
            scored = [value for value in values if not math.isnan(value)]
            totals.append(sum(scored) if scored else math.nan)
        return totals

    return total
