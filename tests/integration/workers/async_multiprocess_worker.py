"""Run by tests/integration/test_multiprocess.py under `accelerate launch` with two processes (gloo on CPU), with
tests/ on PYTHONPATH (for `helpers`):

    PYTHONPATH=tests python tests/integration/workers/async_multiprocess_worker.py OUT LABEL JSON_OVERRIDES

Each rank trains `AsyncASPOTrainer` (loss_type='aspo') for one optimizer step on the fixed samples of
`helpers.step_samples` (two micro-batches whose groups TRL's fixed-count batcher puts on the ranks 1 + 7 and 3 + 5),
and writes the summed gradient of that step (after DDP's all-reduce, before the optimizer) to `OUT/LABEL-rank<k>.pt`;
JSON_OVERRIDES replace AsyncASPOConfig fields."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys

import torch
from helpers import MODEL, async_fields, calculator_tokenizer, step_samples

from trl_aspo.builtin.task import correctness_reward, make_dataset


def worker_fields(out_dir: str, label: str, overrides: dict) -> dict:
    """One optimizer step of two micro-batches of 4 samples per rank, plain SGD without clipping."""
    fields = async_fields(
        pathlib.Path(out_dir) / label,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_generations=8,
        max_steps=1,
        loss_type="aspo",
        max_grad_norm=0.0,
        optim="sgd",
    )
    fields.update(overrides)
    return fields


def run(out_dir: str, label: str, overrides: dict) -> None:
    from transformers import TrainerCallback

    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer
    from trl_aspo.infra import NoOpWeightTransfer, ReplayRolloutWorker, install_cpu_fallbacks

    install_cpu_fallbacks()
    tokenizer = calculator_tokenizer()
    samples = step_samples(tokenizer)
    # The data loader fetches one micro-batch ahead, so the queue holds a second step's worth (never trained).
    spare = [dataclasses.replace(sample, group_id=sample.group_id + len(samples)) for sample in samples]
    trainer = AsyncASPOTrainer(
        MODEL,
        reward_funcs=correctness_reward,
        args=AsyncASPOConfig(**worker_fields(out_dir, label, overrides)),
        train_dataset=make_dataset("train", 4, seed=0),
        processing_class=tokenizer,
        rollout_worker=ReplayRolloutWorker(samples + spare),
        weight_transfer=NoOpWeightTransfer(),
    )
    gradients, shares = {}, []
    compute_loss = trainer.compute_loss

    def recording_compute_loss(model, inputs, *args, **kwargs):
        shares.append(int((inputs["segment_id"][inputs["token_index"] >= 0]).unique().numel()))
        return compute_loss(model, inputs, *args, **kwargs)

    class GradientRecorder(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            for name, parameter in trainer.model.named_parameters():
                gradients[name] = parameter.grad.detach().clone()

    trainer.compute_loss = recording_compute_loss
    trainer.add_callback(GradientRecorder())
    trainer.train()
    rank = trainer.accelerator.process_index
    metrics = {key: value for log in trainer.state.log_history for key, value in log.items() if "offpolicy/" in key}
    torch.save({"gradients": gradients, "shares": shares, "metrics": metrics}, f"{out_dir}/{label}-rank{rank}.pt")
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()  # gloo can abort a process at exit when its group is left alive


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
