"""Issue 45 item 4 in `AsyncASPOTrainer`: generator log-probs are checked where the trainer reads the rollout queue,
for TRL's worker class and any other, in both correction modes. Each bad case (NaN, -inf, -1e30, a positive log-prob,
a list shorter and one longer than `input_ids`) sits in its own group of a scripted stream; every such group is dropped
whole, counted in `offpolicy/dropped_groups`, warned once and marked consumed, and training stays finite."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
from helpers import MODEL, async_fields, calculator_tokenizer, fake_rollout_sample

from trl_aspo.builtin.task import correctness_reward, make_dataset
from trl_aspo.infra import NoOpWeightTransfer, ReplayRolloutWorker, install_cpu_fallbacks


def _corrupt(sample, case: str):
    """`sample` with one generator log-prob broken as `case` says, on its second completion token."""
    log_probs = np.asarray(sample.old_log_probs, dtype=np.float32).copy()
    position = int(np.flatnonzero(sample.completion_mask)[1])
    if case == "shorter":
        log_probs = log_probs[:-2]
    elif case == "longer":
        log_probs = np.concatenate([log_probs, np.zeros(2, dtype=np.float32)])
    else:
        log_probs[position] = {"nan": math.nan, "-inf": -math.inf, "-1e30": -1e30, "positive": 0.5}[case]
    sample.old_log_probs = log_probs
    return sample


CASES = ["nan", "-inf", "-1e30", "positive", "shorter", "longer"]


def _stream(tokenizer):
    """Groups 0-5 of two samples each, one sample per group broken by a case; then four good groups (two steps of
    four samples: the trained step and the one the data loader reads ahead)."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(MODEL)
    generator = torch.Generator().manual_seed(0)
    dataset = make_dataset("train", 10, seed=0)
    samples = []
    for group in range(len(CASES) + 4):
        for member in range(2):
            sample = fake_rollout_sample(
                policy, tokenizer, dataset[group]["prompt"], 6, generator, model_version=0, group_id=group
            )
            if group < len(CASES) and member == 1:
                sample = _corrupt(sample, CASES[group])
            samples.append(sample)
    return samples


@pytest.mark.parametrize(
    "correction",
    [
        {},  # bypass: the loss's ratio is against the generator's log-probs
        {  # decoupled, SPO++'s rollout weight: token_truncate, no upper bound given (2 by default)
            "vllm_importance_sampling_correction": True,
            "vllm_importance_sampling_mode": "token_truncate",
            "vllm_importance_sampling_clip_min": 0.5,
            "vllm_importance_sampling_clip_max": None,
        },
    ],
    ids=["bypass", "decoupled"],
)
def test_bad_generator_log_probs_drop_their_groups(tmp_path, caplog, correction, recwarn):
    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer

    class ReplayingTRLWorker(ReplayRolloutWorker, AsyncRolloutWorker):
        """TRL's worker class to the trainer, fixed samples inside."""

        def __init__(self, samples):
            super().__init__(samples)
            self._loop_kwargs = {"dataset_start_index": 0}

    install_cpu_fallbacks()
    tokenizer = calculator_tokenizer()
    fields = async_fields(tmp_path, per_device_train_batch_size=4, num_generations=2, max_steps=1)
    args = AsyncASPOConfig(**fields, loss_type="aspo", **correction)
    if correction:
        assert args.vllm_importance_sampling_clip_max == 2.0
        assert any("it is set to 2.0 (SPO++'s cap)" in str(w.message) for w in recwarn)
    trainer = AsyncASPOTrainer(
        MODEL,
        reward_funcs=correctness_reward,
        args=args,
        train_dataset=make_dataset("train", 10, seed=0),
        processing_class=tokenizer,
        rollout_worker=ReplayingTRLWorker(_stream(tokenizer)),
        weight_transfer=NoOpWeightTransfer(),
    )
    taken, get = [], trainer.rollout_queue.get

    def recording_get(*get_args, **get_kwargs):
        taken.append(get(*get_args, **get_kwargs))
        return taken[-1]

    trainer.rollout_queue.get = recording_get
    with caplog.at_level(logging.WARNING, logger="trl_aspo.infra.sample_checks"):
        trainer.train()

    # No sample of a broken group reaches training; the good groups do, in order.
    assert {sample.group_id for sample in taken} <= {6, 7, 8, 9}
    assert [sample.group_id for sample in taken[:4]] == [6, 6, 7, 7]
    assert set(range(len(CASES))) <= trainer._trained_groups  # consumed, as zero-variance groups are
    (row,) = [row for row in trainer.state.log_history if "loss" in row]
    assert row["offpolicy/dropped_groups"] == 6.0
    assert math.isfinite(row["loss"]) and row["loss"] != 0.0
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    (warning,) = [record for record in caplog.records if record.name == "trl_aspo.infra.sample_checks"]
    assert "Rollout sample of group 0" in warning.message
    assert "generator log-prob nan at completion token" in warning.message
