"""What the sharded-tier workers share: parameter sums gathered from shards, the held-out evaluator of
`HeldoutDuringTraining`, and a record of the trainer's state when training begins."""

from __future__ import annotations

from transformers import TrainerCallback


def full_parameter_sum(model) -> float:
    """Sum of every full parameter (float64), the same number on every rank: FSDP2's DTensor shards are gathered
    with `full_tensor()`, DeepSpeed ZeRO-3's partitions with `GatheredParameters`; a collective under sharding, so
    every rank must call it."""
    from torch.distributed.tensor import DTensor

    parameters = list(model.parameters())
    if any(hasattr(parameter, "ds_id") for parameter in parameters):
        import deepspeed

        with deepspeed.zero.GatheredParameters(parameters):
            return sum(parameter.detach().double().sum().item() for parameter in parameters)
    total = 0.0
    for parameter in parameters:
        tensor = parameter.full_tensor() if isinstance(parameter, DTensor) else parameter
        total += tensor.detach().double().sum().item()
    return total


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
