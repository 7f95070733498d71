"""Supervised warm start of `builtin:tiny-multicall` on synthetic multi-call transcripts of `builtin:multicall`.

It starts from the `builtin:tiny-calculator` weights (which already copy an operand into a call and a tool result
into the answer) and teaches the multi-turn pattern: each call copies its operands from the question or from an
earlier tool result, and the answer copies the last result. It leaves room for RL the way the single-call warm start
does: a transcript makes all the calls the problem needs only `complete_probability` of the time; otherwise it stops
after fewer (none included) and answers with what it has (the last intermediate result, or a guess), and it often
writes a preamble before the first call. So held-out accuracy starts low, completions vary in their number of turns,
and more calls and earlier calls pay.

Transcripts are encoded by `TranscriptEncoder.encode_calls`, exactly as TRL concatenates a multi-turn tool rollout.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from trl_aspo.builtin.multicall import (
    FAMILIES,
    MultiCallProblem,
    calculator,
    make_problems,
    question,
    random_problem,
    solution_calls,
)
from trl_aspo.builtin.task import PREAMBLES
from warmstart.calculator import Segment, TranscriptEncoder, TranscriptFitConfig, fit_transcripts


@dataclass
class MultiCallWarmStartConfig(TranscriptFitConfig):
    """Data mix and optimization of the multi-call warm start (defaults build the shipped checkpoint)."""

    steps: int = 1300
    learning_rate: float = 2e-3
    num_train_problems: int = 8_000
    copy_steps: int = 400
    preamble_probability: float = 0.6
    # The mix that leaves room for RL: how often a transcript makes every call it needs (otherwise it stops after a
    # uniformly drawn smaller number of calls).
    complete_probability: float = 0.6


def sample_multicall_transcript(
    rng: random.Random,
    encoder: TranscriptEncoder,
    problem: MultiCallProblem,
    config: MultiCallWarmStartConfig,
    curriculum: bool,
) -> list[Segment]:
    """Draw one transcript's decisions (calls made, preamble, tool results, guess) and encode it."""
    _, needed = FAMILIES[problem.family]
    made = needed if curriculum or rng.random() < config.complete_probability else rng.randrange(needed)
    preamble = rng.choice(PREAMBLES) if rng.random() < config.preamble_probability else ""
    random_probability = config.random_result_probability if curriculum else config.late_random_result_probability
    results = None
    if rng.random() < random_probability:
        # Another problem's intermediate results: plausible numbers that only copying can carry into later calls.
        results = [value for _, value in solution_calls(random_problem(rng, problem.family))]
    calls = solution_calls(problem, results)[:made]
    shown = [str(results[i] if results else value) for i, (_, value) in enumerate(calls)]
    if made:
        answer = shown[-1]
    else:
        truth = solution_calls(problem)[-1][1]
        guess = solution_calls(random_problem(rng, problem.family))[-1][1]
        answer = truth if rng.random() < config.direct_correct_probability else guess
    return encoder.encode_calls(
        question(problem),
        preamble,
        [(expression, result) for (expression, _), result in zip(calls, shown, strict=True)],
        answer,
    )


def warm_start_multicall(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    config: MultiCallWarmStartConfig | None = None,
    progress: bool = True,
) -> list[float]:
    """Train `model` in place on multi-call transcripts of training-split problems; return the loss per step."""
    config = config or MultiCallWarmStartConfig()
    rng = random.Random(config.seed)
    problems = make_problems("train", config.num_train_problems, seed=config.seed)
    encoder = TranscriptEncoder(tokenizer, tools=[calculator])

    def draw(curriculum: bool) -> list[Segment]:
        return sample_multicall_transcript(rng, encoder, rng.choice(problems), config, curriculum)

    return fit_transcripts(model, tokenizer, config, draw, progress)
