"""The cost of the decoupled objective: AsyncASPOTrainer with and without `vllm_importance_sampling_correction`.

Both runs train the built-in tiny model on the built-in calculator task with the local rollout worker, SPO++ with one
completion per prompt and `loss_type: aspo` (configs/quickstart_async.yaml's settings), and differ only in the
correction (`token_truncate`, at most 2). The correction is computed inside the loss, so the number compared is TRL's
own `perf/forwarded_tok_s_fwd_bwd`, the forwarded tokens per second of the step's forward and backward passes (a
rate, so batches of different lengths compare), and `perf/step_s`, the whole optimizer step's seconds (which also
waits for rollouts). Each run is a fresh Python process; runs are interleaved (off, on, off, on, ...) so a change in
machine load hits both alike; the first step of each run (warm-up) is left out and the medians are over every other
step of every repetition.

    python scripts/bench_offpolicy_correction.py [--steps 12] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import warnings

SETTINGS = {
    "model_name_or_path": "builtin:tiny-calculator",
    "dataset_name": "builtin:calculator",
    "builtin_train_size": 256,
    "builtin_test_size": 1,
    "reward_funcs": ["builtin:correctness"],
    "tools": ["builtin:calculator"],
    "trainer": "async",
    "rollout_worker": "local",
    "token_budget": 0,
    "max_staleness": 2,
    "num_generations": 1,
    "per_device_train_batch_size": 16,
    "max_completion_length": 64,
    "max_tool_calling_iterations": 1,
    "learning_rate": 1.0e-4,
    "lr_scheduler_type": "constant",
    "advantage_estimator": "spo++",
    "loss_type": "aspo",
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": "none",
    "use_cpu": True,
    "bf16": False,
    "seed": 0,
    "disable_tqdm": True,
}
CORRECTION = {
    "vllm_importance_sampling_correction": True,
    "vllm_importance_sampling_mode": "token_truncate",
    "vllm_importance_sampling_clip_max": 2.0,
}
VARIANTS = {"off": {}, "on": CORRECTION}
MEASURED = ("perf/forwarded_tok_s_fwd_bwd", "perf/step_s")


def measure(variant: str, steps: int, output_dir: str) -> dict[str, list[float]]:
    """The per-step values of `MEASURED` (first step left out) of one run."""
    from transformers.trainer_callback import PrinterCallback

    from trl_aspo.builtin.registry import BUILTIN_REWARDS, BUILTIN_TOOLS
    from trl_aspo.cli.parsers import load_datasets, resolve_callable
    from trl_aspo.cli.train import build_async_trainer, parse_config

    config = {**SETTINGS, **VARIANTS[variant], "output_dir": output_dir, "max_steps": steps}
    script_args, training_args, model_args, dataset_args = parse_config(config)
    reward_funcs = [resolve_callable(name, BUILTIN_REWARDS, "reward_funcs entry") for name in config["reward_funcs"]]
    tools = [resolve_callable(name, BUILTIN_TOOLS, "tools entry") for name in config["tools"]]
    train, _ = load_datasets(script_args, dataset_args)
    trainer = build_async_trainer(script_args, training_args, model_args, reward_funcs, tools, train)
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    logs = [log for log in trainer.state.log_history if MEASURED[0] in log][1:]
    return {name: [log[name] for log in logs] for name in MEASURED}


def main() -> None:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs per variant")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads of each run")
    parser.add_argument("--measure", choices=list(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--output_dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 2 or args.repeats < 1 or args.threads < 1:
        parser.error("--steps must be >= 2 (the first step is left out); --repeats and --threads >= 1")
    if args.measure:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(measure(args.measure, args.steps, args.output_dir)))
        return
    collected = {variant: {name: [] for name in MEASURED} for variant in VARIANTS}
    with tempfile.TemporaryDirectory() as output_dir:
        for repeat in range(args.repeats):
            for variant in VARIANTS:
                command = [sys.executable, __file__, f"--steps={args.steps}", f"--threads={args.threads}"]
                command += ["--measure", variant, "--output_dir", output_dir]
                result = subprocess.run(command, capture_output=True, text=True, check=False)
                if result.returncode != 0:
                    raise SystemExit(f"{variant} run failed:\n{result.stderr[-4000:]}")
                for name, values in json.loads(result.stdout.strip().splitlines()[-1]).items():
                    collected[variant][name] += values
                print(f"repeat {repeat + 1}/{args.repeats}: correction {variant} done")
    medians = {
        variant: {name: statistics.median(values) for name, values in by.items()} for variant, by in collected.items()
    }
    print(f"\n{args.steps} steps per run (first left out), {args.repeats} interleaved runs per variant\n")
    print("| correction | forwarded tokens/s in forward + backward | step seconds |\n|---|---:|---:|")
    for variant, values in medians.items():
        print(f"| {variant} | {values[MEASURED[0]]:.0f} | {values[MEASURED[1]]:.3f} |")
    slowdown = medians["off"][MEASURED[0]] / medians["on"][MEASURED[0]]
    print(f"\nforward + backward time per token, on / off: {slowdown:.3f}x")
    print(f"step seconds, on / off: {medians['on'][MEASURED[1]] / medians['off'][MEASURED[1]]:.3f}x")


if __name__ == "__main__":
    main()
