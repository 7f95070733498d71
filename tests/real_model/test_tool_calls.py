"""Tool calls on the real tokenizer, without training: the model's turns are scripted (a call written after '.', ' ',
'\\n', ':' and at position 0, then the answer), and TRL's tool loop parses and runs each call. trl-aspo must locate
the call where it was written (the synchronous trainer's `ToolCallCounter` on TRL's batch, the asynchronous
trainer's on its local worker's samples, `trl-aspo evaluate`'s records), and TRL's `tool_mask` must be 0 on exactly
the ids TRL inserted after the call and 1 on every scripted (generated) id."""

from __future__ import annotations

import contextlib
import queue
import re
import time

import pytest
import torch
from real_model_common import run_fields

from trl_aspo.builtin import SMOLLM2
from trl_aspo.builtin.task import calculator, make_chat_dataset, solve
from trl_aspo.infra import resolve_model_path

# What the model writes before its call, one per problem; the call's position is the number of ids of this text.
PREFIXES = ["Let me compute.", "Let me compute ", "Let me compute\n", "Compute:", ""]
QUESTION = re.compile(r"What is (\d+) ([*+-]) (\d+)\?")


def problem_of(text: str) -> tuple[int, str, int]:
    a, op, b = QUESTION.findall(text)[-1]
    return int(a), op, int(b)


class ScriptedTurns:
    """The turns of a model that calls the calculator once, after its problem's prefix, then answers."""

    def __init__(self, tokenizer, dataset):
        self.tokenizer = tokenizer
        self.prefix = {problem_of(row["prompt"][-1]["content"]): p for row, p in zip(dataset, PREFIXES, strict=True)}
        self.response_id = tokenizer.convert_tokens_to_ids("<tool_response>")

    def prefix_ids(self, problem) -> list[int]:
        return self.tokenizer(self.prefix[problem], add_special_tokens=False).input_ids if self.prefix[problem] else []

    def first_turn(self, problem) -> list[int]:
        a, op, b = problem
        call = f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{a}{op}{b}"}}}}\n</tool_call>'
        return self.prefix_ids(problem) + self.tokenizer(call + "<|im_end|>", add_special_tokens=False).input_ids

    def second_turn(self, problem) -> list[int]:
        return self.tokenizer(f"The answer is {solve(*problem)}.<|im_end|>", add_special_tokens=False).input_ids

    def inserted(self, problem) -> list[int]:
        """The ids TRL inserts after the call (DESIGN.md: concatenated, not re-tokenized with the turn)."""
        text = f"\n<|im_start|>user\n<tool_response>\n{solve(*problem)}\n</tool_response><|im_end|>\n"
        return self.tokenizer(text + "<|im_start|>assistant\n", add_special_tokens=False).input_ids

    def turn(self, context_ids: list[int]) -> list[int]:
        problem = problem_of(self.tokenizer.decode(context_ids))
        return self.second_turn(problem) if self.response_id in context_ids else self.first_turn(problem)

    def generate(self, input_ids, attention_mask=None, **kwargs):
        """`model.generate` for a left-padded batch: prompt + turn + padding."""
        turns = [
            self.turn([i for i, m in zip(row, mask, strict=False) if m])
            for row, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=False)
        ]
        width = max(len(turn) for turn in turns)
        tail = torch.full((len(turns), width), self.tokenizer.pad_token_id, dtype=input_ids.dtype)
        for row, turn in enumerate(turns):
            tail[row, : len(turn)] = torch.tensor(turn)
        return torch.cat([input_ids, tail.to(input_ids.device)], dim=1)


def zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


@pytest.fixture(scope="module")
def dataset():
    return make_chat_dataset("train", len(PREFIXES))


def expected_completion(script, problem) -> tuple[list[int], list[int]]:
    first, inserted, second = script.first_turn(problem), script.inserted(problem), script.second_turn(problem)
    return first + inserted + second, [1] * len(first) + [0] * len(inserted) + [1] * len(second)


def test_sync_trainer_locates_each_call_where_trl_parsed_it(tmp_path, dataset):
    from trl_aspo import ASPOConfig, ASPOTrainer

    args = ASPOConfig(**run_fields(tmp_path, per_device_train_batch_size=len(PREFIXES), max_completion_length=96))
    trainer = ASPOTrainer(
        SMOLLM2,
        reward_funcs=[zero_reward],
        args=args,
        train_dataset=dataset,
        tools=[calculator],
    )
    script = ScriptedTurns(trainer.processing_class, dataset)
    trainer.model.generate = script.generate
    batch = trainer._generate_and_score_completions([dict(row) for row in dataset])
    stats = trainer._tool_calls(batch["completion_ids"], batch["completion_mask"], batch["tool_mask"])
    for row, data in enumerate(dataset):
        problem = problem_of(data["prompt"][-1]["content"])
        ids, mask = expected_completion(script, problem)
        real = batch["completion_mask"][row].bool()
        assert batch["completion_ids"][row][real].tolist() == ids  # TRL ran the tool: its result follows the call
        assert batch["tool_mask"][row][real].tolist() == mask
        assert stats[row].tolist() == [
            len(script.prefix_ids(problem)),
            mask.count(1),
            1,
            int(bool(PREFIXES[row].strip())),
        ]
    assert [len(script.prefix_ids(problem_of(r["prompt"][-1]["content"]))) for r in dataset] == [4, 4, 4, 2, 0]


