"""Run by tests/integration/test_multiprocess.py under `accelerate launch` with two processes (gloo on CPU), or as
one process, with tests/ on PYTHONPATH (for `helpers`):

    PYTHONPATH=tests python tests/integration/workers/multiprocess_worker.py OUT ESTIMATOR [LABEL [JSON_OVERRIDES]]

Each rank trains the tiny model briefly and writes what it saw to `OUT/LABEL-rank<k>.json` (LABEL defaults to
ESTIMATOR); JSON_OVERRIDES replace ASPOConfig fields."""

from __future__ import annotations

import json
import sys

from helpers import digit_share_reward, recording_rounds, tiny_run_fields

from trl_aspo import ASPOConfig, ASPOTrainer
from trl_aspo.builtin import load_builtin
from trl_aspo.builtin.task import calculator, make_dataset


def run(out_dir: str, mode: str, label: str, overrides: dict) -> None:
    # "spo-kl": SPO with KL-adaptive rho, whose stored visits must be identical on every rank.
    estimator = "spo" if mode == "spo-kl" else mode
    single = estimator != "group"
    fields = tiny_run_fields(
        f"{out_dir}/{label}",
        per_device_train_batch_size=2 if not single else 4,
        num_generations=4 if not single else 1,  # group runs: each group of 4 straddles the two ranks
        max_tool_calling_iterations=1,
        max_steps=3,
        seed=3,
        loss_type="aspo",
        num_iterations=1,
        tool_shaping=True,
        tool_shaping_correct_threshold=0.05,
        advantage_estimator=estimator,
        value_rho_mode="kl" if mode == "spo-kl" else "constant",
        prioritized_sampling=single,
    )
    fields.update(overrides)
    args = ASPOConfig(**fields)
    model, tokenizer = load_builtin("builtin:tiny-random")
    trainer = ASPOTrainer(
        model=model,
        reward_funcs=[digit_share_reward],
        args=args,
        train_dataset=make_dataset("train", 24, seed=0),
        processing_class=tokenizer,
        tools=[calculator],
    )
    rounds = recording_rounds(trainer)
    trainer.train()
    record = {
        "rank": trainer.accelerator.process_index,
        "world": trainer.accelerator.num_processes,
        "rounds": rounds,
        "tracker": trainer._values.tracker.state_dict() if single else None,
        "sampler_weights": trainer._priority_sampler.weights.tolist() if single else None,
        "parameters_sum": sum(p.double().sum().item() for p in trainer.model.parameters()),
        "visit_store": {
            key: {name: tensor.tolist() for name, tensor in visit.items()}
            for key, visit in (trainer._values.visit_store if single else {}).items()
        },
    }
    with open(f"{out_dir}/{label}-rank{record['rank']}.json", "w") as handle:
        json.dump(record, handle)
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()  # gloo can abort a process at exit when its group is left alive


if __name__ == "__main__":
    estimator = sys.argv[2]
    label = sys.argv[3] if len(sys.argv) > 3 else estimator
    run(sys.argv[1], estimator, label, json.loads(sys.argv[4]) if len(sys.argv) > 4 else {})
