"""TRL's own tests drive `AsyncGRPOTrainer`'s methods on a trainer built by hand (`object.__new__`) on a plain
`TrainingArguments`, which has none of this project's fields (AsyncGRPOConfig has no `loss_type` either). With the
trainer swapped for `AsyncASPOTrainer`, those methods must answer as TRL's do (issue 25, item 17)."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from transformers import TrainingArguments
from trl.experimental.async_grpo import AsyncGRPOTrainer

from trl_aspo import AsyncASPOTrainer


def _bare(cls, tmp_path):
    trainer = object.__new__(cls)
    trainer.args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    trainer.accelerator = Accelerator(cpu=True)
    trainer.model_accepts_loss_kwargs = False
    trainer.compute_loss_func = None
    return trainer


def _micro_batches():
    return [
        {
            "input_ids": torch.tensor([[1, 2, 3]]),
            "segment_id": torch.tensor([[0, 0, 1]]),
            "token_index": torch.tensor([[0, 1, -1]]),
        }
        for _ in range(3)
    ]


def test_get_batch_samples_on_plain_training_arguments_answers_as_trl(tmp_path):
    ours = _bare(AsyncASPOTrainer, tmp_path).get_batch_samples(iter(_micro_batches()), 2, torch.device("cpu"))
    trls = _bare(AsyncGRPOTrainer, tmp_path).get_batch_samples(iter(_micro_batches()), 2, torch.device("cpu"))
    assert len(ours[0]) == len(trls[0]) == 2
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(ours[0], trls[0], strict=True))
    assert ours[1] == trls[1]


def test_training_step_bookkeeping_on_a_bare_trainer(tmp_path, monkeypatch):
    """The micro-batch count that closes an optimizer step starts from the class defaults."""
    trainer = _bare(AsyncASPOTrainer, tmp_path)
    monkeypatch.setattr(
        AsyncGRPOTrainer, "training_step", lambda self, model, inputs, num_items=None: torch.tensor(1.0)
    )
    assert trainer.training_step(None, {}).item() == 1.0
    assert trainer._micro_batches_of_step == 0  # one micro-batch per step: the step closed


def test_skipping_non_finite_steps_is_refused_under_deepspeed(tmp_path):
    """DeepSpeed steps inside the backward pass, before the norm is known: refused before the first step."""

    from trl_aspo import ASPOConfig, ASPOTrainer

    trainer = object.__new__(ASPOTrainer)
    trainer.args = ASPOConfig(output_dir=str(tmp_path), skip_nonfinite_grad_steps=True, report_to="none", use_cpu=True)
    trainer.is_deepspeed_enabled = True
    with pytest.raises(ValueError, match=r"skip_nonfinite_grad_steps=True cannot act under DeepSpeed"):
        trainer.train()
