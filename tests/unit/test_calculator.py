"""Tests for the safe calculator tool, the built-in task's problem generator, and its reward."""

from __future__ import annotations

import time

import pytest
from transformers.utils.chat_template_utils import get_json_schema

from trl_aspo.builtin.calculator import calculator
from trl_aspo.builtin.task import (
    correctness_reward,
    extract_answer,
    make_dataset,
    make_problems,
    split_of,
)


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("12*34", "408"),
        ("  12 * 34 ", "408"),
        ("(1+2)*3", "9"),
        ("-5 + 2", "-3"),
        ("7/2", "3.5"),
        ("8/4", "2"),
        ("7//2", "3"),
        ("7 % 3", "1"),
        ("2**8", "256"),
        ("2**-1", "0.5"),
        ("1/3", "0.333333"),
        ("1.5*2", "3"),
        ("--4", "4"),
    ],
)
def test_calculator_results(expression, expected):
    assert calculator(expression) == expected


HOSTILE = [
    "__import__('os').system('x')",
    "(1).__class__",
    "x + 1",
    "open('/etc/passwd')",
    "lambda: 1",
    "[1, 2]",
    "'a' * 3",
    "True + 1",
    "1 if 1 else 2",
    "9**9**9",
    "2**100",
    "99999**5",
    "10**8 * 10**8",
    "1e308 * 10",
    "1/0",
    "5 % 0",
    "(-8) ** 0.5",
    "(" * 10_000 + "1" + ")" * 10_000,
    "1+" * 99 + "1",
    "1" * 1_000_000,
    "",
    "1 +",
    "12*34; import os",
    "\x00",
]


@pytest.mark.parametrize("expression", HOSTILE, ids=range(len(HOSTILE)))
def test_calculator_refuses_hostile_input_fast(expression):
    start = time.perf_counter()
    result = calculator(expression)
    assert time.perf_counter() - start < 0.1
    assert result.startswith("error: "), result
    assert len(result) < 100


def test_calculator_refuses_non_string():
    assert calculator(12).startswith("error: ")


def test_calculator_schema_is_short():
    schema = get_json_schema(calculator)
    assert schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["required"] == ["expression"]
    assert schema["function"]["parameters"]["properties"]["expression"]["type"] == "string"
    assert len(schema["function"]["description"]) < 60


def test_splits_are_disjoint_and_deterministic():
    train = make_problems("train", 3000, seed=0)
    test = make_problems("test", 1000, seed=0)
    assert not set(train) & set(test)
    assert len(set(train)) == len(train)
    assert make_problems("train", 3000, seed=0) == train
    assert make_problems("train", 50, seed=1) != train[:50]
    # Other seeds draw other problems but never cross the split.
    assert not set(make_problems("train", 1000, seed=5)) & set(make_problems("test", 1000, seed=9))
    assert all(split_of(p) == "test" for p in test)
    with pytest.raises(ValueError):
        make_problems("validation", 1)


def test_make_dataset():
    dataset = make_dataset("test", 30, seed=0)
    assert dataset.column_names == ["prompt", "answer"]
    assert len(dataset) == 30
    ops = set()
    for row in dataset:
        assert row["prompt"][0]["role"] == "user"
        a, op, b = row["prompt"][0]["content"].removeprefix("What is ").removesuffix("?").split()
        ops.add(op)
        assert row["answer"] == {"*": int(a) * int(b), "+": int(a) + int(b), "-": int(a) - int(b)}[op]
        assert 0 <= row["answer"] <= 9999
    assert ops == {"*", "+", "-"}
    assert make_dataset("test", 30, seed=0)["prompt"] == dataset["prompt"]


def _call(expression: str) -> dict:
    return {
        "role": "assistant",
        "content": "Let me compute.",
        "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
        ],
    }


def test_correctness_reward():
    tool = {"role": "tool", "name": "calculator", "content": "408"}
    completions = [
        [{"role": "assistant", "content": "The answer is 408."}],
        [{"role": "assistant", "content": "The answer is 407."}],
        [_call("12*34"), tool, {"role": "assistant", "content": "The answer is 408."}],
        [_call("12*34"), tool, {"role": "assistant", "content": "The answer is"}],  # truncated
        [_call("12*34")],  # the call never got answered
        [_call("12*34"), tool],  # ends on the tool message
        [{"role": "assistant", "content": "The answer is 40. No, the answer is 408."}],
        [{"role": "assistant", "content": "The answer is 408. No, the answer is 40."}],
        [{"role": "assistant", "content": "408"}],  # no answer format
        [],
        "The answer is 408.",
    ]
    rewards = correctness_reward(completions, answer=[408] * len(completions), prompts=None)
    assert rewards == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]


def test_extract_answer():
    assert extract_answer("The answer is 12.") == "12"
    assert extract_answer("answer is -3") == "-3"
    assert extract_answer("nothing") is None
