"""Evidence for tool-position shaping (issue 5): train with shaping on and off, same seed and budget, and compare.

    python scripts/compare_tool_shaping.py [--steps 120] [--model builtin:tiny-calculator] [--output_dir DIR]

Both runs start from the same warm-started checkpoint, see the same prompts in the same order with the same seed and
differ only in `tool_shaping`. Each trained model is then evaluated on the built-in task's held-out split with the
tool loop the trainer uses (`trl_aspo.evaluation.evaluate_tool_use`), next to the untrained checkpoint. Prints a
markdown comparison (mean first-call position and its relative change, accuracy, tool-call rate) and writes
`results.json` and `compare_tool_shaping.png` (first-call position, reward and tool-call rate per training step) to
`--output_dir`. The issue's target: first-call position at least 30% lower with accuracy at most 2 points lower.

Sampling at temperature 1 is the default evaluation, because it measures the policy that training moves; greedy
decoding (`--eval_temperature 0`) only shows a change once the most likely first token flips.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from transformers.trainer_callback import ProgressCallback

from trl_aspo import ASPOConfig, ASPOTrainer
from trl_aspo.builtin import TINY_CALCULATOR
from trl_aspo.builtin.task import calculator, correctness_reward, make_dataset
from trl_aspo.evaluate_cli import json_ready, load_model_and_tokenizer
from trl_aspo.evaluation import evaluate_tool_use
from trl_aspo.progress import MetricProgressCallback

RUNS = {"shaping off": False, "shaping on": True}
STYLES = {"shaping off": ("tab:gray", "--"), "shaping on": ("tab:blue", "-")}
CURVES = (
    ("tools/first_call_position", "mean first-call position (tokens)"),
    ("reward", "reward"),
    ("tools/tool_call_frac", "tool-call rate"),
)
TARGET_POSITION_DROP = 0.30
TARGET_ACCURACY_POINTS = 2.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=TINY_CALCULATOR, help="starting checkpoint (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps per run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num_prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--num_generations", type=int, default=8, help="completions per prompt (the group)")
    parser.add_argument("--max_completion_length", type=int, default=48)
    parser.add_argument("--max_tool_calling_iterations", type=int, default=1)
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument("--delta", type=float, default=-2.0, help="tool_shaping_delta of the shaped run")
    parser.add_argument("--k", type=float, default=0.7, help="tool_shaping_k of the shaped run")
    parser.add_argument("--train_problems", type=int, default=2000, help="size of the training split drawn")
    parser.add_argument("--eval_problems", type=int, default=200, help="held-out problems evaluated")
    parser.add_argument("--eval_samples", type=int, default=2, help="completions per held-out problem")
    parser.add_argument("--eval_temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (1 is fastest for this tiny model on a busy 2-core box)",
    )
    parser.add_argument("--output_dir", type=Path, default=Path("outputs/compare_tool_shaping"))
    args = parser.parse_args()
    for name in ("steps", "num_prompts", "num_generations", "max_completion_length", "eval_problems", "eval_samples"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.num_generations < 2:
        parser.error("--num_generations must be >= 2 (the group baseline)")
    return args


def train(
    name: str, shaping: bool, args: argparse.Namespace, dataset, start_model, tokenizer, device: str
) -> tuple[Any, list[dict]]:
    """Train a copy of the starting model; return the trained model and the per-step logs."""
    # A copy of one loaded model, not a reload: both runs provably start from the same weights.
    model = copy.deepcopy(start_model)
    config = ASPOConfig(
        output_dir=str(args.output_dir / name.replace(" ", "_")),
        per_device_train_batch_size=args.num_prompts * args.num_generations,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        max_tool_calling_iterations=args.max_tool_calling_iterations,
        max_steps=args.steps,
        learning_rate=args.learning_rate,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=device == "cpu",
        bf16=False,
        seed=args.seed,
        data_seed=args.seed,
        tool_shaping=shaping,
        tool_shaping_delta=args.delta,
        tool_shaping_k=args.k,
    )
    trainer = ASPOTrainer(
        model, [correctness_reward], config, train_dataset=dataset, processing_class=tokenizer, tools=[calculator]
    )
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(
        MetricProgressCallback(
            name, {"reward": "reward", "first_call": "tools/first_call_position", "calls": "tools/tool_call_frac"}
        )
    )
    trainer.train()
    history = [row for row in trainer.state.log_history if "reward" in row]
    return trainer.model, history


def evaluate(model, tokenizer, dataset, args: argparse.Namespace, label: str) -> dict[str, Any]:
    print(f"evaluating {label} on {len(dataset)} held-out problems x {args.eval_samples}")
    summary = evaluate_tool_use(
        model,
        tokenizer,
        dataset,
        correctness_reward,
        [calculator],
        num_samples=args.eval_samples,
        temperature=args.eval_temperature,
        max_completion_length=args.max_completion_length,
        max_tool_calls=args.max_tool_calling_iterations,
        seed=args.seed,
    )
    summary.pop("records")
    return summary


def curve(history: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(row["step"], row[key]) for row in history if row.get(key) is not None]
    return [step for step, _ in points], [value for _, value in points]


def tail_mean(history: list[dict], key: str, window: int = 10) -> float:
    values = curve(history, key)[1][-window:]
    return sum(values) / len(values) if values else math.nan


def running_mean(values: list[float], window: int = 5) -> list[float]:
    """Trailing mean over `window` steps: a step's value, from 32 completions, is noisy."""
    return [sum(values[max(0, i - window + 1) : i + 1]) / min(i + 1, window) for i in range(len(values))]


