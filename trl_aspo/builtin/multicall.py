"""The built-in multi-call task: problems that need two to four calls of a calculator doing one operation per call.

Families (in equal shares), with the calls that solve them, innermost products first, then left to right:

- `a * b + c`          2 calls: a*b -> p, p+c
- `a * b - c`          2 calls: a*b -> p, p-c
- `a * b + c * d`      3 calls: a*b -> p, c*d -> q, p+q
- `a * b + c * d - e`  4 calls: a*b -> p, c*d -> q, p+q -> s, s-e

Operand ranges keep every operand, intermediate and result a single token of the built-in tokenizer (an integer in
0..9999, never negative), so a model only copies numbers (from the question or an earlier tool result), never
computes them. The tool refuses anything but one operation on two numbers, so a problem cannot be solved in one call,
and answering after too few calls (with an intermediate result) is wrong: more calls, and calls made early, pay.

The tool is deliberately *named* `calculator` with the same one-argument schema as `trl_aspo.builtin.task.calculator`:
the tool schema is part of every prompt, and the built-in tokenizer merged exactly that schema into few tokens (prompt
length dominates generation time on a CPU). Only its help text says "one operation".

The train and held-out ("test") splits partition the problems by a stable hash of the problem's expression.
The final answer format is "The answer is N." (reward: `trl_aspo.builtin.task.correctness_reward`).
"""

from __future__ import annotations

import ast
import hashlib
import random
from dataclasses import dataclass

from datasets import Dataset

from trl_aspo.builtin.calculator import CalculatorError, evaluate
from trl_aspo.builtin.task import TEST_FRACTION, correctness_reward

__all__ = [
    "FAMILIES",
    "MAX_CALL_CHARS",
    "MultiCallProblem",
    "calculator",
    "correctness_reward",
    "make_dataset",
    "make_problems",
    "question",
    "random_problem",
    "solution_calls",
    "split_of",
]

QUESTION_TEMPLATE = "What is {expression}?"
# One operation on two numbers of up to 4 digits fits easily; anything longer is refused before parsing.
MAX_CALL_CHARS = 40

PRODUCT_FACTORS = range(11, 71)  # a*b + c*d <= 2 * 70 * 70 = 9800
SMALL_TERMS = range(10, 100)  # a*b - c >= 121 - 99 > 0; a*b + c <= 99 * 99 + 99 = 9900

# Family name -> (operand ranges, the number of calls that solve it).
FAMILIES: dict[str, tuple[tuple[range, ...], int]] = {
    "a*b+c": ((range(11, 100), range(11, 100), SMALL_TERMS), 2),
    "a*b-c": ((range(11, 100), range(11, 100), SMALL_TERMS), 2),
    "a*b+c*d": ((PRODUCT_FACTORS,) * 4, 3),
    "a*b+c*d-e": ((*(PRODUCT_FACTORS,) * 4, SMALL_TERMS), 4),
}


@dataclass(frozen=True)
class MultiCallProblem:
    """A problem: its family (a key of `FAMILIES`) and its operands in the order the question writes them."""

    family: str
    operands: tuple[int, ...]

    @property
    def expression(self) -> str:
        """The problem as written in the question, e.g. "12 * 34 + 56"."""
        text = " ".join(self.family)
        for name, value in zip("abcde", self.operands, strict=False):
            text = text.replace(name, str(value))
        return text


def question(problem: MultiCallProblem) -> str:
    """The user message of a problem."""
    return QUESTION_TEMPLATE.format(expression=problem.expression)


def solution_calls(problem: MultiCallProblem, results: list[int] | None = None) -> list[tuple[str, int]]:
    """The one-operation calls that solve `problem`, as (expression, true result) pairs, in order.

    A later call uses earlier results; `results[i]` (when given) replaces the i-th call's result in the later calls,
    as a tool that answered `results[i]` would make the caller write them (the warm start uses it to train copying).
    """
    values = iter(results or [])

    def call(left: int, op: str, right: int) -> tuple[str, int]:
        true = {"+": left + right, "-": left - right, "*": left * right}[op]
        calls.append((f"{left}{op}{right}", true))
        return next(values, true)

    calls: list[tuple[str, int]] = []
    a, b, c, *rest = problem.operands
    if problem.family in ("a*b+c", "a*b-c"):
        call(call(a, "*", b), problem.family[3], c)
    else:
        d = rest[0]
        total = call(call(a, "*", b), "+", call(c, "*", d))
        if problem.family == "a*b+c*d-e":
            call(total, "-", rest[1])
    return calls


def split_of(problem: MultiCallProblem) -> str:
    """The split a problem belongs to ("train" or "test"), from a stable hash of its expression."""
    digest = hashlib.sha256(f"multicall:{problem.expression}".encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") / 2**64 < TEST_FRACTION else "train"


def random_problem(rng: random.Random, family: str) -> MultiCallProblem:
    """A uniformly drawn problem of `family` (either split)."""
    ranges, _ = FAMILIES[family]
    return MultiCallProblem(family, tuple(rng.choice(r) for r in ranges))


def make_problems(split: str, n: int, seed: int = 0) -> list[MultiCallProblem]:
    """`n` distinct problems of `split`, drawn with a seeded generator, the families in turn (equal shares)."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(f"multicall-{seed}-{split}")
    families = list(FAMILIES)
    problems: list[MultiCallProblem] = []
    seen: set[MultiCallProblem] = set()
    # Every family has over 10^5 problems per split, so rejection sampling of a few thousand never stalls.
    while len(problems) < n:
        problem = random_problem(rng, families[len(problems) % len(families)])
        if problem not in seen and split_of(problem) == split:
            seen.add(problem)
            problems.append(problem)
    return problems


def make_dataset(split: str, n: int, seed: int = 0) -> Dataset:
    """A conversational dataset of `n` problems: `prompt` (one user message) and `answer` (int) columns."""
    problems = make_problems(split, n, seed)
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": question(problem)}] for problem in problems],
            "answer": [solution_calls(problem)[-1][1] for problem in problems],
        }
    )


def _is_number(node: ast.AST) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        node = node.operand
    return isinstance(node, ast.Constant) and type(node.value) in (int, float)


def evaluate_one_operation(expression: str) -> str:
    """Evaluate `expression` if it is one binary operation on two numbers (e.g. "408+56"); else `CalculatorError`."""
    if not isinstance(expression, str):
        raise CalculatorError("expression must be a string")
    if len(expression) > MAX_CALL_CHARS:
        raise CalculatorError(f"expression longer than {MAX_CALL_CHARS} characters; give one operation")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalculatorError("invalid expression") from None
    body = tree.body
    if not (isinstance(body, ast.BinOp) and _is_number(body.left) and _is_number(body.right)):
        raise CalculatorError("one operation per call: two numbers and one operator, e.g. 12*34")
    return evaluate(expression)


def calculator(expression: str) -> str:
    """
    Evaluate an arithmetic expression.

    Args:
        expression: The expression, one operation, e.g. 12*34.
    """
    try:
        return evaluate_one_operation(expression)
    except CalculatorError as exc:
        return f"error: {exc}"
