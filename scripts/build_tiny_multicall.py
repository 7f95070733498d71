"""Rebuild the shipped `builtin:tiny-multicall` checkpoint, reproducibly (seeded), on one CPU core.

    python scripts/build_tiny_multicall.py [--output DIR] [--steps N] [--eval-problems N]

Starts from the shipped `builtin:tiny-calculator` weights (same model shape and tokenizer; it already copies numbers
into a call and into the answer), runs the supervised multi-call warm start of `trl_aspo.builtin.multicall_warmstart`,
saves the model (bf16 safetensors, a few MB, plus the tokenizer) and prints its held-out tool-use metrics on
`builtin:multicall`'s test split, measured on the saved checkpoint exactly as it will be loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
from transformers import Qwen2ForCausalLM

from trl_aspo.builtin.model import MULTICALL_CHECKPOINT_DIR, TINY_CALCULATOR, load_builtin
from trl_aspo.builtin.multicall import calculator, correctness_reward, make_dataset
from trl_aspo.builtin.multicall_warmstart import MultiCallWarmStartConfig, warm_start_multicall
from trl_aspo.builtin.tokenizer import load_tokenizer
from trl_aspo.evaluation import evaluate_tool_use

# Fits four calls with a preamble: the budget `configs/experiments/multicall_*.yaml` train with.
MAX_COMPLETION_LENGTH = 128
MAX_TOOL_CALLS = 4


def main() -> None:
    defaults = MultiCallWarmStartConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=MULTICALL_CHECKPOINT_DIR)
    parser.add_argument("--eval-problems", type=int, default=400, help="held-out problems for the final metrics")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest on a busy 2-core box)")
    for field in dataclasses.fields(MultiCallWarmStartConfig):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(getattr(defaults, field.name)))
    args = parser.parse_args()
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(MultiCallWarmStartConfig)}
    config = dataclasses.replace(defaults, **{k: v for k, v in overrides.items() if v is not None})
    torch.set_num_threads(args.threads)

    start = time.perf_counter()
    model, tokenizer = load_builtin(TINY_CALCULATOR)
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters from {TINY_CALCULATOR}; {config}")
    losses = warm_start_multicall(model, tokenizer, config)
    train_seconds = time.perf_counter() - start

    # bf16 halves the shipped size; metrics below are measured on the reloaded checkpoint, so they include its effect.
    args.output.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(args.output)
    tokenizer.save_pretrained(args.output)
    model = Qwen2ForCausalLM.from_pretrained(args.output, dtype=torch.float32)
    tokenizer = load_tokenizer(args.output)

    metrics = evaluate_tool_use(
        model,
        tokenizer,
        make_dataset("test", args.eval_problems, seed=0),
        correctness_reward,
        [calculator],
        temperature=1.0,
        max_completion_length=MAX_COMPLETION_LENGTH,
        max_tool_calls=MAX_TOOL_CALLS,
    )
    summary = {k: v for k, v in metrics.items() if k != "records"}
    size = sum(f.stat().st_size for f in args.output.iterdir() if f.is_file())
    print(f"final loss (mean of last 50 steps): {sum(losses[-50:]) / len(losses[-50:]):.4f}")
    print(f"train time: {train_seconds:.0f} s; checkpoint: {args.output} ({size / 2**20:.1f} MiB)")
    print(
        f"held-out metrics (temperature 1.0, max_completion_length {MAX_COMPLETION_LENGTH}, {MAX_TOOL_CALLS} calls):"
    )
    print(json.dumps(summary, indent=2))
    for record in metrics["records"][:6]:
        print(f"--- reward {record['reward']}: {record['prompt'][0]['content']}\n{record['text']}")


if __name__ == "__main__":
    main()
