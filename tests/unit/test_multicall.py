"""`builtin:multicall`: its problems, one-operation tool and warm start, and the shipped `builtin:tiny-multicall`."""

from __future__ import annotations

import itertools
import json
import operator
import random
import re

import pytest
from warmstart.calculator import TranscriptEncoder
from warmstart.multicall import MultiCallWarmStartConfig, sample_multicall_transcript

from trl_aspo.builtin import MULTICALL_CHECKPOINT_DIR, TINY_MULTICALL, build_tokenizer
from trl_aspo.builtin.multicall import (
    FAMILIES,
    MultiCallProblem,
    calculator,
    correctness_reward,
    make_dataset,
    make_problems,
    question,
    random_problem,
    solution_calls,
    split_of,
)
from trl_aspo.builtin.tokenizer import MAX_NUMBER
from trl_aspo.evaluation.tool_use import tool_suffix_ids

OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _value(expression: str) -> int:
    """The value of a question's expression with * before + and -, computed independently of the task module."""
    terms = re.split(r" ([+-]) ", expression)
    total = 0
    sign = "+"
    for index, term in enumerate(terms):
        if index % 2:
            sign = term
            continue
        factors = [int(f) for f in term.split(" * ")]
        product = factors[0] * (factors[1] if len(factors) > 1 else 1)
        total = OPERATORS[sign](total, product)
    return total


# ------------------------------------------------------------------------------------------------- problems
def test_splits_are_disjoint_seeded_and_in_equal_family_shares():
    train = make_problems("train", 400, seed=0)
    test = make_problems("test", 400, seed=0)
    assert len(set(train)) == 400 and len(set(test)) == 400
    assert not {p.expression for p in train} & {p.expression for p in test}
    assert all(split_of(p) == "train" for p in train) and all(split_of(p) == "test" for p in test)
    assert make_problems("test", 400, seed=0) == test
    assert make_problems("test", 400, seed=1) != test
    # Another seed draws other problems of the same split, never the other split's.
    assert not {p.expression for p in make_problems("train", 400, seed=1)} & {p.expression for p in test}
    counts = {family: sum(p.family == family for p in test) for family in FAMILIES}
    assert counts == dict.fromkeys(FAMILIES, 100)
    # About a fifth of all problems are held out.
    rng = random.Random(3)
    drawn = [random_problem(rng, family) for family in FAMILIES for _ in range(500)]
    assert 0.15 < sum(split_of(p) == "test" for p in drawn) / len(drawn) < 0.25


def test_dataset_columns():
    dataset = make_dataset("test", 8, seed=0)
    problems = make_problems("test", 8, seed=0)
    assert dataset["prompt"][0] == [{"role": "user", "content": question(problems[0])}]
    assert dataset["answer"] == [_value(p.expression) for p in problems]
    assert question(MultiCallProblem("a*b+c*d-e", (12, 34, 56, 78, 90))) == "What is 12 * 34 + 56 * 78 - 90?"
    with pytest.raises(ValueError, match="split must be 'train' or 'test'"):
        make_problems("validation", 4)


def _extreme_problems(family: str) -> list[MultiCallProblem]:
    ranges, _ = FAMILIES[family]
    return [MultiCallProblem(family, ops) for ops in itertools.product(*[(r[0], r[-1]) for r in ranges])]


@pytest.mark.parametrize(("family", "calls"), [("a*b+c", 2), ("a*b-c", 2), ("a*b+c*d", 3), ("a*b+c*d-e", 4)])
def test_each_family_needs_its_calls_and_every_number_is_one_token(tokenizer, family, calls):
    rng = random.Random(0)
    problems = _extreme_problems(family) + [random_problem(rng, family) for _ in range(300)]
    for problem in problems:
        steps = solution_calls(problem)
        assert len(steps) == calls == FAMILIES[family][1]
        # Each call is one operation the tool performs; chained, they give the question's value.
        for expression, result in steps:
            assert re.fullmatch(r"\d+[+*-]\d+", expression)
            assert calculator(expression) == str(result)
        assert steps[-1][1] == _value(problem.expression)
        numbers = [*problem.operands, *(result for _, result in steps)]
        assert all(0 <= n <= MAX_NUMBER and tokenizer.tokenize(str(n)) == [str(n)] for n in numbers)
        # Every later call uses an earlier result: none can be made before its inputs exist.
        earlier = set(problem.operands)
        for expression, result in steps:
            assert {int(n) for n in re.findall(r"\d+", expression)} <= earlier
            earlier.add(result)


