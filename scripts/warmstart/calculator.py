"""Supervised warm start of the built-in tiny calculator model on synthetic tool-use transcripts.

The warm start must make RL *possible* without making it unnecessary. After it, the model

- writes well-formed calculator calls whose operands are copied from the question, and copies the tool's result into
  "The answer is N." (the two skills a model this small cannot discover by RL alone: copying needs an induction-like
  attention pattern, which is why every number is a single token and why training starts with a copy curriculum);
- calls the calculator only part of the time, often after some text ("Let me compute."), and otherwise answers
  directly with a guess that is mostly wrong.

So held-out accuracy starts low, and RL has a clear signal: calling (early) pays.

Transcripts are tokenized segment by segment exactly as TRL assembles a rollout: the prompt rendered with the tools
and the generation prompt, the assistant turn, the tool-response suffix concatenated as ids
(`trl_aspo.evaluation.tool_use.tool_suffix_ids`), the final turn. The loss covers the assistant turns only.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from trl_aspo.builtin.task import (
    ANSWER_TEMPLATE,
    OPERATIONS,
    PREAMBLES,
    QUESTION_TEMPLATE,
    Problem,
    calculator,
    make_problems,
    solve,
)
from trl_aspo.builtin.tokenizer import MAX_NUMBER
from trl_aspo.evaluation.tool_use import tool_suffix_ids

IGNORE_INDEX = -100


@dataclass
class TranscriptFitConfig:
    """Optimization and the data-mix knobs shared by the built-in warm starts (`fit_transcripts` reads the first
    group; the transcript samplers the rest)."""

    seed: int = 0
    steps: int = 1200
    batch_size: int = 32
    learning_rate: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    num_train_problems: int = 9_000
    number_loss_weight: float = 2.0
    # The first `copy_steps` make every call and get random tool results: only copying can predict what follows, so
    # the copy circuit forms (over every number token) before the model has to decide anything.
    copy_steps: int = 500
    random_result_probability: float = 1.0
    # After the curriculum, a share of random results keeps copying (rather than estimating) the rule.
    late_random_result_probability: float = 0.3
    # How often text comes before the first call.
    preamble_probability: float = 0.7
    # Answers without a call are guesses: right this often, otherwise another problem's answer.
    direct_correct_probability: float = 0.1

    def __post_init__(self):
        for name, value in vars(self).items():
            if name.endswith("_probability") and not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be a probability in [0, 1], got {value}")


@dataclass
class WarmStartConfig(TranscriptFitConfig):
    """Data mix and optimization of the single-call warm start (defaults build the shipped checkpoint)."""

    # The mix that leaves room for RL: how often a transcript calls at all.
    call_probability: float = 0.4


@dataclass
class Segment:
    """A piece of a transcript: its token ids and whether the model is trained to produce them."""

    ids: list[int]
    trainable: bool


class TranscriptEncoder:
    """Turns (problem, decisions) into token segments the way TRL's tool loop concatenates a rollout."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, tools: list[Callable] | None = None):
        self.tokenizer = tokenizer
        self.tools = tools or [calculator]
        self._suffix_cache: dict[str, list[int]] = {}

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _turn_text(self, history: list[dict[str, Any]], message: dict[str, Any]) -> str:
        # What the model generates after the generation prompt: the rendered message up to and including <|im_end|>.
        before = self._render(history, add_generation_prompt=True)
        after = self._render([*history, message], add_generation_prompt=False)
        if not after.startswith(before[: -len("\n")]):
            raise ValueError("Chat template is not prefix-preserving.")
        text = after[len(before) :]
        return text[: text.rindex(self.tokenizer.eos_token) + len(self.tokenizer.eos_token)]

    def suffix(self, result: str) -> list[int]:
        if result not in self._suffix_cache:
            name = self.tools[0].__name__
            self._suffix_cache[result] = tool_suffix_ids(
                self.tokenizer, [{"role": "tool", "name": name, "content": result}]
            )
        return self._suffix_cache[result]

    def encode_calls(
        self, question: str, preamble: str, calls: list[tuple[str, str]], answer: int | str
    ) -> list[Segment]:
        """Segments of a rollout making `calls` in turn (one per assistant turn), then answering `answer`.

        `calls` are (expression, tool result) pairs; `preamble` is text before the first call (or before the answer
        when there is no call). The segments are: the prompt; per call, the assistant turn (trainable) and the
        tool-response suffix TRL appends by ids; the final turn (trainable), which follows the
        "<|im_start|>assistant\n" the last suffix already holds.
        """
        user = {"role": "user", "content": question}
        segments = [Segment(self._encode(self._render([user], add_generation_prompt=True)), trainable=False)]
        final_text = ANSWER_TEMPLATE.format(answer=answer)
        if not calls:
            turn = {"role": "assistant", "content": " ".join(filter(None, [preamble, final_text]))}
            return [*segments, Segment(self._encode(self._turn_text([user], turn)), trainable=True)]
        name = self.tools[0].__name__
        for index, (expression, result) in enumerate(calls):
            tool_call = {"type": "function", "function": {"name": name, "arguments": {"expression": expression}}}
            # The Qwen2.5 template renders an assistant turn independently of the turns before it.
            turn = {"role": "assistant", "content": preamble if index == 0 else "", "tool_calls": [tool_call]}
            segments.append(Segment(self._encode(self._turn_text([user], turn)), trainable=True))
            segments.append(Segment(self.suffix(result), trainable=False))
        return [*segments, Segment(self._encode(final_text + self.tokenizer.eos_token), trainable=True)]

    def encode(
        self, problem: Problem, call: bool, preamble: str, direct_answer: int, tool_result: int
    ) -> list[Segment]:
        """Segments of a `builtin:calculator` rollout: one call `a op b` answered `tool_result`, or a direct answer."""
        a, op, b = problem
        question = QUESTION_TEMPLATE.format(a=a, op=op, b=b)
        if not call:
            return self.encode_calls(question, preamble, [], direct_answer)
        return self.encode_calls(question, preamble, [(f"{a}{op}{b}", str(tool_result))], tool_result)