@pytest.fixture(scope="module")
def async_samples(dataset, tmp_path_factory):
    """{problem: (its local worker's sample, the asynchronous trainer's `ToolCallCounter` row of it)}."""
    from transformers import AutoTokenizer

    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer
    from trl_aspo.infra import LocalRolloutWorker, LocalWeightTransfer, install_cpu_fallbacks, local_worker

    path = resolve_model_path(SMOLLM2)
    tokenizer = AutoTokenizer.from_pretrained(path)
    script = ScriptedTurns(tokenizer, dataset)

    def scripted_sample(model, prompt_ids, **kwargs):
        turn = script.turn(list(prompt_ids))
        return turn, [0.0] * len(turn)

    install_cpu_fallbacks()
    fields = run_fields(tmp_path_factory.mktemp("async"), token_budget=0, max_staleness=2, max_completion_length=96)
    args = AsyncASPOConfig(**{**fields, "per_device_train_batch_size": len(PREFIXES)}, max_inflight_tasks=5)
    worker = LocalRolloutWorker(path, tokenizer, dataset, [zero_reward], args, tools=[calculator])
    trainer = AsyncASPOTrainer(
        path,
        reward_funcs=[zero_reward],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        tools=[calculator],
        rollout_worker=worker,
        weight_transfer=LocalWeightTransfer(worker),
    )
    samples, deadline = [], time.monotonic() + 120
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(local_worker, "sample_completion", scripted_sample)
        worker.start()
        try:
            while len(samples) < len(PREFIXES) and time.monotonic() < deadline:
                with contextlib.suppress(queue.Empty):
                    samples.append(worker.rollout_buffer.get(timeout=1))
        finally:
            worker.stop()
    assert len(samples) == len(PREFIXES)
    stats = trainer._tool_statistics([(sample.input_ids, sample.completion_mask) for sample in samples])
    return script, {problem_of(tokenizer.decode(s.input_ids)): (s, row) for s, row in zip(samples, stats, strict=True)}


# TRL's asynchronous worker renders the whole conversation through the template again every turn: Qwen2.5's writes
# an assistant turn as content + "\n<tool_call>\n...", so a call the model wrote right after '.', ' ' or ':' comes
# back as different ids, and its reconciler keeps the call as context (completion_mask 0, not trained): no call is
# among the trained tokens, where TRL parsed and ran one. After '\n' or at position 0 the ids are unchanged.
RERENDERED = pytest.mark.xfail(
    strict=True, reason="TRL's async worker re-renders text+<tool_call> and masks the call as context"
)


@pytest.mark.parametrize(
    "index",
    [pytest.param(0, marks=RERENDERED), pytest.param(1, marks=RERENDERED), 2, pytest.param(3, marks=RERENDERED), 4],
)
def test_async_trainer_locates_the_call_in_its_local_workers_sample(async_samples, dataset, index):
    script, by_problem = async_samples
    problem = problem_of(dataset[index]["prompt"][-1]["content"])
    sample, row = by_problem[problem]
    start = list(sample.completion_mask).index(1)
    ids, mask = expected_completion(script, problem)
    assert [int(m) for m in sample.completion_mask[start:]] == mask
    assert [int(i) for i in sample.input_ids[start:]] == ids
    assert row.tolist() == [len(script.prefix_ids(problem)), mask.count(1), 1, int(bool(PREFIXES[index].strip()))]


def test_evaluate_locates_each_call_where_it_parsed_it(dataset):
    from trl_aspo.builtin import load_builtin
    from trl_aspo.builtin.task import correctness_reward
    from trl_aspo.evaluation.tool_use import evaluate_tool_use

    model, tokenizer = load_builtin(SMOLLM2)
    script = ScriptedTurns(tokenizer, dataset)
    model.generate = script.generate
    result = evaluate_tool_use(
        model,
        tokenizer,
        dataset,
        correctness_reward,
        [calculator],
        temperature=0,
        max_completion_length=96,
        progress=False,
    )
    for record, row in zip(result["records"], dataset, strict=True):
        problem = problem_of(row["prompt"][-1]["content"])
        assert (record["first_call_position"], record["num_calls"], record["correct"]) == (
            len(script.prefix_ids(problem)),
            1,
            True,
        )
    assert result["accuracy"] == 1.0 and result["tool_call_rate"] == 1.0
