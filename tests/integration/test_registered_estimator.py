"""An advantage estimator written in this file and registered with `register_advantage_estimator` (RLOO's
leave-one-out baseline) trains in both trainers and gives the same advantages on the same samples: a short
`ASPOTrainer` run on the built-in tiny model, then an `AsyncASPOTrainer` run on the very completions it generated
(rewards and groups included, one of them unscored), both checked against a computation written out here."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import MODEL, async_fields, calculator_tokenizer, tiny_run_fields

from trl_aspo.algorithms import register_advantage_estimator
from trl_aspo.algorithms.advantage_estimators import unregister_advantage_estimator
from trl_aspo.infra import NoOpWeightTransfer, ReplayRolloutWorker

GENERATIONS = 4
BATCH = 8  # two groups: one generation round is one optimizer step in both trainers


@pytest.fixture
def rloo():
    """RLOO (Ahmadian et al. 2024, arXiv 2402.14740): A_i = R_i - mean of the other scored members of i's group."""

    @register_advantage_estimator("rloo")
    def leave_one_out(rewards, group_ids, scorable):
        others = (group_ids[:, None] == group_ids[None, :]) & scorable[None, :]
        others.fill_diagonal_(False)
        sums = torch.where(others, rewards[None, :], torch.zeros_like(rewards)[None, :]).sum(dim=1)
        counts = others.sum(dim=1)
        return torch.where(counts > 0, rewards - sums / counts.clamp_min(1), torch.zeros_like(rewards))

    yield leave_one_out
    unregister_advantage_estimator("rloo")


def digits_unless_second(completions, **kwargs):
    """The share of digits in each completion, except that the second completion of every call is left unscored
    (None): each round holds one unscored sample, in its first group."""
    texts = [completion[-1]["content"] if isinstance(completion, list) else completion for completion in completions]
    return [
        None if index == 1 else sum(ch.isdigit() for ch in text) / max(len(text), 1)
        for index, text in enumerate(texts)
    ]


def by_hand(rewards: list[float]) -> list[float]:
    """RLOO then SPO's batch normalization (unbiased std, eps 1e-8) over the scorable samples of one round of groups
    of GENERATIONS; the unscored ones 0."""
    centered = []
    for start in range(0, len(rewards), GENERATIONS):
        group = rewards[start : start + GENERATIONS]
        for i, reward in enumerate(group):
            others = [r for j, r in enumerate(group) if j != i and not math.isnan(r)]
            centered.append(math.nan if math.isnan(reward) else reward - sum(others) / len(others))
    scored = [value for value in centered if not math.isnan(value)]
    mean = sum(scored) / len(scored)
    std = math.sqrt(sum((value - mean) ** 2 for value in scored) / (len(scored) - 1))
    return [0.0 if math.isnan(value) else (value - mean) / (std + 1e-8) for value in centered]


def synchronous_rounds(tmp_path):
    """Two rounds of `ASPOTrainer` with advantage_estimator='rloo': per round its prompts, prompt and completion
    tokens, total rewards and final advantages."""
    from trl_aspo import ASPOConfig, ASPOTrainer
    from trl_aspo.builtin import TINY_CALCULATOR
    from trl_aspo.builtin.task import make_dataset

    fields = tiny_run_fields(
        tmp_path / "sync", per_device_train_batch_size=BATCH, num_generations=GENERATIONS, max_completion_length=12
    )
    args = ASPOConfig(**fields, advantage_estimator="rloo")
    assert args.advantage_normalization == "batch"  # the registration's default
    trainer = ASPOTrainer(TINY_CALCULATOR, digits_unless_second, args, train_dataset=make_dataset("train", 16, seed=0))
    rounds, generate = [], trainer._generate_and_score_completions

    def recording(inputs):
        output = generate(inputs)
        keep = output["completion_mask"].bool()
        rounds.append(
            {
                "prompts": [row["prompt"] for row in inputs],
                "prompt_ids": [
                    ids[mask.bool()].tolist()
                    for ids, mask in zip(output["prompt_ids"], output["prompt_mask"], strict=True)
                ],
                "completion_ids": [ids[row].tolist() for ids, row in zip(output["completion_ids"], keep, strict=True)],
                "rewards": trainer._gathered_rewards_per_func[:, 0].tolist(),
                "advantages": output["advantages"].tolist(),
            }
        )
        return output

    trainer._generate_and_score_completions = recording
    trainer.train()
    return rounds


