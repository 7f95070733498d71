"""What the sharded-tier workers share: the run's method fields, full parameters gathered from shards, the held-out
evaluator of `HeldoutDuringTraining`, a record of the trainer's state when training begins, the trainer's events as
progress for the test's watchdog, and the end of a run (the final model saved, the rank's record written, the
process group left)."""

from __future__ import annotations

import json

from transformers import TrainerCallback

# What both workers train: three steps of four single-completion prompts under spo++ with prioritized sampling, the
# aspo loss and tool shaping, checkpointed at step 2.
RUN_FIELDS = dict(
    per_device_train_batch_size=4,
    num_generations=1,
    max_steps=3,
    max_completion_length=48,
    seed=3,
    loss_type="aspo",
    tool_shaping=True,
    tool_shaping_correct_threshold=0.05,
    advantage_estimator="spo++",
    prioritized_sampling=True,
    save_strategy="steps",
    save_steps=2,
)


def full_parameters(model) -> dict:
    """Every full parameter by its name in the unwrapped model (a copy on CPU), the same on every rank: FSDP2's
    DTensor shards are gathered with `full_tensor()`, DeepSpeed ZeRO-3's partitions with `GatheredParameters`; a
    collective under sharding, so every rank must call it."""
    from torch.distributed.tensor import DTensor

    named = [(name.removeprefix("module."), parameter) for name, parameter in model.named_parameters()]
    if any(hasattr(parameter, "ds_id") for _, parameter in named):
        import deepspeed

        with deepspeed.zero.GatheredParameters([parameter for _, parameter in named]):
            return {name: parameter.detach().cpu().clone() for name, parameter in named}
    return {
        name: (parameter.full_tensor() if isinstance(parameter, DTensor) else parameter).detach().cpu().clone()
        for name, parameter in named
    }


def full_parameter_sum(model) -> float:
    """Sum of every full parameter (float64), the same number on every rank; a collective under sharding."""
    return sum(tensor.double().sum().item() for tensor in full_parameters(model).values())


def heldout_evaluator(dataset, tools, args):
    """`evaluate(model, tokenizer)` for `HeldoutDuringTraining`: greedy tool-use summary on `dataset`."""
    from helpers import digit_share_reward

    from trl_aspo.evaluation.tool_use import evaluate_tool_use

    def evaluate(model, tokenizer):
        summary = evaluate_tool_use(
            model,
            tokenizer,
            dataset,
            digit_share_reward,
            tools,
            temperature=0.0,
            max_completion_length=args.max_completion_length,
            max_tool_calls=args.max_tool_calling_iterations,
            seed=args.seed,
            progress=False,
        )
        summary.pop("records")
        return summary

    return evaluate


class AtTrainBegin(TrainerCallback):
    """The model's full parameter sum and the tracker's state when the first step is about to run: after the
    trainer has prepared (sharded) the model, a value pre-pass has set the tracker, and a resume has loaded its
    checkpoint. `tracker()` returns the trainer's tracker."""

    def __init__(self, tracker):
        self.tracker, self.record = tracker, {}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.record = {
            "parameters_sum": full_parameter_sum(model),
            "tracker": self.tracker().state_dict(),
            "global_step": state.global_step,
        }


class ProgressMarks(TrainerCallback):
    """Marks each trainer event that ends a stretch of work (a micro-batch, an optimizer step, a log, a checkpoint)
    as progress (`progress.Progress`): the test's watchdog then measures the time since the last one, not the run's
    total, so a slow machine passes and a hang is still caught."""

    def __init__(self, progress):
        self.progress = progress

    def on_train_begin(self, args, state, control, **kwargs):
        self.progress.mark("train begin")

    def on_substep_end(self, args, state, control, **kwargs):
        self.progress.mark(f"micro-batch of step {state.global_step + 1}")

    def on_step_end(self, args, state, control, **kwargs):
        self.progress.mark(f"step {state.global_step}")

    def on_log(self, args, state, control, **kwargs):
        self.progress.mark(f"log at step {state.global_step}")

    def on_save(self, args, state, control, **kwargs):
        self.progress.mark(f"checkpoint {state.global_step}")

    def on_train_end(self, args, state, control, **kwargs):
        self.progress.mark("train end")


def finish_run(trainer, out_dir: str, label: str, entries, progress, save_model: bool = True) -> None:
    """Save the final model to `OUT/LABEL/final` (unless `save_model` is false), then write this rank's record to
    `OUT/LABEL-rank<k>.json`: its rank, the world size, the distributed type, the logged losses and the run's own
    `entries()`, called on every rank after the save (they may hold collectives, such as `full_parameter_sum`); then
    leave the process group. Each stage is marked on `progress`."""
    if save_model:
        trainer.save_model(f"{out_dir}/{label}/final")
        progress.mark("final model saved")
    accelerator = trainer.accelerator
    accelerator.wait_for_everyone()
    record = {
        "rank": accelerator.process_index,
        "world": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "losses": [row["loss"] for row in trainer.state.log_history if "loss" in row],
        **entries(),
    }
    with open(f"{out_dir}/{label}-rank{record['rank']}.json", "w") as handle:
        json.dump(record, handle)
    progress.mark("record written")
    accelerator.wait_for_everyone()
    # Leave the process group before exiting: gloo's threads torn down at interpreter exit can abort the process.
    accelerator.end_training()