def _random_problem(rng: random.Random, op: str) -> Problem:
    left, right = OPERATIONS[op]
    a, b = rng.choice(left), rng.choice(right)
    return (a, op, b) if op != "-" or a >= b else (b, op, a)


def sample_transcript(
    rng: random.Random,
    encoder: TranscriptEncoder,
    problem: Problem,
    config: WarmStartConfig,
    curriculum: bool,
) -> list[Segment]:
    """Draw one transcript's decisions (call or not, preamble, guess, tool result) and encode it."""
    truth = solve(*problem)
    op = problem[1]
    call = curriculum or rng.random() < config.call_probability
    preamble = rng.choice(PREAMBLES) if rng.random() < config.preamble_probability else ""
    # A wrong guess is the answer to another problem of the same kind: plausible, but carrying no arithmetic the
    # model could half-learn (near-miss guesses taught it to estimate, which then competed with copying the tool).
    guess = truth if rng.random() < config.direct_correct_probability else solve(*_random_problem(rng, op))
    random_probability = config.random_result_probability if curriculum else config.late_random_result_probability
    # A random result is the answer of a random problem (any split): it trains copying on exactly the numbers answers
    # can be, each seen often, without showing any held-out problem.
    result = solve(*_random_problem(rng, rng.choice(list(OPERATIONS)))) if rng.random() < random_probability else truth
    return encoder.encode(problem, call, preamble, guess, result)