def rollout_samples(rounds) -> list:
    """The synchronous rounds' completions as the asynchronous trainer's `RolloutSample`s, in the same order and
    groups; the worker's own advantage field holds a value no estimator would give (it must not be read)."""
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    samples = []
    for index, round_ in enumerate(rounds):
        for row, (prompt, prompt_ids, completion_ids, reward) in enumerate(
            zip(round_["prompts"], round_["prompt_ids"], round_["completion_ids"], round_["rewards"], strict=True)
        ):
            samples.append(
                RolloutSample(
                    prompt=prompt,
                    completion=[{"role": "assistant", "content": ""}],
                    input_ids=np.asarray(prompt_ids + completion_ids, dtype=np.int64),
                    completion_mask=np.asarray([0] * len(prompt_ids) + [1] * len(completion_ids), dtype=np.int64),
                    old_log_probs=np.asarray([0.0] * len(prompt_ids) + [-1.0] * len(completion_ids), dtype=np.float32),
                    advantage=123.0,
                    model_version=0,
                    group_id=index * (BATCH // GENERATIONS) + row // GENERATIONS,
                    metrics={"reward": reward, "reward_std": 0.0},
                )
            )
    return samples


def asynchronous_advantages(tmp_path, samples) -> list[list[float]]:
    """The advantages `AsyncASPOTrainer` with advantage_estimator='rloo' gives `samples`, per optimizer step (two
    trained; the data loader reads one step ahead, so the last round's samples are queued twice, the second time
    as other groups, for it to read)."""
    from dataclasses import replace

    extra = [replace(sample, group_id=sample.group_id + 100) for sample in samples[-BATCH:]]
    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer
    from trl_aspo.builtin.task import correctness_reward, make_dataset
    from trl_aspo.infra import install_cpu_fallbacks

    install_cpu_fallbacks()
    args = AsyncASPOConfig(
        **async_fields(
            tmp_path, per_device_train_batch_size=BATCH, num_generations=GENERATIONS, max_steps=2, max_staleness=10
        ),
        advantage_estimator="rloo",
    )
    trainer = AsyncASPOTrainer(
        MODEL,
        reward_funcs=correctness_reward,
        args=args,
        train_dataset=make_dataset("train", 16, seed=0),
        processing_class=calculator_tokenizer(),
        rollout_worker=ReplayRolloutWorker(samples + extra),
        weight_transfer=NoOpWeightTransfer(),
    )
    steps, score_step = [], trainer._score_step

    def recording(step_samples, context=()):
        advantages = score_step(step_samples, context)
        steps.append(advantages.tolist())
        return advantages

    trainer._score_step = recording
    trainer.train()
    assert all(math.isfinite(row["loss"]) for row in trainer.state.log_history if "loss" in row)
    return steps


@pytest.mark.slow
def test_a_registered_estimator_gives_the_same_advantages_in_both_trainers(tmp_path, rloo):
    rounds = synchronous_rounds(tmp_path)
    assert len(rounds) == 2
    for round_ in rounds:
        assert math.isnan(round_["rewards"][1]) and round_["advantages"][1] == 0.0  # the unscored sample
        assert round_["advantages"] == pytest.approx(by_hand(round_["rewards"]), abs=1e-5)
        assert any(abs(value) > 0.1 for value in round_["advantages"])  # a signal, not all zeros
    steps = asynchronous_advantages(tmp_path, rollout_samples(rounds))
    for round_, step in zip(rounds, steps[:2], strict=True):
        assert step == pytest.approx(round_["advantages"], abs=1e-5)


def test_an_estimator_output_beyond_float32_is_refused_by_the_asynchronous_trainer(tmp_path):
    """Issue 45 item 7: 1e39 is finite in the float64 the asynchronous trainer scores in, so it trained there (its
    batch normalization made it ordinary) while the synchronous trainer refused it; both refuse it now, naming the
    estimator."""
    from helpers import fake_rollout_sample
    from transformers import AutoModelForCausalLM

    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer
    from trl_aspo.builtin.task import correctness_reward, make_dataset
    from trl_aspo.infra import install_cpu_fallbacks

    @register_advantage_estimator("beyond_float32")
    def beyond_float32(rewards, group_ids, scorable):
        return torch.full_like(rewards, 1e39)

    try:
        install_cpu_fallbacks()
        tokenizer = calculator_tokenizer()
        dataset = make_dataset("train", 4, seed=0)
        policy = AutoModelForCausalLM.from_pretrained(MODEL)
        generator = torch.Generator().manual_seed(0)
        samples = [
            fake_rollout_sample(
                policy, tokenizer, dataset[index // 2]["prompt"], 4, generator, model_version=0, group_id=index // 2
            )
            for index in range(8)
        ]
        args = AsyncASPOConfig(
            **async_fields(tmp_path, per_device_train_batch_size=4, num_generations=2, max_steps=1),
            advantage_estimator="beyond_float32",
        )
        trainer = AsyncASPOTrainer(
            MODEL,
            reward_funcs=correctness_reward,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            rollout_worker=ReplayRolloutWorker(samples),
            weight_transfer=NoOpWeightTransfer(),
        )
        with pytest.raises(
            ValueError,
            match=r"advantage estimator 'beyond_float32' returned advantages that are not finite in float32.*"
            r"registered from test_registered_estimator\.",
        ):
            trainer.train()
    finally:
        unregister_advantage_estimator("beyond_float32")
