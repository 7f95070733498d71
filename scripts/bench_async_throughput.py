"""Completions per second: AsyncASPOTrainer with the local rollout worker vs the synchronous ASPOTrainer.

Both train the built-in tiny model on the built-in calculator task with the same settings as
configs/quickstart_async.yaml (SPO++ with one completion per prompt, `loss_type: aspo`, tool shaping, the same
completion length, batch and learning rate); the synchronous trainer generates one fresh batch per optimizer step
(`steps_per_generation: 1`), the asynchronous one overlaps generation (on its CPU policy copy) with training.
Repetitions are interleaved (sync, async, sync, async, ...) so that a change in machine load hits both alike, and
each runs in a fresh Python process, so no run inherits another's state. Torch uses `--threads` intra-op threads
(default 1, as `trl-aspo compare` runs use; with torch's default 2 on the shared 2-core machine, the synchronous
trainer's throughput varied 8-fold between repetitions); the asynchronous trainer's sampler thread runs beside its
training thread either way. The table gives the median over repetitions of trained completions per second of
`trainer.train()` wall time (model loading excluded) and of the process CPU time per completion.

    python scripts/bench_async_throughput.py [--steps 20] [--repeats 3] [--batch 16] [--jitter 0] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

COMMON = {
    "model_name_or_path": "builtin:tiny-calculator",
    "dataset_name": "builtin:calculator",
    "builtin_train_size": 256,
    "builtin_test_size": 1,
    "reward_funcs": ["builtin:correctness"],
    "tools": ["builtin:calculator"],
    "num_generations": 1,
    "max_tool_calling_iterations": 1,
    "temperature": 1.0,
    "learning_rate": 1.0e-4,
    "lr_scheduler_type": "constant",
    "advantage_estimator": "spo++",
    "loss_type": "aspo",
    "tool_shaping": True,
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": "none",
    "use_cpu": True,
    "bf16": False,
    "seed": 0,
    "disable_tqdm": True,
}
TRAINER_SETTINGS = {
    "sync": {"trainer": "sync", "steps_per_generation": 1},
    "async": {"trainer": "async", "rollout_worker": "local", "token_budget": 0, "max_staleness": 2},
}


def measure(kind: str, args: argparse.Namespace, output_dir: str) -> tuple[float, float]:
    """(completions per second, CPU seconds per completion) of one `trainer.train()` of `kind`."""
    from transformers.trainer_callback import PrinterCallback

    from trl_aspo.builtin.registry import BUILTIN_REWARDS, BUILTIN_TOOLS
    from trl_aspo.cli.parsers import load_datasets, resolve_callable
    from trl_aspo.cli.train import build_async_trainer, build_sync_trainer, parse_config

    config = {
        **COMMON,
        **TRAINER_SETTINGS[kind],
        "output_dir": output_dir,
        "max_steps": args.steps,
        "per_device_train_batch_size": args.batch,
        "max_completion_length": args.max_completion_length,
    }
    if kind == "async":
        config["rollout_jitter_s"] = args.jitter
    script_args, training_args, model_args, dataset_args = parse_config(config)
    reward_funcs = [resolve_callable(name, BUILTIN_REWARDS, "reward_funcs entry") for name in config["reward_funcs"]]
    tools = [resolve_callable(name, BUILTIN_TOOLS, "tools entry") for name in config["tools"]]
    train, test = load_datasets(script_args, dataset_args)
    if kind == "async":
        trainer = build_async_trainer(script_args, training_args, model_args, reward_funcs, tools, train)
    else:
        trainer = build_sync_trainer(training_args, model_args, reward_funcs, tools, train, test)
    trainer.remove_callback(PrinterCallback)  # tqdm is off; the per-step log lines would bury the table
    wall, cpu = time.perf_counter(), time.process_time()
    trainer.train()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    completions = args.steps * args.batch
    return completions / wall, cpu / completions


def measure_in_subprocess(kind: str, argv: list[str], output_dir: str) -> tuple[float, float]:
    command = [sys.executable, __file__, *argv, "--measure", kind, "--output_dir", output_dir]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{kind} measurement failed:\n{result.stderr[-4000:]}")
    rate, cpu = json.loads(result.stdout.strip().splitlines()[-1])
    return rate, cpu


def main() -> None:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repetitions per trainer")
    parser.add_argument("--batch", type=int, default=16, help="completions per optimizer step")
    parser.add_argument("--max_completion_length", type=int, default=64)
    parser.add_argument("--jitter", type=float, default=0.0, help="rollout_jitter_s of the local worker")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads of each run")
    parser.add_argument("--measure", choices=list(TRAINER_SETTINGS), help=argparse.SUPPRESS)
    parser.add_argument("--output_dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if min(args.steps, args.repeats, args.batch, args.max_completion_length, args.threads) < 1 or args.jitter < 0:
        parser.error("--steps, --repeats, --batch, --max_completion_length, --threads must be >= 1, --jitter >= 0")
    if args.measure:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(measure(args.measure, args, args.output_dir)))
        return
    argv = [
        f"--steps={args.steps}",
        f"--batch={args.batch}",
        f"--max_completion_length={args.max_completion_length}",
        f"--jitter={args.jitter}",
        f"--threads={args.threads}",
    ]
    results: dict[str, list[tuple[float, float]]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory() as output_dir:
        for repeat in range(args.repeats):
            for kind in results:
                results[kind].append(measure_in_subprocess(kind, argv, output_dir))
                rate, cpu = results[kind][-1]
                print(f"repeat {repeat + 1}/{args.repeats} {kind:>5}: {rate:.2f} completions/s, {cpu:.3f} CPU s each")
    print(
        f"\n{args.steps} steps x {args.batch} completions (max {args.max_completion_length} tokens), "
        f"{args.threads} torch thread(s), median of {args.repeats} interleaved repetitions\n"
    )
    print("| trainer | completions/s | CPU s per completion |\n|---|---:|---:|")
    medians = {
        kind: [statistics.median(column) for column in zip(*runs, strict=True)] for kind, runs in results.items()
    }
    for kind, (rate, cpu) in medians.items():
        name = "ASPOTrainer (sync)" if kind == "sync" else "AsyncASPOTrainer + LocalRolloutWorker"
        print(f"| {name} | {rate:.2f} | {cpu:.3f} |")
    print(f"\nasync / sync completions per second: {medians['async'][0] / medians['sync'][0]:.2f}x")


if __name__ == "__main__":
    main()
