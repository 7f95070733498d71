"""Run by tests/sharded/test_sharded.py: one synchronous ASPOTrainer run of the built-in tiny calculator model, on
one process (`python`) or under `accelerate launch` (DDP, FSDP2 or DeepSpeed ZeRO on CPU processes), with tests/ on
PYTHONPATH (for `helpers`):

    PYTHONPATH=tests python tests/sharded/workers/sync_worker.py OUT LABEL JSON_OPTIONS

JSON_OPTIONS: {"overrides": {ASPOConfig fields}, "resume": checkpoint path or null}. `TRL_ASPO_CPU_SHARDING=1`
applies `trl_aspo.infra.cpu_sharding.enable_cpu_sharding` first (accelerate shards only on accelerators).

Every rank writes what it saw to `OUT/LABEL-rank<k>.json`: per-round gathered rewards and local advantages, the
logged losses, tracker and sampler state, the full parameter sum (gathered from shards) when training begins and at
the end, the before/after held-out evaluation (`BeforeAfterReport`) and the held-out rows logged during training
(`HeldoutDuringTraining`); the model is saved under OUT/LABEL/final, which the test loads with `from_pretrained` in
its own process (under ZeRO-3, `from_pretrained` inside one rank builds the model under `deepspeed.zero.Init`, a
collective the other ranks never join)."""

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

from helpers import MODEL, calculator_tokenizer, digit_share_reward, recording_rounds, tiny_run_fields  # noqa: E402
from sharded_common import (  # noqa: E402
    RUN_FIELDS,
    AtTrainBegin,
    ProgressMarks,
    finish_run,
    full_parameter_sum,
    heldout_evaluator,
)

from trl_aspo import ASPOConfig, ASPOTrainer  # noqa: E402
from trl_aspo.builtin.task import calculator, make_dataset  # noqa: E402
from trl_aspo.cli.callbacks import HeldoutDuringTraining  # noqa: E402
from trl_aspo.evaluation.report import BeforeAfterReport  # noqa: E402

PROGRESS.mark("imported")


def run(out_dir: str, label: str, options: dict) -> None:
    fields = tiny_run_fields(
        f"{out_dir}/{label}",
        **RUN_FIELDS,
        max_tool_calling_iterations=1,
        top_k=1,
        num_iterations=1,
        value_init_samples=1,
        log_weight_map=True,
        save_only_model=False,
    )
    fields.update(options.get("overrides", {}))
    args = ASPOConfig(**fields)
    heldout = make_dataset("test", 4, seed=1)
    # The checkpoint's path, not a loaded model: the trainer loads it under the launch (with ZeRO-3 partitioned at
    # load by `deepspeed.zero.Init`, so a weight read outside the engine's gathering is an empty partition).
    trainer = ASPOTrainer(
        model=MODEL,
        reward_funcs=[digit_share_reward],
        args=args,
        train_dataset=make_dataset("train", 16, seed=0),
        processing_class=calculator_tokenizer(),
        tools=[calculator],
    )
    PROGRESS.mark("trainer built")
    trainer.add_callback(ProgressMarks(PROGRESS))
    curve = HeldoutDuringTraining(2, heldout_evaluator(heldout, [calculator], args))
    trainer.add_callback(curve)
    at_begin = AtTrainBegin(lambda: trainer._values.tracker)
    trainer.add_callback(at_begin)
    report = BeforeAfterReport(trainer, heldout, [digit_share_reward], [calculator])
    rounds = recording_rounds(trainer)
    report.measure_before()
    PROGRESS.mark("evaluated before")
    trainer.train(resume_from_checkpoint=options.get("resume"))
    report.measure("after")
    PROGRESS.mark("evaluated after")
    finish_run(
        trainer,
        out_dir,
        label,
        lambda: {
            "rounds": rounds,
            "heldout_rows": [row for row in trainer.state.log_history if "heldout/accuracy" in row],
            "report": report.results,
            "tracker": trainer._values.tracker.state_dict(),
            "sampler_weights": trainer._priority_sampler.weights.tolist(),
            # KL-adaptive rho's stored visits (token ids, action masks, post-update log-probs), gathered per round.
            "visit_store": {
                key: {name: tensor.tolist() for name, tensor in visit.items()}
                for key, visit in trainer._values.visit_store.items()
            },
            "at_begin": at_begin.record,
            "parameters_sum": full_parameter_sum(trainer.model_wrapped),
        },
        PROGRESS,
    )


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
