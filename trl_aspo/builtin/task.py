"""The built-in arithmetic task: problems a tiny model cannot solve in its head, a calculator tool, and a reward.

Problems are 2-digit x 2-digit products and 3-digit sums/differences. Every operand and result is a single token of
the built-in tokenizer, so a model only has to *copy* numbers (operands into the call, the tool result into the
answer), never compute them; computing them is what it cannot do, which is why calling the tool pays.

The train and held-out ("test") splits partition the problem space by problem identity (a stable hash of
"a op b"), so no held-out problem is ever trained on, whatever the seeds and sizes.

The final answer format is "The answer is N." in an assistant message without tool calls.
"""

from __future__ import annotations

import hashlib
import random
import re
from typing import Any

from datasets import Dataset

from trl_aspo.builtin.calculator import calculator

__all__ = [
    "ANSWER_TEMPLATE",
    "OPERATIONS",
    "PREAMBLES",
    "QUESTION_TEMPLATE",
    "Problem",
    "calculator",
    "correctness_reward",
    "extract_answer",
    "SYSTEM_MESSAGE",
    "make_chat_dataset",
    "make_dataset",
    "make_problems",
    "solve",
    "split_of",
]

# Phrases of the built-in transcripts. Preambles are text a model may write before calling (12-22 tokens each).
QUESTION_TEMPLATE = "What is {a} {op} {b}?"
ANSWER_TEMPLATE = "The answer is {answer}."
PREAMBLES = [
    "Let me compute.",
    "I will use the calculator.",
    "This needs a calculator.",
    "Let me think step by step.",
    "Hmm, let me see.",
    "First, I look at the numbers.",
]

# Operand ranges per operation; results stay within the tokenizer's single-token numbers (<= 9999).
OPERATIONS: dict[str, tuple[range, range]] = {
    "*": (range(11, 100), range(11, 100)),
    "+": (range(100, 1000), range(100, 1000)),
    "-": (range(100, 1000), range(100, 1000)),
}
TEST_FRACTION = 0.2
# The system message of `builtin:calculator-chat`, for pretrained chat models: TRL's Qwen2.5 template (which TRL's
# tool-call parser needs verbatim) writes "You are Qwen, created by Alibaba Cloud..." when a prompt has none.
SYSTEM_MESSAGE = (
    'You are a helpful assistant. For arithmetic, call the calculator tool, then reply with "The answer is N."'
)

Problem = tuple[int, str, int]

_ANSWER_RE = re.compile(r"answer is\s*(-?\d+(?:\.\d+)?)")


def solve(a: int, op: str, b: int) -> int:
    """The exact answer of a problem."""
    return {"*": a * b, "+": a + b, "-": a - b}[op]


def split_of(problem: Problem) -> str:
    """The split a problem belongs to ("train" or "test"), from a stable hash of its identity."""
    a, op, b = problem
    digest = hashlib.sha256(f"{a}{op}{b}".encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") / 2**64 < TEST_FRACTION else "train"


def make_problems(split: str, n: int, seed: int = 0, operations: tuple[str, ...] = ("*", "+", "-")) -> list[Problem]:
    """`n` distinct problems of `split`, drawn with a seeded generator (operations in equal proportions)."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    fraction = TEST_FRACTION if split == "test" else 1 - TEST_FRACTION
    for index, op in enumerate(operations):
        left, right = OPERATIONS[op]
        wanted = len(range(index, n, len(operations)))
        # Rejection sampling slows down as a split's problems run out; stay well below half of them.
        available = int(0.5 * fraction * len(left) * len(right) / (2 if op == "-" else 1))
        if wanted > available:
            raise ValueError(f"{n} problems need {wanted} {op!r} problems in {split!r}; at most {available} allowed")
    rng = random.Random(f"{seed}-{split}")
    problems: list[Problem] = []
    seen: set[Problem] = set()
    while len(problems) < n:
        op = operations[len(problems) % len(operations)]
        left, right = OPERATIONS[op]
        a, b = rng.choice(left), rng.choice(right)
        if op == "-" and a < b:
            a, b = b, a
        problem = (a, op, b)
        if problem not in seen and split_of(problem) == split:
            seen.add(problem)
            problems.append(problem)
    return problems


def make_dataset(split: str, n: int, seed: int = 0, operations: tuple[str, ...] = ("*", "+", "-")) -> Dataset:
    """A conversational dataset of `n` problems: `prompt` (one user message) and `answer` (int) columns."""
    problems = make_problems(split, n, seed, operations)
    return Dataset.from_dict(
        {
            "prompt": [
                [{"role": "user", "content": QUESTION_TEMPLATE.format(a=a, op=op, b=b)}] for a, op, b in problems
            ],
            "answer": [solve(*problem) for problem in problems],
        }
    )


def make_chat_dataset(split: str, n: int, seed: int = 0) -> Dataset:
    """`make_dataset`'s problems with `SYSTEM_MESSAGE` before each question (`builtin:calculator-chat`)."""
    dataset = make_dataset(split, n, seed)
    system = {"role": "system", "content": SYSTEM_MESSAGE}
    return dataset.map(lambda row: {"prompt": [system, *row["prompt"]]})


def extract_answer(text: str) -> str | None:
    """The number after the last "answer is" in `text`, or None."""
    matches = _ANSWER_RE.findall(text)
    return matches[-1] if matches else None


def _final_text(completion: Any) -> str | None:
    # Only the last message counts, and only a final assistant answer: a pending or truncated tool call scores 0.
    if isinstance(completion, str):
        return completion
    if not completion:
        return None
    last = completion[-1]
    if last.get("role") != "assistant" or last.get("tool_calls"):
        return None
    return last.get("content") or ""


def correctness_reward(completions: list[Any], answer: list[Any], **kwargs: Any) -> list[float]:
    """1.0 when the completion's final assistant message says "The answer is N." with the right N, else 0.0.

    TRL passes conversational completions as lists of messages (assistant turns and tool messages, in order);
    plain-text completions are accepted too.
    """
    rewards = []
    for completion, expected in zip(completions, answer, strict=True):
        text = _final_text(completion)
        found = extract_answer(text) if text is not None else None
        rewards.append(1.0 if found is not None and float(found) == float(expected) else 0.0)
    return rewards
