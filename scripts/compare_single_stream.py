"""Evidence for single-stream training (issue 6): SPO++ with one completion per prompt versus TRL's group baseline.

    python scripts/compare_single_stream.py [--steps 80] [--group_sizes 4 8] [--learning_rate 1e-4] [--output_dir DIR]

Every run starts from the same warm-started checkpoint, uses the same seed, optimizer and loss, and generates the same
number of completions per step (`--completions_per_step`, 32 by default), so all runs cost the same generation budget:

- "spo++ 32x1": `advantage_estimator="spo++"`, one completion for each of 32 prompts per step, advantage R - v with
  the per-prompt value v tracked across steps (action-token normalization);
- "group 4x8" (and "group 8x4" with `--group_sizes 4 8`): TRL's group baseline, 32/G prompts with G completions each.

The training split is small on purpose (`--train_problems`, 128 by default): the tracker only helps on prompts it has
seen before, and with a small split every run sees each prompt about equally often (32 x steps / 128 completions per
prompt, whatever the layout). Tools are on (the calculator, one tool round). With the defaults (80 steps, two runs) it
took 11 minutes on two CPU cores shared with another training job.

Reported per run: the reward-curve area (mean training reward over all steps), the final held-out accuracy
(`trl_aspo.evaluation.evaluate_tool_use` with the trainer's tool loop; greedy and, by default, also sampled at
temperature 1), and the share of completions whose advantage is zero after baseline and normalization (under the group
baseline: the completions of all-correct or all-wrong groups, compute that teaches nothing). Prints a markdown table
and writes `results.json`, `results.md` and `compare_single_stream.png` (reward and zero-advantage share per step) to
`--output_dir`. It reports what it measures; nothing is tuned to a target.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from transformers.trainer_callback import ProgressCallback

from trl_aspo import ASPOConfig, ASPOTrainer
from trl_aspo.builtin import TINY_CALCULATOR, load_builtin
from trl_aspo.builtin.task import calculator, correctness_reward, make_dataset
from trl_aspo.evaluation import evaluate_tool_use
from trl_aspo.progress import MetricProgressCallback

SINGLE_STREAM = "spo++"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=TINY_CALCULATOR, help="built-in starting model (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=80, help="optimizer steps (= generation rounds) per run")
    parser.add_argument(
        "--completions_per_step", type=int, default=32, help="generated completions per step, all runs"
    )
    parser.add_argument(
        "--group_sizes", type=int, nargs="+", default=[8], help="completions per prompt of the group-baseline runs"
    )
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument("--max_completion_length", type=int, default=48)
    parser.add_argument("--max_tool_calling_iterations", type=int, default=1)
    parser.add_argument(
        "--prioritized_sampling", action="store_true", help="spo++ run: draw prompts by sqrt(v(1-v)) + 0.05"
    )
    parser.add_argument("--train_problems", type=int, default=128, help="size of the training split")
    parser.add_argument("--eval_problems", type=int, default=200, help="held-out problems")
    parser.add_argument(
        "--eval_samples",
        type=int,
        default=2,
        help="completions per held-out problem of the sampled (temperature 1) evaluation; 0 = greedy only",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: the tiny model gains nothing from more, and on shared cores they contend)",
    )
    parser.add_argument("--output_dir", type=Path, default=Path("outputs/compare_single_stream"))
    args = parser.parse_args()
    for name in ("steps", "completions_per_step", "max_completion_length", "train_problems", "eval_problems"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.eval_samples < 0:
        parser.error("--eval_samples must be >= 0")
    if args.threads < 1:
        parser.error("--threads must be >= 1")
    for group in args.group_sizes:
        if group < 2 or args.completions_per_step % group:
            parser.error(f"--group_sizes: {group} must be >= 2 and divide --completions_per_step")
    if args.completions_per_step > args.train_problems:
        parser.error("--completions_per_step (prompts per step of the spo++ run) exceeds --train_problems")
    return args


def run_names(args: argparse.Namespace) -> dict[str, int]:
    """Run label -> completions per prompt (1 = the single-stream run)."""
    n = args.completions_per_step
    runs = {f"{SINGLE_STREAM} {n}x1": 1}
    runs.update({f"group {n // group}x{group}": group for group in sorted(set(args.group_sizes), reverse=True)})
    return runs


def train(name: str, group: int, args: argparse.Namespace, dataset, device: str) -> tuple[Any, Any, list[dict]]:
    """Train one run from the starting checkpoint; return the model, its tokenizer and the per-step logs."""
    model, tokenizer = load_builtin(args.model)
    single = group == 1
    config = ASPOConfig(
        output_dir=str(args.output_dir / name.replace(" ", "_")),
        per_device_train_batch_size=args.completions_per_step,
        num_generations=group,
        advantage_estimator=SINGLE_STREAM if single else "group",
        prioritized_sampling=single and args.prioritized_sampling,
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
    )
    trainer = ASPOTrainer(
        model.to(device),
        [correctness_reward],
        config,
        train_dataset=dataset,
        processing_class=tokenizer,
        tools=[calculator],
    )
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(MetricProgressCallback(name, {"reward": "reward", "zero_adv": "zero_advantage_share"}))
    trainer.train()
    history = [row for row in trainer.state.log_history if "reward" in row]
    return trainer.model, tokenizer, history


def evaluate(model, tokenizer, dataset, args: argparse.Namespace, label: str) -> dict[str, dict[str, Any]]:
    """Held-out accuracy and tool statistics with the trainer's tool loop: greedy (one completion per problem) and,
    unless `--eval_samples 0`, sampled at temperature 1 (the policy training samples from; a warm start whose most
    likely path skips the tool can score 0 greedily while its sampled policy already solves problems)."""
    settings = {"greedy": (1, 0.0)}
    if args.eval_samples:
        settings["sampled"] = (args.eval_samples, 1.0)
    results = {}
    for mode, (samples, temperature) in settings.items():
        print(f"evaluating {label} on {len(dataset)} held-out problems x {samples} ({mode})")
        summary = evaluate_tool_use(
            model,
            tokenizer,
            dataset,
            correctness_reward,
            [calculator],
            num_samples=samples,
            temperature=temperature,
            max_completion_length=args.max_completion_length,
            max_tool_calls=args.max_tool_calling_iterations,
            seed=args.seed,
        )
        summary.pop("records")
        results[mode] = summary
    return results


def curve(history: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(row["step"], row[key]) for row in history if row.get(key) is not None]
    return [step for step, _ in points], [value for _, value in points]


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def running_mean(values: list[float], window: int = 5) -> list[float]:
    """Trailing mean over `window` steps: one step's reward, from 32 completions, is noisy."""
    return [mean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def plot(histories: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("reward", "training reward (5-step running mean)"), ("zero_advantage_share", "zero-advantage share"))
    figure, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.6))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for axis, (key, title) in zip(axes, panels, strict=True):
        for color, (name, history) in zip(colors, histories.items(), strict=False):
            steps, values = curve(history, key)
            if key == "reward":
                axis.plot(steps, values, color=color, alpha=0.25, linewidth=1)
                values = running_mean(values)
            axis.plot(steps, values, color=color, linewidth=2, label=name)
        axis.set_title(title, fontsize=10)
        axis.set_xlabel("step (equal completions per step)")
        axis.grid(alpha=0.3)
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def heldout(evaluation: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The held-out numbers of the table; sampled ones are NaN when the sampled evaluation was skipped."""
    sampled = evaluation.get("sampled", {})
    return {
        "heldout_accuracy": evaluation["greedy"]["accuracy"],
        "heldout_tool_call_rate": evaluation["greedy"]["tool_call_rate"],
        "heldout_accuracy_sampled": sampled.get("accuracy", math.nan),
        "heldout_tool_call_rate_sampled": sampled.get("tool_call_rate", math.nan),
    }


def summarize(history: list[dict], evaluation: dict[str, dict[str, Any]], seconds: float) -> dict[str, float]:
    return {
        "reward_curve_area": mean(curve(history, "reward")[1]),
        "final_reward_last_10": mean(curve(history, "reward")[1][-10:]),
        "zero_advantage_share": mean(curve(history, "zero_advantage_share")[1]),
        **heldout(evaluation),
        "train_minutes": seconds / 60,
    }


def markdown(initial: dict[str, dict[str, Any]], summaries: dict[str, dict[str, float]]) -> str:
    def cell(value: float, fmt: str) -> str:
        return "n/a" if value is None or math.isnan(value) else fmt.format(value)

    rows = (
        ("reward-curve area (mean training reward over steps)", "reward_curve_area", "{:.3f}"),
        ("training reward, last 10 steps", "final_reward_last_10", "{:.3f}"),
        ("zero-advantage share of completions", "zero_advantage_share", "{:.1%}"),
        ("held-out accuracy (greedy)", "heldout_accuracy", "{:.1%}"),
        ("held-out tool-call rate (greedy)", "heldout_tool_call_rate", "{:.1%}"),
        ("held-out accuracy (sampled, T=1)", "heldout_accuracy_sampled", "{:.1%}"),
        ("held-out tool-call rate (sampled, T=1)", "heldout_tool_call_rate_sampled", "{:.1%}"),
        ("training time (min)", "train_minutes", "{:.1f}"),
    )
    names = list(summaries)
    lines = [f"| metric | initial | {' | '.join(names)} |", "|---|---:|" + "---:|" * len(names)]
    initial_cells = heldout(initial)
    for label, key, fmt in rows:
        values = " | ".join(cell(summaries[name][key], fmt) for name in names)
        lines.append(f"| {label} | {cell(initial_cells.get(key, math.nan), fmt)} | {values} |")
    return "\n".join(lines)


def json_ready(value: Any) -> Any:
    """NaN becomes null and paths strings, so the file is strict JSON."""
    if isinstance(value, dict):
        return {str(key): json_ready(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_ready(item) for item in value]
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, Path):
        return str(value)
    return value


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    start = time.perf_counter()
    train_dataset = make_dataset("train", args.train_problems, seed=args.seed)
    test_dataset = make_dataset("test", args.eval_problems, seed=args.seed)

    model, tokenizer = load_builtin(args.model)
    initial = evaluate(model.to(device), tokenizer, test_dataset, args, "the initial checkpoint")
    histories, evaluations, summaries = {}, {}, {}
    for name, group in run_names(args).items():
        run_start = time.perf_counter()
        model, tokenizer, histories[name] = train(name, group, args, train_dataset, device)
        seconds = time.perf_counter() - run_start
        evaluations[name] = evaluate(model, tokenizer, test_dataset, args, name)
        summaries[name] = summarize(histories[name], evaluations[name], seconds)
    minutes = (time.perf_counter() - start) / 60

    header = (
        f"## Single stream vs group baseline: {args.model}, {args.steps} steps x {args.completions_per_step} "
        f"completions, lr {args.learning_rate:g}, {args.train_problems} training problems, seed {args.seed}, "
        f"prioritized sampling {'on' if args.prioritized_sampling else 'off'}; held-out {args.eval_problems} "
        f"problems, greedy and {args.eval_samples} sampled at T=1 ({minutes:.1f} min)\n"
    )
    table = markdown(initial, summaries)
    print(f"\n{header}\n{table}\n")
    plot(histories, args.output_dir / "compare_single_stream.png")
    results = {
        "settings": vars(args),
        "initial": initial,
        "runs": {
            name: {"summary": summaries[name], "evaluation": evaluations[name], "history": histories[name]}
            for name in summaries
        },
        "minutes": minutes,
    }
    (args.output_dir / "results.json").write_text(json.dumps(json_ready(results), indent=2) + "\n")
    (args.output_dir / "results.md").write_text(f"{header}\n{table}\n")
    print(f"Plot, results.json and results.md written to {args.output_dir}.")


if __name__ == "__main__":
    main()
