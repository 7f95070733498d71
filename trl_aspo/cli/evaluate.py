"""`trl-aspo evaluate`: held-out tool-use metrics of a model, with the tool loop the trainer uses.

    trl-aspo evaluate [--model builtin:tiny-calculator | builtin:tiny-multicall | builtin:smollm2-135m-instruct | DIR
                      | HUB_ID] [--config X.yaml]
                      [--num_samples k] [--temperature T] [--split test] [--limit N] [--output FILE.json] [--records]
                      [--key value ...]

`--config` takes the training YAML and evaluates exactly as its before/after summary does (`report.heldout_settings`):
the dataset (`dataset_name`, `builtin_test_size`, `builtin_seed`, ...), the reward (`reward_funcs`; the one named by
`tool_shaping_correct_reward`, else the first, decides correctness), the tools, `eval_samples_per_problem`,
`eval_temperature` and the generation budget (`max_completion_length`, `max_tool_calling_iterations`, `seed`).
`--num_samples` / `--temperature` and any training field given as `--key value` override the YAML, as in
`trl-aspo train`. Without `--config` the built-in task is evaluated: the calculator problems, the correctness reward
and the calculator tool (for `--model builtin:tiny-multicall`: the `builtin:multicall` problems and their one-operation
calculator; for `--model builtin:smollm2-135m-instruct` or its warm start `builtin:smollm2-135m-calculator`:
`builtin:calculator-chat`, the same problems with a system
message), one greedy sample per problem (temperature 1 for several).

Prints a table (accuracy avg@k, pass@k, tool-call rate, mean first-call position, calls per completion, interactive
turns) and writes it as JSON, by default to `<model dir>/evaluation.json` for a local model, else to
`outputs/<model name>/evaluation.json`.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import warnings
from pathlib import Path
from typing import Any

from trl_aspo.cli.command_line import check_command_line
from trl_aspo.cli.config_errors import ConfigurationError, report
from trl_aspo.cli.value_checks import missing_path_problem

# `trl_aspo.builtin.TINY_CALCULATOR`, `TINY_MULTICALL` and the SmolLM2 names, spelled out so that `--help` and the
# argument checks import no model code.
DEFAULT_MODEL = "builtin:tiny-calculator"
MULTICALL_MODEL = "builtin:tiny-multicall"
SMOLLM2_MODELS = ("builtin:smollm2-135m-instruct", "builtin:smollm2-135m-calculator")
PROG = "trl-aspo evaluate"
# Completions per problem: every completion's tokens, messages and record are held until the evaluation ends, so a
# count far beyond what avg@k / pass@k need (10^9 measured) runs the machine out of memory before anything is written.
MAX_NUM_SAMPLES = 10_000

# The training dataclasses validate mixed precision against the hardware; evaluation never trains, so parse them as
# a CPU run (placed before the user's flags, which still win).
_PARSE_AS_CPU = ["--use_cpu", "true", "--bf16", "false", "--fp16", "false"]

TABLE_ROWS = (
    ("accuracy (avg@{k})", "accuracy", "{:.1%}"),
    ("pass@{k}", "pass_at_k", "{:.1%}"),
    ("tool-call rate", "tool_call_rate", "{:.1%}"),
    ("mean first-call position (tokens)", "mean_first_call_position", "{:.2f}"),
    ("calls per completion", "calls_per_completion", "{:.2f}"),
    ("interactive turns per completion", "interactive_turns_per_completion", "{:.2f}"),
    ("accuracy when calling", "accuracy_with_call", "{:.1%}"),
    ("accuracy without a call", "accuracy_without_call", "{:.1%}"),
    ("mean completion length (action tokens)", "mean_completion_length", "{:.1f}"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trl-aspo evaluate",
        # Unknown flags go on to the training dataclasses; abbreviations would let one of them hit an option here.
        allow_abbrev=False,
        description="Held-out tool-use evaluation (accuracy avg@k / pass@k, tool-call rate, first-call position).",
        epilog="Any training field may follow as --key value (e.g. --max_completion_length 64); see `trl-aspo train "
        "--help`.",
    )
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="a local model directory (e.g. a training output_dir), a `builtin:` name or a hub id "
        "(default: %(default)s)",
    )
    parser.add_argument("--config", help="the training YAML naming the dataset, reward functions and tools")
    parser.add_argument(
        "--num_samples",
        type=int,
        help="completions per problem: k of avg@k and pass@k (default: the config's eval_samples_per_problem, else 1)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sampling temperature, 0 = greedy (default: the config's eval_temperature; without a config greedy for "
        "one sample, 1.0 for several)",
    )
    parser.add_argument("--split", help="dataset split (default: the held-out split, `dataset_test_split`)")
    parser.add_argument("--limit", type=int, help="evaluate only the first N problems of the split")
    parser.add_argument("--batch_size", type=int, default=64, help="completions generated together")
    parser.add_argument(
        "--success_threshold", type=float, default=0.5, help="a completion is correct when its reward is >= this"
    )
    parser.add_argument("--output", help="JSON file to write (default: see the module help)")
    parser.add_argument("--records", action="store_true", help="also write every completion to the JSON")
    return parser


def load_model_and_tokenizer(name: str, device) -> tuple[Any, Any]:
    """Load a `builtin:` model, a local directory (e.g. `trainer.save_model` output) or a hub id, for evaluation.

    Raises ValueError with a message naming `name` when nothing loadable is found there.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_aspo.builtin import is_builtin, is_builtin_tokenizer_dir, load_builtin, load_tokenizer

    if is_builtin(name):
        try:
            model, tokenizer = load_builtin(name)
        except FileNotFoundError as error:
            raise ValueError(str(error)) from None
        return model.to(device), tokenizer
    path = Path(name).expanduser()
    if not path.is_dir() and (path.is_absolute() or name.startswith((".", "~")) or name.count("/") > 1):
        raise ValueError(f"--model {name!r}: no such directory (and not a `builtin:` name or a hub id).")
    source = str(path) if path.is_dir() else name
    dtype = torch.float32 if torch.device(device).type == "cpu" else "auto"
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
        # The built-in tokenizer must not go through AutoTokenizer, which rebuilds it for qwen2 configs.
        tokenizer = load_tokenizer(path) if is_builtin_tokenizer_dir(path) else AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as error:
        where = (
            "the local directory"
            if path.is_dir()
            else "the Hugging Face Hub (there is no local directory of that name)"
        )
        raise ValueError(f"--model {name!r}: could not load a causal LM and tokenizer from {where}: {error}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device), tokenizer


def default_output(model: str) -> Path:
    from trl_aspo.builtin import is_builtin

    path = Path(model).expanduser()
    if not is_builtin(model) and path.is_dir():
        return path / "evaluation.json"
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", model.removeprefix("builtin:")).strip("-") or "model"
    return Path("outputs") / name / "evaluation.json"


def json_ready(value: Any) -> Any:
    """`value` with NaN (an undefined mean, e.g. the first-call position when nothing calls) as null: strict JSON."""
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {key: json_ready(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_ready(item) for item in value]
    return value


def write_results(output: Path, written: dict[str, Any]) -> bool:
    """Write the evaluation's JSON to `output`; whether it was written. On failure (a full disk, /dev/full, a folder
    that cannot be made) the evaluation is done already: its JSON goes to stdout rather than being lost, and stderr
    names the path and the error."""
    # `default=str` keeps the dump alive for tool results or dataset columns that JSON cannot represent.
    text = json.dumps(json_ready(written), indent=2, default=str) + "\n"
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text)
    except OSError as error:
        sys.stdout.write(text)
        print(
            f"{PROG}: could not write --output {str(output)!r}: {error}; the results are on stdout.", file=sys.stderr
        )
        return False
    return True


def format_table(metrics: dict[str, Any]) -> str:
    """A two-column markdown table of the summary metrics (n/a where a metric is undefined, e.g. no call)."""
    k = metrics["num_samples"]
    lines = ["| metric | value |", "|---|---:|"]
    for label, key, fmt in TABLE_ROWS:
        value = metrics.get(key)
        cell = fmt.format(value) if isinstance(value, int | float) and value == value else "n/a"
        lines.append(f"| {label.format(k=k)} | {cell} |")
    return "\n".join(lines)


def _select_split(script_args, dataset_args, split: str | None):
    """The evaluation split: the built-in task's `train`/`test`, or a named split of any other dataset."""
    from trl_aspo.builtin.registry import BUILTIN_DATASETS
    from trl_aspo.cli.parsers import load_datasets

    if script_args.dataset_name in BUILTIN_DATASETS:
        split = split or "test"
        if split not in ("train", "test"):
            raise ValueError(f"--split {split!r}: the built-in task has the splits 'train' and 'test'.")
        train, test = load_datasets(script_args, dataset_args)
        return split, train if split == "train" else test
    split = split or script_args.dataset_test_split
    script_args.dataset_test_split = split
    try:
        _, dataset = load_datasets(script_args, dataset_args)
    except KeyError as error:
        raise ValueError(f"dataset {script_args.dataset_name!r} has no split {error}.") from None
    if dataset is None:
        raise ValueError(f"--split {split!r}: dataset {script_args.dataset_name!r} has no such split.")
    return split, dataset


def main(argv: list[str]) -> int:
    # TRL 1.16 still calls transformers' renamed gradient-checkpointing API; the notices say nothing to a user.
    warnings.filterwarnings("ignore", message=r".*gradient_checkpointing.*deprecated", category=FutureWarning)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.num_samples is not None and args.num_samples < 1:
        parser.error(f"--num_samples must be >= 1, got {args.num_samples}")
    if args.num_samples is not None and args.num_samples > MAX_NUM_SAMPLES:
        parser.error(
            f"--num_samples must be <= {MAX_NUM_SAMPLES} (every completion is kept in memory until the end), got "
            f"{args.num_samples}"
        )
    if args.limit is not None and args.limit < 1:
        parser.error(f"--limit must be >= 1, got {args.limit}")
    if args.batch_size < 1:
        parser.error(f"--batch_size must be >= 1, got {args.batch_size}")
    if args.temperature is not None and not (math.isfinite(args.temperature) and args.temperature >= 0):
        parser.error(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if not math.isfinite(args.success_threshold):
        parser.error(
            f"--success_threshold must be a finite number (a reward >= it is a success), got {args.success_threshold}"
        )
    config_args = ["--config", args.config] if args.config else []
    try:
        problems = [missing_path_problem("--model", args.model)]
        try:
            config, trainer = check_command_line([*config_args, *rest])
        except ConfigurationError as error:
            problems += error.problems
        if any(problems):
            raise ConfigurationError([problem for problem in problems if problem])

        import torch

        from trl_aspo.algorithms.context_length import check_completion_budget, model_context_length
        from trl_aspo.builtin.registry import (
            BUILTIN_DATASET,
            BUILTIN_DATASETS,
            BUILTIN_REWARDS,
            CHAT_DATASET,
            MULTICALL_DATASET,
        )
        from trl_aspo.cli.parsers import make_parser
        from trl_aspo.cli.train import parse_checked, resolve_functions
        from trl_aspo.evaluation.report import correctness_reward, heldout_settings
        from trl_aspo.evaluation.tool_use import evaluate_tool_use

        # The config's `trainer` picks its config class, so an asynchronous run's YAML evaluates too.
        script_args, training_args, _, dataset_args = parse_checked(
            make_parser(prog=PROG, trainer=trainer), config, [*_PARSE_AS_CPU, *rest]
        )
        if args.config is None:
            # No config: the built-in task (the multi-call one for its model, the one with a system message for the
            # pretrained chat model), complete with its reward and tool.
            default_dataset = {MULTICALL_MODEL: MULTICALL_DATASET, **dict.fromkeys(SMOLLM2_MODELS, CHAT_DATASET)}.get(
                args.model, BUILTIN_DATASET
            )
            script_args.dataset_name = script_args.dataset_name or default_dataset
            if script_args.dataset_name in BUILTIN_DATASETS:
                script_args.reward_funcs = script_args.reward_funcs or list(BUILTIN_REWARDS)
                script_args.tools = script_args.tools or [BUILTIN_DATASETS[script_args.dataset_name][1]]
        reward_funcs, tools = resolve_functions(script_args)
        reward_fn = correctness_reward(reward_funcs, training_args)
    except ConfigurationError as error:
        report(PROG, error)
    except ValueError as error:
        report(PROG, ConfigurationError([str(error)]))
    # With a config, the run's own before/after settings (eval_samples_per_problem, eval_temperature); flags win.
    num_samples = args.num_samples or script_args.eval_samples_per_problem
    temperature = args.temperature
    if temperature is None:
        from_config = args.config is not None or any(word.startswith("--eval_temperature") for word in rest)
        temperature = script_args.eval_temperature if from_config or num_samples == 1 else 1.0
    try:
        split, dataset = _select_split(script_args, dataset_args, args.split)
        if args.limit is not None:
            dataset = dataset.select(range(min(args.limit, len(dataset))))
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model, tokenizer = load_model_and_tokenizer(args.model, device)
        context = model_context_length(model.config)
        check_completion_budget(training_args.max_completion_length, context, f"--model {args.model}'s config")
    except (ValueError, FileNotFoundError) as error:
        report(PROG, ConfigurationError([str(error)]))
    settings = heldout_settings(training_args, num_samples, temperature)
    print(
        f"Evaluating {args.model} on {script_args.dataset_name} [{split}]: {len(dataset)} problems x {num_samples} "
        f"sample(s), temperature {temperature}, max_completion_length {settings['max_completion_length']}, "
        f"max_tool_calling_iterations {settings['max_tool_calls']}, seed {settings['seed']}."
    )
    results = evaluate_tool_use(
        model,
        tokenizer,
        dataset,
        reward_fn,
        tools,
        batch_size=args.batch_size,
        success_threshold=args.success_threshold,
        **settings,
    )
    records = results.pop("records")
    written = {
        "model": args.model,
        "dataset": script_args.dataset_name,
        "split": split,
        "settings": {
            "num_samples": num_samples,
            "temperature": temperature,
            "limit": args.limit,
            "max_completion_length": training_args.max_completion_length,
            "max_tool_calling_iterations": training_args.max_tool_calling_iterations,
            "reward": reward_fn.__name__,
            "tools": [tool.__name__ for tool in tools],
            "success_threshold": args.success_threshold,
            "seed": training_args.seed,
        },
        "metrics": results,
    }
    if args.records:
        written["records"] = records

    output = Path(args.output) if args.output else default_output(args.model)
    if not write_results(output, written):
        return 1
    print(
        f"\n{args.model} on {script_args.dataset_name} [{split}], {results['num_problems']} problems x "
        f"{num_samples} sample(s), temperature {temperature}:\n{format_table(results)}\n\nWritten to {output}."
    )
    return 0