def plot(histories: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(CURVES), figsize=(4.6 * len(CURVES), 3.4))
    for axis, (key, title) in zip(axes, CURVES, strict=True):
        for name in reversed(histories):  # "off" dashed on top stays visible where the curves coincide
            color, style = STYLES[name]
            steps, values = curve(histories[name], key)
            axis.plot(steps, values, color=color, alpha=0.3, linewidth=1, linestyle=style)
            axis.plot(steps, running_mean(values), color=color, linewidth=2, linestyle=style, label=name)
        axis.set_title(title, fontsize=10)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def relative_change(new: float, old: float) -> float:
    return (new - old) / old if old and not math.isnan(old) and not math.isnan(new) else math.nan


def markdown(initial: dict, evals: dict[str, dict], histories: dict[str, list[dict]]) -> tuple[str, dict]:
    off, on = evals["shaping off"], evals["shaping on"]
    position_change = relative_change(on["mean_first_call_position"], off["mean_first_call_position"])
    accuracy_points = 100 * (on["accuracy"] - off["accuracy"])
    comparison = {
        "first_call_position_relative_change": position_change,
        "accuracy_difference_points": accuracy_points,
        "tool_call_rate_difference_points": 100 * (on["tool_call_rate"] - off["tool_call_rate"]),
        "target_met": position_change <= -TARGET_POSITION_DROP and accuracy_points >= -TARGET_ACCURACY_POINTS,
    }

    def cell(value: float, fmt: str) -> str:
        return "n/a" if value is None or math.isnan(value) else fmt.format(value)

    rows = [
        (
            "held-out mean first-call position (tokens)",
            "mean_first_call_position",
            "{:.3f}",
            cell(position_change, "{:+.1%}"),
        ),
        ("held-out accuracy", "accuracy", "{:.1%}", cell(accuracy_points, "{:+.1f} pts")),
        (
            "held-out tool-call rate",
            "tool_call_rate",
            "{:.1%}",
            cell(comparison["tool_call_rate_difference_points"], "{:+.1f} pts"),
        ),
        ("held-out pass@k", "pass_at_k", "{:.1%}", ""),
        ("held-out calls per completion", "calls_per_completion", "{:.2f}", ""),
        ("held-out interactive turns per completion", "interactive_turns_per_completion", "{:.2f}", ""),
        ("held-out accuracy when calling", "accuracy_with_call", "{:.1%}", ""),
    ]
    lines = ["| metric | initial | shaping off | shaping on | on vs off |", "|---|---:|---:|---:|---:|"]
    for label, key, fmt, change in rows:
        lines.append(
            f"| {label} | {cell(initial[key], fmt)} | {cell(off[key], fmt)} | {cell(on[key], fmt)} | {change} |"
        )
    for key, label in (("tools/first_call_position", "train first-call position"), ("reward", "train reward")):
        values = [tail_mean(histories[name], key) for name in RUNS]
        lines.append(f"| {label} (last 10 steps) | | {cell(values[0], '{:.3f}')} | {cell(values[1], '{:.3f}')} | |")
    verdict = "met" if comparison["target_met"] else "not met"
    lines.append(
        f"\nTarget (first-call position >= {TARGET_POSITION_DROP:.0%} lower, accuracy <= {TARGET_ACCURACY_POINTS:g} "
        f"points lower, shaping on vs off): **{verdict}**."
    )
    return "\n".join(lines), comparison


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    start = time.perf_counter()
    train_dataset = make_dataset("train", args.train_problems, seed=args.seed)
    test_dataset = make_dataset("test", args.eval_problems, seed=args.seed)

    start_model, tokenizer = load_model_and_tokenizer(args.model, device)
    initial = evaluate(start_model, tokenizer, test_dataset, args, "the initial checkpoint")
    evals, histories = {}, {}
    for name, shaping in RUNS.items():
        model, histories[name] = train(name, shaping, args, train_dataset, start_model, tokenizer, device)
        evals[name] = evaluate(model, tokenizer, test_dataset, args, name)
    table, comparison = markdown(initial, evals, histories)
    minutes = (time.perf_counter() - start) / 60

    header = (
        f"## Tool-position shaping on vs off: {args.model}, {args.steps} steps x {args.num_prompts} prompts x "
        f"{args.num_generations} completions, lr {args.learning_rate:g}, seed {args.seed}; held-out "
        f"{args.eval_problems} problems x {args.eval_samples} at temperature {args.eval_temperature:g} "
        f"({minutes:.1f} min)\n"
    )
    print(f"\n{header}\n{table}\n")
    plot(histories, args.output_dir / "compare_tool_shaping.png")
    results = {
        "settings": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
        "initial": initial,
        "runs": {name: {"evaluation": evals[name], "history": histories[name]} for name in RUNS},
        "comparison": comparison,
        "minutes": minutes,
    }
    (args.output_dir / "results.json").write_text(json.dumps(json_ready(results), indent=2) + "\n")
    (args.output_dir / "results.md").write_text(f"{header}\n{table}\n")
    print(f"Plot, results.json and results.md written to {args.output_dir}.")


if __name__ == "__main__":
    main()
