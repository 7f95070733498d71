"""Reward function calls of the synchronous trainer: a wrong return value named, and a time limit on a call.

TRL's `GRPOTrainer._calculate_rewards` calls each reward function and hands its list straight to `torch.tensor`, so
a function that returns strings (or a dict, or one number) stops the run with torch's own error ("too many
dimensions 'str'"), which names neither the function nor the value; and it waits on a call for as long as the call
takes, so a function that never returns holds the run forever.

- `checked_reward_calls(trainer)`: for the span of one `_calculate_rewards`, each reward function's return value is
  checked first; one TRL could not turn into rewards raises a `ValueError` naming the function, what it returned
  and what is allowed (a number or None per completion).
- `reward_with_timeout(func, seconds)`: `func` under a time limit (the `reward_timeout_s` of `trl-aspo train`);
  a call past it raises `RewardTimeoutError` naming the function and the limit, which stops the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import numbers
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from trl.trainer.utils import get_callable_name, is_async_callable


class RewardTimeoutError(TimeoutError):
    """A reward function call ran past its time limit (`reward_with_timeout`)."""


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def reward_output_problem(name: str, output: Any) -> str | None:
    """Why TRL cannot use `output`, the return value of the reward function `name`, as one reward per completion;
    None when it can. A value TRL converts (an int, a float, a bool, a NumPy or 0-d torch number, None) passes."""
    allowed = "a list with one number (int or float) or None (no score) per completion"
    if isinstance(output, str | bytes | dict) or not hasattr(output, "__iter__") or not hasattr(output, "__len__"):
        return f"reward function {name!r} returned {type(output).__name__} {_shown(output)}; it must return {allowed}."
    for index, value in enumerate(output):
        if value is None or isinstance(value, numbers.Real):
            continue
        try:  # the conversion TRL applies to the whole list: what it accepts passes here too
            torch.tensor([value], dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError):
            return (
                f"reward function {name!r} returned {_shown(output)}: its value at position {index} is "
                f"{type(value).__name__} {_shown(value)}; it must return {allowed}."
            )
    return None


def _named_like(wrapper: Callable, func: Callable) -> Callable:
    """`wrapper` with `func`'s name as TRL reads it (`get_callable_name`: a partial's function, an instance's class),
    which names the `rewards/<name>` metrics and the messages."""
    functools.update_wrapper(wrapper, func)
    wrapper.__name__ = get_callable_name(func)
    return wrapper


def _checked(func: Callable, name: str) -> Callable:
    def check(output):
        problem = reward_output_problem(name, output)
        if problem is not None:
            raise ValueError(problem)
        return output

    if is_async_callable(func):

        async def call_async(*args, **kwargs):
            return check(await func(*args, **kwargs))

        return _named_like(call_async, func)

    def call(*args, **kwargs):
        return check(func(*args, **kwargs))

    return _named_like(call, func)


@contextlib.contextmanager
def checked_reward_calls(trainer) -> Iterator[None]:
    """Within the block, `trainer.reward_funcs` (TRL's list, which `_calculate_rewards` calls) are wrappers that
    check each return value (`reward_output_problem`); reward models (`torch.nn.Module`) are left as they are."""
    originals = trainer.reward_funcs
    trainer.reward_funcs = [
        func if isinstance(func, torch.nn.Module) else _checked(func, name)
        for func, name in zip(originals, trainer.reward_func_names, strict=True)
    ]
    try:
        yield
    finally:
        trainer.reward_funcs = originals


def reward_with_timeout(func: Callable, seconds: float) -> Callable:
    """`func` (a reward function, synchronous or `async`) under a limit of `seconds` a call, keeping its name (TRL
    names the `rewards/<name>` metrics after it).

    A call past the limit raises `RewardTimeoutError`, naming the function and the limit; in a training step it
    stops the run. An `async` function's call is cancelled. A synchronous one runs in a thread of its own, which is
    abandoned, not stopped: Python cannot stop a thread, so the call runs on in the background until it returns or
    the process exits (a daemon thread does not hold the exit up)."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0:
        raise ValueError(f"reward_with_timeout: seconds must be a number > 0, got {seconds!r}.")
    name = get_callable_name(func)
    message = (
        f"reward function {name!r} did not return within {seconds:g} s (reward_timeout_s); the run stops here. Raise "
        "reward_timeout_s if the function is only slow."
    )
    if is_async_callable(func):

        async def call_async(*args, **kwargs):
            try:
                return await asyncio.wait_for(func(*args, **kwargs), seconds)
            except TimeoutError:
                raise RewardTimeoutError(message) from None

        return _named_like(call_async, func)

    def call(*args, **kwargs):
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["value"] = func(*args, **kwargs)
            except BaseException as error:  # noqa: BLE001 -- re-raised in the caller's thread below
                outcome["error"] = error

        thread = threading.Thread(target=run, name=f"reward {name}", daemon=True)
        thread.start()
        thread.join(seconds)
        if thread.is_alive():
            raise RewardTimeoutError(
                f"{message} The call was abandoned, not stopped: its thread runs on until the process exits."
            )
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    return _named_like(call, func)