def test_solution_calls_carry_given_results():
    problem = MultiCallProblem("a*b+c*d-e", (12, 34, 56, 78, 90))
    assert solution_calls(problem) == [("12*34", 408), ("56*78", 4368), ("408+4368", 4776), ("4776-90", 4686)]
    assert [e for e, _ in solution_calls(problem, [1, 2, 3, 4])] == ["12*34", "56*78", "1+2", "3-90"]


# ---------------------------------------------------------------------------------------------------- tool
@pytest.mark.parametrize(
    ("expression", "expected"),
    [("12*34", "408"), ("408+56", "464"), (" 7 - 9 ", "-2"), ("-3*4", "-12"), ("7/2", "3.5"), ("(12*34)", "408")],
)
def test_tool_does_one_operation(expression, expected):
    assert calculator(expression) == expected


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("12*34+5", "one operation per call"),
        ("12*(34+5)", "one operation per call"),
        ("12", "one operation per call"),
        ("x*2", "one operation per call"),
        ("__import__('os').system('true')", "one operation per call"),
        ("12**", "invalid expression"),
        ("", "invalid expression"),
        ("1" * 41 + "*2", "longer than 40 characters"),
        ("9" * 30 + "*" + "9", "result too large"),
        ("9999**9", "power too large"),
        ("5/0", "division by zero"),
    ],
)
def test_tool_refuses_without_raising(expression, error):
    answer = calculator(expression)
    assert answer.startswith("error: ") and error in answer


def test_tool_refuses_a_non_string():
    assert calculator(12) == "error: expression must be a string"


def test_tool_schema_is_the_calculators(tokenizer):
    # Same name and argument as builtin:calculator's tool, so prompts stay short and the call format is the same.
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tools=[calculator], add_generation_prompt=True, tokenize=False
    )
    schema = json.loads(re.search(r"<tools>\n(.*)\n</tools>", rendered).group(1))
    assert schema["function"]["name"] == "calculator"
    assert list(schema["function"]["parameters"]["properties"]) == ["expression"]
    assert "one operation" in schema["function"]["parameters"]["properties"]["expression"]["description"]


# -------------------------------------------------------------------------------------------------- reward
def _call(expression: str) -> dict:
    return {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}


def test_reward_reads_the_final_answer_after_several_calls():
    turns = [
        {"role": "assistant", "content": "", "tool_calls": [_call("12*34")]},
        {"role": "tool", "name": "calculator", "content": "408"},
        {"role": "assistant", "content": "", "tool_calls": [_call("408+56")]},
        {"role": "tool", "name": "calculator", "content": "464"},
    ]
    right = [*turns, {"role": "assistant", "content": "The answer is 464."}]
    early = [*turns[:2], {"role": "assistant", "content": "The answer is 408."}]
    pending = turns[:3]
    assert correctness_reward([right, early, pending], answer=[464, 464, 464]) == [1.0, 0.0, 0.0]


