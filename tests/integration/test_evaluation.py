"""The TRL-mirroring tool-use evaluation, generating with the built-in tiny models."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import TOOL_USE_METRICS

from trl_aspo.builtin import TINY_CALCULATOR, TINY_RANDOM, load_builtin
from trl_aspo.builtin.calculator import calculator
from trl_aspo.builtin.model import CHECKPOINT_DIR
from trl_aspo.builtin.task import correctness_reward, make_dataset
from trl_aspo.evaluation.tool_use import evaluate_tool_use

SUMMARY_KEYS = TOOL_USE_METRICS | {"records"}
needs_checkpoint = pytest.mark.skipif(
    not (CHECKPOINT_DIR / "model.safetensors").is_file(), reason="tiny-calculator checkpoint not built"
)


def test_evaluate_random_model_respects_budget():
    model, tokenizer = load_builtin(TINY_RANDOM)
    dataset = make_dataset("test", 4, seed=0)
    result = evaluate_tool_use(
        model, tokenizer, dataset, correctness_reward, [calculator], num_samples=2, max_completion_length=16
    )
    assert set(result) == SUMMARY_KEYS
    assert result["num_problems"] == 4 and len(result["records"]) == 8
    assert all(r["action_tokens"] <= 16 for r in result["records"])
    assert 0.0 <= result["accuracy"] <= result["pass_at_k"] <= 1.0
    assert model.training is False or model.training is True  # mode restored, whatever it was


def test_evaluate_is_seeded_and_keeps_global_rng():
    model, tokenizer = load_builtin(TINY_RANDOM)
    dataset = make_dataset("test", 2, seed=0)
    torch.manual_seed(5)
    expected = torch.rand(2)
    torch.manual_seed(5)
    first = evaluate_tool_use(model, tokenizer, dataset, correctness_reward, [calculator], max_completion_length=8)
    assert torch.equal(torch.rand(2), expected)
    second = evaluate_tool_use(model, tokenizer, dataset, correctness_reward, [calculator], max_completion_length=8)
    assert [r["text"] for r in first["records"]] == [r["text"] for r in second["records"]]


@needs_checkpoint
def test_tiny_calculator_calls_the_tool():
    model, tokenizer = load_builtin(TINY_CALCULATOR)
    dataset = make_dataset("test", 20, seed=1)
    result = evaluate_tool_use(
        model, tokenizer, dataset, correctness_reward, [calculator], num_samples=2, max_completion_length=64
    )
    assert set(result) == SUMMARY_KEYS
    assert result["tool_call_rate"] >= 0.3
    for key in ("accuracy", "pass_at_k", "tool_call_rate", "accuracy_with_call"):
        assert 0.0 <= result[key] <= 1.0, key
    assert 0.0 <= result["mean_first_call_position"] < 64
    assert result["calls_per_completion"] >= result["tool_call_rate"]
    assert result["interactive_turns_per_completion"] <= result["calls_per_completion"]
    called = [r for r in result["records"] if r["num_calls"]]
    # A call was executed: its tool message holds the calculator's result and the rollout continued after it.
    executed = [r for r in called if any(m["role"] == "tool" for m in r["completion"])]
    assert executed
    for record in executed:
        tool_message = next(m for m in record["completion"] if m["role"] == "tool")
        call = record["completion"][0]["tool_calls"][0]["function"]
        assert tool_message["content"] == calculator(**call["arguments"])
        assert "<tool_response>" in record["text"]
    # Calling pays (the signal RL needs): copying the tool result works often, guessing almost never.
    assert not math.isnan(result["accuracy_without_call"])
    assert result["accuracy_with_call"] >= 0.2
    assert result["accuracy_with_call"] > result["accuracy_without_call"]


def raising_calculator():
    """The calculator's name, schema and docstring (what the checkpoint calls), raising on every call."""

    def calculator(expression: str) -> str:
        """
        Evaluate an arithmetic expression.

        Args:
            expression: The expression, e.g. 12*34.
        """
        raise RuntimeError("the calculator is broken")

    return calculator


@needs_checkpoint
def test_evaluation_counts_only_calls_whose_tool_ran():
    """Issue 45 item 5, in `evaluate`: a call the loop does not run (no tool rounds allowed) is not counted, though the
    model wrote it; a call whose tool raised is (its error is the tool response)."""
    model, tokenizer = load_builtin(TINY_CALCULATOR)
    dataset = make_dataset("test", 6, seed=1)
    kwargs = dict(num_samples=2, max_completion_length=48, progress=False)  # sampled at temperature 1, seed 0
    unrun = evaluate_tool_use(model, tokenizer, dataset, correctness_reward, [calculator], max_tool_calls=0, **kwargs)
    written = [record for record in unrun["records"] if "<tool_call>" in record["text"]]
    assert written, "the model wrote no call: the check would be vacuous"
    assert unrun["tool_call_rate"] == 0.0 and unrun["calls_per_completion"] == 0.0
    assert all(r["first_call_position"] is None for r in unrun["records"])

    raising = evaluate_tool_use(model, tokenizer, dataset, correctness_reward, [raising_calculator()], **kwargs)
    for record in raising["records"]:
        responses = [m for m in record["completion"] if m["role"] == "tool"]
        assert all("the calculator is broken" in m["content"] for m in responses)
        assert record["num_calls"] == len(responses)  # one call per turn here, so one per tool response
    assert raising["calls_per_completion"] > 0


def test_evaluation_refuses_a_budget_or_prompt_beyond_the_context():
    """Issue 45 item 7: the evaluation's generation has the trainers' bound, checked before anything is generated."""
    model, tokenizer = load_builtin(TINY_RANDOM)
    dataset = make_dataset("test", 2, seed=0)
    context = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=rf"max_completion_length={context} must be smaller than the model's context"):
        evaluate_tool_use(model, tokenizer, dataset, correctness_reward, [calculator], max_completion_length=context)
    with pytest.raises(
        ValueError, match=rf"^Row 0's prompt has \d+ tokens: with max_completion_length={context - 4} "
    ):
        evaluate_tool_use(
            model, tokenizer, dataset, correctness_reward, [calculator], max_completion_length=context - 4
        )


def test_a_tokenizer_without_a_response_template_is_given_trls_and_parses_the_same_calls():
    """A tokenizer that `AutoTokenizer` loads from a saved folder (a real model's, e.g. SmolLM2's) has no response
    template: `trl-aspo train` with `trainer: async` crashed in TRL's `parse_response` evaluating such a model before
    training. The evaluation adds TRL's template, as TRL's trainers and rollout worker do when given tools."""
    import copy

    model, tokenizer = load_builtin(TINY_CALCULATOR)
    bare = copy.deepcopy(tokenizer)
    bare.response_template = None
    bare.response_schema = None
    dataset = make_dataset("test", 6, seed=1)
    settings = dict(num_samples=2, max_completion_length=64, seed=0)
    parsed = evaluate_tool_use(model, bare, dataset, correctness_reward, [calculator], **settings)
    reference = evaluate_tool_use(model, tokenizer, dataset, correctness_reward, [calculator], **settings)
    assert parsed["tool_call_rate"] > 0
    assert parsed.pop("records") == reference.pop("records")
    assert parsed == reference
