"""Run by tests/sharded/test_sharded.py: one AsyncASPOTrainer run of the built-in tiny calculator model generating
with the in-process `LocalRolloutWorker` (on the main process, as TRL's rollout worker), on one process (`python`)
or under `accelerate launch` (FSDP2 on CPU processes), with tests/ and this folder on PYTHONPATH:

    PYTHONPATH=tests:tests/sharded/workers python tests/sharded/workers/async_worker.py OUT LABEL JSON_OPTIONS

JSON_OPTIONS: {"overrides": {AsyncASPOConfig fields}, "resume": checkpoint path or null}. `TRL_ASPO_CPU_SHARDING=1`
applies `trl_aspo.infra.cpu_sharding.enable_cpu_sharding` first.

Every rank writes to `OUT/LABEL-rank<k>.json`: the logged losses, the tracker and prompt-priority state, the full
parameter sum (gathered from shards) when training begins (after a resume has loaded its checkpoint) and at the
end, the tracker state when training begins, and the held-out evaluation after training (`BeforeAfterReport`)."""

from __future__ import annotations

import json
import os
import pathlib
import sys

from progress import Progress

# Started first: the test's watchdog reads this rank's progress and asks it for its stacks when the run stalls.
PROGRESS = Progress(sys.argv[1], sys.argv[2])
if os.environ.get("TRL_ASPO_CPU_SHARDING") == "1":
    from trl_aspo.infra.cpu_sharding import enable_cpu_sharding

    enable_cpu_sharding()

from helpers import async_fields, calculator_tokenizer, digit_share_reward, trainer_with_local_worker  # noqa: E402
from sharded_common import RUN_FIELDS, AtTrainBegin, ProgressMarks, finish_run, full_parameter_sum  # noqa: E402

from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer  # noqa: E402
from trl_aspo.builtin.task import calculator, make_dataset  # noqa: E402
from trl_aspo.evaluation.report import BeforeAfterReport  # noqa: E402

PROGRESS.mark("imported")


def run(out_dir: str, label: str, options: dict) -> None:
    fields = async_fields(pathlib.Path(out_dir), output_dir=f"{out_dir}/{label}", max_inflight_tasks=2, **RUN_FIELDS)
    fields.update(options.get("overrides", {}))
    args = AsyncASPOConfig(**fields)
    tokenizer = calculator_tokenizer()
    dataset = make_dataset("train", 16, seed=0)
    trainer = trainer_with_local_worker(AsyncASPOTrainer, args, tokenizer, dataset, [digit_share_reward])
    PROGRESS.mark("trainer built")
    trainer.add_callback(ProgressMarks(PROGRESS))
    at_begin = AtTrainBegin(lambda: trainer._values.tracker)
    trainer.add_callback(at_begin)
    report = BeforeAfterReport(trainer, make_dataset("test", 4, seed=1), [digit_share_reward], [calculator])
    trainer.train(resume_from_checkpoint=options.get("resume"))
    report.measure("after")
    PROGRESS.mark("evaluated after")
    finish_run(
        trainer,
        out_dir,
        label,
        lambda: {
            "at_begin": at_begin.record,
            "report": report.results,
            "tracker": trainer._values.tracker.state_dict(),
            "parameters_sum": full_parameter_sum(trainer.model_wrapped),
        },
        PROGRESS,
    )


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
