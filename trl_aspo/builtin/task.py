"""The built-in arithmetic task: problems a tiny model cannot solve in its head, a calculator tool, and a reward.

Problems are 2-digit x 2-digit products and 3-digit sums/differences. Every operand and result is a single token of
the built-in tokenizer, so a model only has to *copy* numbers (operands into the call, the tool result into the
answer), never to compute them; computing them is what it cannot do, which is why calling the tool pays.

The final answer format is "The answer is N." in an assistant message without tool calls.
"""

from __future__ import annotations

# Phrases the built-in transcripts use; the tokenizer trains its merges on them so each costs only a few tokens.
QUESTION_TEMPLATE = "What is {a} {op} {b}?"
ANSWER_TEMPLATE = "The answer is {answer}."
PREAMBLES = [
    "Let me compute.",
    "I will use the calculator.",
    "This needs a calculator.",
    "Let me think step by step.",
    "Hmm, let me see.",
    "First, I look at the numbers.",
    "Let me think step by step. First, I look at the numbers.",
    "Hmm, let me see. This needs a calculator.",
]
