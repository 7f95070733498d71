"""Time per training step: ASPOTrainer (aspo loss, tool shaping, spo++) against TRL's GRPOTrainer.

Same built-in model, task, tools, batch (4 prompts x 8 completions) and seed; learning rate 0, so every trainer
generates the same tokens in every repeat and only the trainers' own work differs. The trainers run interleaved
(one `train()` of `--steps` steps each, in turn, `--repeats` times) so load from other processes hits them alike;
a step is timed from `on_step_begin` to `on_step_end` (generation, rewards, advantages, loss, backward, optimizer)
and the first step of every `train()` call is dropped as warm-up. Rows:

- `grpo`: `GRPOTrainer`, TRL's default loss (`dapo`), the baseline of every ratio;
- `aspo`: `ASPOTrainer` with `loss_type="aspo"`, `tool_shaping=True`, `advantage_estimator="spo++"`
  (the issue's target: at most 1.02x `grpo`);
- `aspo, timing off`: `aspo` with `log_timing=False`, the per-step timers of the trainer's own work off (`aspo` runs
  them, as by default). Their cost is the median of the per-round ratios `aspo` / `aspo, timing off` (a
  round: one `train()` call of each row): no measurable cost means 1.0 lies within the rounds' spread;
- `aspo + kl rho` (separately, vs `aspo`): the same with `advantage_estimator="spo"`, `value_rho_mode="kl"`, whose
  extra forward pass re-scores each prompt's stored completion after the update.

With `--vllm colocate` (or `--vllm server --vllm_server_base_url URL`) both trainers generate with vLLM (vLLM's CPU
build, `make install-vllm`; run with `.venv-vllm/bin/python`): on a CPU the weights reach the engine by
`trl_aspo.infra.vllm_cpu`'s reload, for `GRPOTrainer` too, since TRL's own NCCL sync needs CUDA. Colocate mode builds
one engine per trainer in this process.

Usage: python scripts/bench_step.py [--repeats 8] [--steps 4] [--threads 1] [--profile aspo] [--vllm colocate]
`--profile NAME` prints the cProfile functions of that row with the most cumulative time, instead of timing.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import tempfile
import time
import warnings

import torch
from transformers import TrainerCallback, set_seed
from transformers.trainer_callback import ProgressCallback
from trl import GRPOConfig, GRPOTrainer

from trl_aspo import ASPOConfig, ASPOTrainer
from trl_aspo.builtin import TINY_CALCULATOR, load_builtin
from trl_aspo.builtin.task import calculator, correctness_reward, make_dataset
from trl_aspo.infra.vllm_cpu import cpu_weight_sync

ROWS = {
    "grpo": (GRPOTrainer, GRPOConfig, {}),
    "aspo": (ASPOTrainer, ASPOConfig, {"loss_type": "aspo", "tool_shaping": True, "advantage_estimator": "spo++"}),
    "aspo, timing off": (
        ASPOTrainer,
        ASPOConfig,
        {"loss_type": "aspo", "tool_shaping": True, "advantage_estimator": "spo++", "log_timing": False},
    ),
    "aspo + kl rho": (
        ASPOTrainer,
        ASPOConfig,
        {"loss_type": "aspo", "tool_shaping": True, "advantage_estimator": "spo", "value_rho_mode": "kl"},
    ),
}


class StepTimer(TrainerCallback):
    """Wall time and process CPU time of every optimizer step of a `train()` call but its first, kept per call (a
    round of the benchmark).

    On a CPU shared with other work the process CPU time is the steadier measure: waiting for a core is not in it."""

    def __init__(self):
        self.rounds: list[list[float]] = []
        self.cpu_rounds: list[list[float]] = []
        self.start = self.cpu_start = 0.0

    @property
    def times(self) -> list[float]:
        return [seconds for steps in self.rounds for seconds in steps]

    @property
    def cpu_times(self) -> list[float]:
        return [seconds for steps in self.cpu_rounds for seconds in steps]

    def on_train_begin(self, args, state, control, **kwargs):
        self.rounds.append([])
        self.cpu_rounds.append([])

    def on_step_begin(self, args, state, control, **kwargs):
        self.start, self.cpu_start = time.perf_counter(), time.process_time()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step > 1:
            self.rounds[-1].append(time.perf_counter() - self.start)
            self.cpu_rounds[-1].append(time.process_time() - self.cpu_start)


def vllm_fields(args: argparse.Namespace) -> dict:
    if args.vllm == "none":
        return {}
    if args.vllm == "server":
        return {"use_vllm": True, "vllm_mode": "server", "vllm_server_base_url": args.vllm_server_base_url}
    return {"use_vllm": True, "vllm_mode": "colocate", "vllm_max_model_length": 512}


def build(name: str, args: argparse.Namespace, output_dir: str):
    trainer_cls, config_cls, extra = ROWS[name]
    model, tokenizer = load_builtin(args.model)
    config = config_cls(
        output_dir=output_dir,
        per_device_train_batch_size=args.prompts * args.generations,
        num_generations=args.generations,
        max_completion_length=args.max_completion_length,
        max_tool_calling_iterations=1,
        max_steps=args.steps,
        learning_rate=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=0,
        disable_tqdm=True,
        **vllm_fields(args),
        **extra,
    )
    dataset = make_dataset("train", 256, seed=0)
    with cpu_weight_sync(config.use_vllm):
        trainer = trainer_cls(
            model, [correctness_reward], config, train_dataset=dataset, processing_class=tokenizer, tools=[calculator]
        )
    trainer.remove_callback(ProgressCallback)
    for callback in list(trainer.callback_handler.callbacks):
        if type(callback).__name__ == "PrinterCallback":
            trainer.remove_callback(callback)
    timer = StepTimer()
    trainer.add_callback(timer)
    return trainer, timer


def run(trainer) -> None:
    """One `train()` call from the same global RNG state: `Trainer.train` does not reseed, and the prompts drawn
    and tokens sampled would otherwise depend on how many calls ran before."""
    set_seed(trainer.args.seed)
    trainer.train()


def main() -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=TINY_CALCULATOR)
    parser.add_argument("--repeats", type=int, default=8, help="train() calls per trainer, interleaved")
    parser.add_argument("--steps", type=int, default=4, help="steps per train() call (the first is not timed)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max_completion_length", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--profile", choices=list(ROWS), help="cProfile this row instead of timing")
    parser.add_argument("--vllm", choices=["none", "colocate", "server"], default="none", help="generation backend")
    parser.add_argument("--vllm_server_base_url", default="http://127.0.0.1:8000")
    args = parser.parse_args()
    if args.steps < 2 or args.repeats < 1:
        parser.error("--steps must be >= 2 (the first step is warm-up) and --repeats >= 1")
    torch.set_num_threads(args.threads)
    args.use_vllm = args.vllm != "none"

    with tempfile.TemporaryDirectory() as scratch:
        if args.profile:
            trainer, _ = build(args.profile, args, f"{scratch}/{args.profile}")
            run(trainer)
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(args.repeats):
                run(trainer)
            profiler.disable()
            stats = pstats.Stats(profiler).sort_stats("cumulative")
            stats.print_stats(25)
            stats.print_stats("trl_aspo", 25)  # this package's own functions: the overhead over GRPOTrainer
            return
        trainers = {name: build(name, args, f"{scratch}/{index}") for index, name in enumerate(args.rows)}
        for trainer, _ in trainers.values():
            run(trainer)  # warm-up call, not counted
        for timer in (timer for _, timer in trainers.values()):
            timer.rounds.clear()
            timer.cpu_rounds.clear()
        for _ in range(args.repeats):
            for trainer, _ in trainers.values():
                run(trainer)
        lengths = {
            name: trainer.state.log_history[-2].get("completions/mean_length")
            for name, (trainer, _) in trainers.items()
        }

    walls = {name: statistics.median(timer.times) for name, (_, timer) in trainers.items()}
    cpus = {name: statistics.median(timer.cpu_times) for name, (_, timer) in trainers.items()}
    print(
        f"{args.model}, {args.prompts} prompts x {args.generations} completions, max_completion_length "
        f"{args.max_completion_length}, lr 0, CPU threads {torch.get_num_threads()}, {args.repeats} repeats x "
        f"{args.steps - 1} timed steps, interleaved, generation: {args.vllm if args.use_vllm else 'transformers'}"
    )
    print(
        "| trainer | median step, wall (ms) | wall vs grpo | wall vs aspo | median step, CPU (ms) | CPU vs grpo "
        "| CPU vs aspo | mean completion length |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in trainers:
        cells = [f"{1e3 * walls[name]:.1f}", ratio(walls, name, "grpo"), ratio(walls, name, "aspo")]
        cells += [f"{1e3 * cpus[name]:.1f}", ratio(cpus, name, "grpo"), ratio(cpus, name, "aspo")]
        print(f"| {name} | " + " | ".join(cells) + f" | {lengths[name]} |")
    if "aspo" in trainers and "aspo, timing off" in trainers:
        on, off = trainers["aspo"][1], trainers["aspo, timing off"][1]
        for clock, on_rounds, off_rounds in (("wall", on.rounds, off.rounds), ("CPU", on.cpu_rounds, off.cpu_rounds)):
            print(timers_line(clock, on_rounds, off_rounds))


def round_ratios(on_rounds: list[list[float]], off_rounds: list[list[float]]) -> list[float]:
    """Per round (one `train()` call of each row), the ratio of the rows' median step times: on / off."""
    return [
        statistics.median(on) / statistics.median(off) for on, off in zip(on_rounds, off_rounds, strict=True) if on
    ]


def timers_line(clock: str, on_rounds: list[list[float]], off_rounds: list[list[float]]) -> str:
    """The timers' cost: the median of the per-round ratios (each round's on and off steps ran back to back, so load
    from other processes hits both), against their spread (the noise of the measurement); no measurable cost when
    1.0 lies within that spread. The pooled median steps are printed for scale."""
    on = statistics.median([seconds for steps in on_rounds for seconds in steps])
    off = statistics.median([seconds for steps in off_rounds for seconds in steps])
    ratios = round_ratios(on_rounds, off_rounds)
    low, high = min(ratios), max(ratios)
    verdict = "no measurable cost" if low <= 1.0 <= high else "a cost beyond the spread"
    return (
        f"timers on vs off, {clock}: median step {1e3 * on:.1f} ms vs {1e3 * off:.1f} ms; median of the per-round "
        f"ratios {statistics.median(ratios):.3f}x ({low:.3f}x to {high:.3f}x over {len(ratios)} rounds): {verdict}"
    )


def ratio(medians: dict[str, float], name: str, baseline: str) -> str:
    return f"{medians[name] / medians[baseline]:.3f}x" if baseline in medians else "n/a"


if __name__ == "__main__":
    main()
