"""What the two build scripts of the shipped checkpoints share: flags from a warm-start config, and saving the model
(bf16) then measuring it reloaded exactly as it will be loaded."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import Qwen2ForCausalLM

from trl_aspo.builtin.tokenizer import load_tokenizer
from trl_aspo.evaluation.tool_use import evaluate_tool_use


def parse_build_args(description: str, config_class: type, default_output: Path) -> tuple[argparse.Namespace, object]:
    """`--output`, `--eval-problems`, `--threads` and one flag per field of `config_class` (a warm-start config
    dataclass); returns the arguments and the config with the flags given applied to its defaults."""
    defaults = config_class()
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=default_output)
    parser.add_argument("--eval-problems", type=int, default=400, help="held-out problems for the final metrics")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest on a busy 2-core box)")
    fields = dataclasses.fields(config_class)
    for field in fields:
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(getattr(defaults, field.name)))
    args = parser.parse_args()
    given = {field.name: getattr(args, field.name) for field in fields if getattr(args, field.name) is not None}
    return args, dataclasses.replace(defaults, **given)


def save_and_report(
    model,
    tokenizer,
    output: Path,
    losses: list[float],
    train_seconds: float,
    heldout,
    reward: Callable,
    tools: list[Callable],
    max_completion_length: int,
    max_tool_calls: int | None = None,
    examples: int = 4,
) -> None:
    """Save `model` in bf16 (half the shipped size) with its tokenizer, reload it in float32 and print its held-out
    tool-use metrics on `heldout` at temperature 1, so the numbers include the bf16 rounding, then a few examples."""
    output.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(output)
    tokenizer.save_pretrained(output)
    model = Qwen2ForCausalLM.from_pretrained(output, dtype=torch.float32)
    tokenizer = load_tokenizer(output)
    metrics = evaluate_tool_use(
        model,
        tokenizer,
        heldout,
        reward,
        tools,
        temperature=1.0,
        max_completion_length=max_completion_length,
        max_tool_calls=max_tool_calls,
    )
    summary = {key: value for key, value in metrics.items() if key != "records"}
    size = sum(path.stat().st_size for path in output.iterdir() if path.is_file())
    print(f"final loss (mean of last 50 steps): {sum(losses[-50:]) / len(losses[-50:]):.4f}")
    print(f"train time: {train_seconds:.0f} s; checkpoint: {output} ({size / 2**20:.1f} MiB)")
    calls = f", at most {max_tool_calls} calls" if max_tool_calls else ""
    print(f"held-out metrics (temperature 1.0, max_completion_length {max_completion_length}{calls}):")
    print(json.dumps(summary, indent=2))
    for record in metrics["records"][:examples]:
        print(f"--- reward {record['reward']}: {record['prompt'][0]['content']}\n{record['text']}")
