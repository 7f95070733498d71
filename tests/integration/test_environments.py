"""TRL's `environment_factory` in both trainers (issue 45 item 6): a stateful environment whose method is the tool and
which owns a reward (`get_reward`), trained with the asymmetric loss, tool shaping and spo++ on the built-in
calculator checkpoint; and `tools/*` counting only the calls the environment ran (item 5)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import MODEL, async_fields, calculator_tokenizer, recording_batches, tiny_run_fields

from trl_aspo import ASPOConfig, ASPOTrainer, AsyncASPOConfig, AsyncASPOTrainer
from trl_aspo.builtin import TINY_CALCULATOR, load_builtin
from trl_aspo.builtin.calculator import calculator as evaluate_expression
from trl_aspo.builtin.task import correctness_reward, make_dataset


class CalculatorEnvironment:
    """One rollout's calculator. Its `calculator` method is the tool (the built-in calculator's name, schema and
    docstring, which the checkpoint calls); it owns a reward: 1.0 when a call it ran returned the row's answer."""

    rewards: list[float] = []  # every get_reward of every instance, in call order (the test reads it)

    def reset(self, answer=None, **row) -> None:
        self.answer = answer
        self.results: list[str] = []

    def calculator(self, expression: str) -> str:
        """
        Evaluate an arithmetic expression.

        Args:
            expression: The expression, e.g. 12*34.
        """
        result = evaluate_expression(expression)
        self.results.append(result)
        return result

    def get_reward(self) -> float:
        reward = float(str(self.answer) in self.results)
        CalculatorEnvironment.rewards.append(reward)
        return reward


def _tool_response_runs(completion_mask: torch.Tensor, tool_mask: torch.Tensor) -> torch.Tensor:
    """Per row, the tool responses TRL's loop inserted: maximal runs of real tokens under tool_mask 0. Each follows
    a turn with a call the environment ran (the calculator makes no parallel calls)."""
    response = (completion_mask.bool() & ~tool_mask.bool()).long()
    starts = response[:, 1:] & (1 - response[:, :-1])
    return response[:, 0] + starts.sum(dim=1)


@pytest.fixture(autouse=True)
def _silence_experimental(monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    CalculatorEnvironment.rewards = []


# Both trainers: the asymmetric loss, tool shaping and spo++; the total reward (correctness + the environment's) lies
# in [0, 2].
METHODS = dict(
    loss_type="aspo",
    tool_shaping=True,
    advantage_estimator="spo++",
    num_generations=1,
    value_reward_range=[0.0, 2.0],
    max_tool_calling_iterations=1,
)


@pytest.mark.slow
def test_synchronous_trainer_with_an_environment_that_owns_its_reward(tmp_path):
    model, tokenizer = load_builtin(TINY_CALCULATOR)
    args = ASPOConfig(
        **tiny_run_fields(
            tmp_path, per_device_train_batch_size=8, max_completion_length=48, max_steps=1, num_iterations=2, **METHODS
        )
    )
    trainer = ASPOTrainer(
        model,
        [correctness_reward],
        args,
        train_dataset=make_dataset("train", 16, seed=0),
        processing_class=tokenizer,
        environment_factory=CalculatorEnvironment,
    )
    assert trainer.reward_func_names == ["correctness_reward", "CalculatorEnvironment"]
    before = [p.detach().clone() for p in trainer.model.parameters()]
    batches = recording_batches(trainer)
    trainer.train()

    (row,) = [row for row in trainer.state.log_history if "loss" in row]
    rewards = CalculatorEnvironment.rewards
    assert len(rewards) == 8 and any(rewards), "the environment never rewarded a rollout: the check would be vacuous"
    assert row["rewards/CalculatorEnvironment/mean"] == pytest.approx(sum(rewards) / 8)
    # The environment's reward adds to the reward functions' total.
    assert row["reward"] == pytest.approx(row["rewards/correctness_reward/mean"] + sum(rewards) / 8)
    # tools/* count the calls the environment ran: one per tool response in the trained batch (TRL's own
    # tools/call_frequency also counts calls whose round it rolled back as overlong).
    (batch,) = batches
    executed = _tool_response_runs(batch["completion_mask"], batch["tool_mask"]).double()
    assert executed.sum() > 0
    assert row["tools/calls_per_completion"] == pytest.approx(executed.mean().item())
    assert row["tools/tool_call_frac"] == pytest.approx((executed > 0).double().mean().item())
    assert math.isfinite(row["loss"]) and "shaping/eligible_frac" in row
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))


@pytest.mark.slow
def test_asynchronous_trainer_with_an_environment_that_owns_its_reward(tmp_path):
    from trl_aspo.infra import LocalRolloutWorker, LocalWeightTransfer, install_cpu_fallbacks

    install_cpu_fallbacks()
    tokenizer = calculator_tokenizer()
    dataset = make_dataset("train", 16, seed=0)
    args = AsyncASPOConfig(
        **async_fields(
            tmp_path,
            per_device_train_batch_size=4,
            max_completion_length=48,
            max_steps=2,
            max_staleness=100,
            max_inflight_tasks=1,
            **METHODS,
        )
    )
    worker = LocalRolloutWorker(
        MODEL, tokenizer, dataset, [correctness_reward], args, environment_factory=CalculatorEnvironment
    )
    trainer = AsyncASPOTrainer(
        MODEL,
        reward_funcs=[correctness_reward],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        environment_factory=CalculatorEnvironment,
        rollout_worker=worker,
        weight_transfer=LocalWeightTransfer(worker),
    )
    taken, get = [], trainer.rollout_queue.get

    def recording_get(*get_args, **get_kwargs):
        taken.append(get(*get_args, **get_kwargs))
        return taken[-1]

    trainer.rollout_queue.get = recording_get
    trainer.train()

    assert len(taken) >= 8
    for sample in taken:
        # The worker's total is the correctness reward plus the environment's, each logged under its name.
        metrics = sample.metrics
        expected = metrics["rewards/correctness_reward"] + metrics["rewards/CalculatorEnvironment"]
        assert metrics["reward"] == pytest.approx(expected)
    assert any(sample.metrics["rewards/CalculatorEnvironment"] > 0 for sample in taken)
    # The trainer counts one call per tool response the environment's tool inserted (completion_mask 0 runs after
    # the first completion token), whatever openers the model wrote.
    stats = trainer._tool_statistics([(sample.input_ids, sample.completion_mask) for sample in taken])
    for sample, calls in zip(taken, stats[:, 2].tolist(), strict=True):
        mask = torch.as_tensor(sample.completion_mask).long()
        mask = mask[int(mask.nonzero()[0]) :]
        assert calls == int(((1 - mask[1:]) & mask[:-1]).sum()), sample.input_ids
    assert stats[:, 2].sum() > 0
    logged = [row for row in trainer.state.log_history if "loss" in row]
    assert len(logged) == 2 and all(math.isfinite(row["loss"]) for row in logged)
    assert all("tools/calls_per_completion" in row and "shaping/eligible_frac" in row for row in logged)
