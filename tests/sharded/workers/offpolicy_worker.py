"""Run by tests/sharded/test_sharded.py: one off-policy synchronous ASPOTrainer run (the aspo loss acting: ratios away
from 1) of the built-in tiny calculator model, on one process or under `accelerate launch`, recording what the test
needs to recompute every optimizer step on its own:

    PYTHONPATH=tests:tests/sharded/workers python tests/sharded/workers/offpolicy_worker.py OUT LABEL JSON_OPTIONS

JSON_OPTIONS: {"overrides": {ASPOConfig fields}} (the test sets the optimizer, the clip constants and the
off-policy schedule). `TRL_ASPO_CPU_SHARDING=1` applies `trl_aspo.infra.cpu_sharding.enable_cpu_sharding` first.

Every rank writes `OUT/LABEL-rank<k>-batches.pt`, the micro-batches it trained on, in order, each with the index of
the optimizer step it entered (token ids, masks, advantages, behaviour log-probs, TRL's `num_items_in_batch`), and
`OUT/LABEL-rank<k>.json` (the logged rows); rank 0 writes `OUT/LABEL-parameters.pt`, the full parameters (gathered
from shards) when training begins and after each optimizer step. No checkpoint, evaluation or final model: the
other runs of the tier check those."""

from __future__ import annotations

import json
import os
import sys

from progress import Progress

# Started first: the test's watchdog reads this rank's progress and asks it for its stacks when the run stalls.
PROGRESS = Progress(sys.argv[1], sys.argv[2])
if os.environ.get("TRL_ASPO_CPU_SHARDING") == "1":
    from trl_aspo.infra.cpu_sharding import enable_cpu_sharding

    enable_cpu_sharding()

import torch  # noqa: E402
from helpers import MODEL, calculator_tokenizer, digit_share_reward, tiny_run_fields  # noqa: E402
from sharded_common import RUN_FIELDS, ProgressMarks, finish_run, full_parameters  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from trl_aspo import ASPOConfig, ASPOTrainer  # noqa: E402
from trl_aspo.builtin.task import calculator, make_dataset  # noqa: E402

PROGRESS.mark("imported")

# What the loss reads of a micro-batch (TRL's names); the test recomputes the log-probs from the token ids.
RECORDED = (
    "prompt_ids",
    "prompt_mask",
    "completion_ids",
    "completion_mask",
    "tool_mask",
    "advantages",
    "old_per_token_logps",
    "num_items_in_batch",
)


class ParameterSnapshots(TrainerCallback):
    """The full parameters when training begins and after every optimizer step (a collective: every rank)."""

    def __init__(self):
        self.snapshots = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.snapshots.append(full_parameters(model))

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.snapshots.append(full_parameters(model))


def recording_micro_batches(trainer) -> list:
    """Patches `trainer.compute_loss` to keep each training micro-batch as the loss receives it; returns the list."""
    batches, compute_loss = [], trainer.compute_loss

    def recording(model, inputs, *args, **kwargs):
        if trainer.model.training:
            kept = {key: inputs[key].detach().cpu() for key in RECORDED if key in inputs}
            batches.append({"step": trainer.state.global_step, **kept})
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = recording
    return batches


def run(out_dir: str, label: str, options: dict) -> None:
    fields = tiny_run_fields(
        f"{out_dir}/{label}", **RUN_FIELDS, max_tool_calling_iterations=1, top_k=1, value_init_samples=1
    )
    fields.update(options["overrides"])
    trainer = ASPOTrainer(
        model=MODEL,
        reward_funcs=[digit_share_reward],
        args=ASPOConfig(**fields),
        train_dataset=make_dataset("train", 16, seed=0),
        processing_class=calculator_tokenizer(),
        tools=[calculator],
    )
    PROGRESS.mark("trainer built")
    trainer.add_callback(ProgressMarks(PROGRESS))
    snapshots = ParameterSnapshots()
    trainer.add_callback(snapshots)
    batches = recording_micro_batches(trainer)
    trainer.train()
    rank = trainer.accelerator.process_index
    torch.save(batches, f"{out_dir}/{label}-rank{rank}-batches.pt")
    if rank == 0:
        torch.save(snapshots.snapshots, f"{out_dir}/{label}-parameters.pt")
    finish_run(
        trainer,
        out_dir,
        label,
        lambda: {"log_history": trainer.state.log_history},
        PROGRESS,
        save_model=False,
    )


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