# ----------------------------------------------------------------------------------------------- warm start
def test_encoded_transcript_is_trls_multi_turn_concatenation(tokenizer):
    encoder = TranscriptEncoder(tokenizer, tools=[calculator])
    calls = [("12*34", "408"), ("56*78", "4368"), ("408+4368", "4776")]
    segments = encoder.encode_calls("What is 12 * 34 + 56 * 78?", "Let me compute.", calls, 4776)
    assert [s.trainable for s in segments] == [False, True, False, True, False, True, False, True]
    prompt = [{"role": "user", "content": "What is 12 * 34 + 56 * 78?"}]
    assert segments[0].ids == tokenizer.apply_chat_template(
        prompt, tools=[calculator], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    for index, (expression, result) in enumerate(calls):
        turn = segments[1 + 2 * index]
        content = "Let me compute.\n" if index == 0 else ""
        call_text = (
            f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'
        )
        assert tokenizer.decode(turn.ids) == f"{content}{call_text}<|im_end|>"
        # What the model would generate is the tokenizer's own encoding of that text.
        assert turn.ids == tokenizer.encode(tokenizer.decode(turn.ids), add_special_tokens=False)
        # TRL appends each tool response by ids, from GRPOTrainer's suffix construction.
        tool_message = [{"role": "tool", "name": "calculator", "content": result}]
        assert segments[2 + 2 * index].ids == tool_suffix_ids(tokenizer, tool_message)
    assert tokenizer.decode(segments[-1].ids) == "The answer is 4776.<|im_end|>"
    # Whole rollout = the chat template's rendering of the conversation (minus the trailing newline).
    conversation = [*prompt]
    for index, (expression, result) in enumerate(calls):
        content = "Let me compute." if index == 0 else ""
        conversation.append({"role": "assistant", "content": content, "tool_calls": [_call(expression)]})
        conversation.append({"role": "tool", "name": "calculator", "content": result})
    conversation.append({"role": "assistant", "content": "The answer is 4776."})
    rendered = tokenizer.apply_chat_template(conversation, tools=[calculator], tokenize=False)
    assert tokenizer.decode([t for s in segments for t in s.ids]) == rendered.removesuffix("\n")


def test_warm_start_mix_copies_results_and_varies_turns(tokenizer):
    encoder = TranscriptEncoder(tokenizer, tools=[calculator])
    config = MultiCallWarmStartConfig()
    rng = random.Random(0)
    problems = make_problems("train", 200, seed=0)
    made_counts, complete = [], 0
    for _ in range(400):
        problem = rng.choice(problems)
        text = tokenizer.decode(
            [t for s in sample_multicall_transcript(rng, encoder, problem, config, False) for t in s.ids]
        )
        expressions = re.findall(r'"expression": "([^"]+)"', text)
        results = re.findall(r"<tool_response>\n(-?\d+)\n", text)
        answer = re.search(r"The answer is (-?\d+)\.", text).group(1)
        made_counts.append(len(expressions))
        needed = FAMILIES[problem.family][1]
        assert len(expressions) <= needed and len(results) == len(expressions)
        # Calls are the solution's calls with the shown results carried in; the answer is the last shown result.
        expected = solution_calls(problem, [int(r) for r in results]) if results else []
        assert expressions == [e for e, _ in expected[: len(expressions)]]
        if results:
            assert answer == results[-1]
        complete += len(expressions) == needed
    assert set(made_counts) == {0, 1, 2, 3, 4}
    # An early stop makes fewer calls than needed, so complete transcripts are exactly the complete_probability draws.
    assert abs(complete / 400 - config.complete_probability) < 0.08


# ------------------------------------------------------------------------------------------------------ wiring
def test_builtin_names_resolve_to_the_multicall_task():
    from types import SimpleNamespace

    from trl_aspo.builtin import multicall
    from trl_aspo.cli.train import load_datasets, resolve_functions
    from trl_aspo.infra import resolve_model_path

    script_args = SimpleNamespace(
        dataset_name="builtin:multicall",
        builtin_train_size=12,
        builtin_test_size=8,
        builtin_seed=3,
        reward_funcs=["builtin:correctness"],
        tools=["builtin:one-op-calculator"],
    )
    train, test = load_datasets(script_args, None)
    assert train["prompt"] == make_dataset("train", 12, seed=3)["prompt"]
    assert test["answer"] == make_dataset("test", 8, seed=3)["answer"]
    rewards, tools = resolve_functions(script_args)
    assert tools == [multicall.calculator] and rewards == [correctness_reward]
    assert resolve_model_path(TINY_MULTICALL) == str(MULTICALL_CHECKPOINT_DIR)