def collate(transcripts: list[list[Segment]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad transcripts into `input_ids`, `attention_mask` and `labels` (IGNORE_INDEX off assistant turns)."""
    rows = [[t for s in segments for t in s.ids] for segments in transcripts]
    masks = [[s.trainable for s in segments for _ in s.ids] for segments in transcripts]
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for i, (row, mask) in enumerate(zip(rows, masks, strict=True)):
        input_ids[i, : len(row)] = torch.tensor(row)
        attention_mask[i, : len(row)] = 1
        labels[i, : len(row)] = torch.where(torch.tensor(mask), torch.tensor(row), IGNORE_INDEX)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _loss(
    model: Qwen2ForCausalLM, batch: dict[str, torch.Tensor], number_ids: torch.Tensor, number_weight: float
) -> tuple[torch.Tensor, float]:
    """Cross-entropy on assistant tokens, and the argmax accuracy on number targets (how well copying works)."""
    # Project only the supervised positions onto the vocabulary: the 10k-token head dominates the cost, and most
    # positions are prompt or tool output.
    hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    targets = batch["labels"][:, 1:]
    selected = targets != IGNORE_INDEX
    logits = model.lm_head(hidden[:, :-1][selected])
    targets = targets[selected]
    is_number = torch.isin(targets, number_ids)
    number_accuracy = (logits[is_number].argmax(-1) == targets[is_number]).float().mean().item()
    # Numbers are a few targets among many easy boilerplate tokens; weighting them speeds up forming the copy circuit.
    weights = 1.0 + (number_weight - 1.0) * is_number.float()
    losses = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
    return (losses * weights).sum() / weights.sum(), number_accuracy


def _number_ids(tokenizer: PreTrainedTokenizerFast) -> torch.Tensor:
    return torch.tensor(tokenizer.convert_tokens_to_ids([str(n) for n in range(MAX_NUMBER + 1)]))


def init_number_embeddings(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, seed: int) -> None:
    """Give every number token a shared component on top of its random embedding.

    Attention must find numbers to copy them, including numbers rarely or never seen in training (a held-out
    problem's result). A shared "is a number" direction from the start lets the learned query match any number's key,
    while the random part keeps each number's identity for the copy itself.
    """
    number_ids = _number_ids(tokenizer)
    generator = torch.Generator().manual_seed(seed)
    embeddings = model.get_input_embeddings().weight
    shared = torch.randn(embeddings.shape[1], generator=generator) * model.config.initializer_range
    with torch.no_grad():
        embeddings[number_ids] += shared


def fit_transcripts(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    config: TranscriptFitConfig,
    draw: Callable[[bool], list[Segment]],
    progress: bool = True,
) -> list[float]:
    """Train `model` in place on transcripts `draw(curriculum)` returns; return the loss per step.

    Of `config` it reads the optimization fields (steps, batch_size, learning_rate, warmup_steps, weight_decay,
    max_grad_norm, number_loss_weight, copy_steps, seed): AdamW, linear warmup then cosine decay, the
    first `copy_steps` steps drawn with `curriculum=True`.
    """
    torch.manual_seed(config.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)

    def schedule(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress_ = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * progress_))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    number_ids = _number_ids(tokenizer)
    model.train()
    losses = []
    bar = tqdm(range(config.steps), desc="warm start", disable=not progress)
    for step in bar:
        curriculum = step < config.copy_steps
        batch = collate([draw(curriculum) for _ in range(config.batch_size)], tokenizer.pad_token_id)
        loss, number_accuracy = _loss(model, batch, number_ids, config.number_loss_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        bar.set_postfix(
            loss=f"{loss.item():.3f}", numbers=f"{number_accuracy:.2f}", phase="copy" if curriculum else "mix"
        )
    model.eval()
    return losses


def warm_start(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    config: WarmStartConfig | None = None,
    progress: bool = True,
) -> list[float]:
    """Train `model` in place on synthetic transcripts of training-split problems; return the loss per step."""
    config = config or WarmStartConfig()
    rng = random.Random(config.seed)
    problems = make_problems("train", config.num_train_problems, seed=config.seed)
    encoder = TranscriptEncoder(tokenizer)

    def draw(curriculum: bool) -> list[Segment]:
        return sample_transcript(rng, encoder, rng.choice(problems), config, curriculum)

    return fit_transcripts(model, tokenizer, config, draw, progress)
