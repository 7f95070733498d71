"""Rebuild the shipped `builtin:tiny-multicall` checkpoint, reproducibly (seeded), on one CPU core.

    python scripts/build_tiny_multicall.py [--output DIR] [--steps N] [--eval-problems N]

Starts from the shipped `builtin:tiny-calculator` weights (same model shape and tokenizer; it already copies numbers
into a call and into the answer), runs the supervised multi-call warm start of `warmstart.multicall`,
saves the model (bf16 safetensors, a few MB, plus the tokenizer) and prints its held-out tool-use metrics on
`builtin:multicall`'s test split, measured on the saved checkpoint exactly as it will be loaded.
"""

from __future__ import annotations

import time

import torch
from warmstart.build import parse_build_args, save_and_report
from warmstart.multicall import MultiCallWarmStartConfig, warm_start_multicall

from trl_aspo.builtin.model import MULTICALL_CHECKPOINT_DIR, TINY_CALCULATOR, load_builtin
from trl_aspo.builtin.multicall import calculator, correctness_reward, make_dataset

# Fits four calls with a preamble: the budget `configs/experiments/multicall_*.yaml` train with.
MAX_COMPLETION_LENGTH = 128
MAX_TOOL_CALLS = 4


def main() -> None:
    args, config = parse_build_args(__doc__, MultiCallWarmStartConfig, MULTICALL_CHECKPOINT_DIR)
    torch.set_num_threads(args.threads)

    start = time.perf_counter()
    model, tokenizer = load_builtin(TINY_CALCULATOR)
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters from {TINY_CALCULATOR}; {config}")
    losses = warm_start_multicall(model, tokenizer, config)
    save_and_report(
        model,
        tokenizer,
        args.output,
        losses,
        time.perf_counter() - start,
        make_dataset("test", args.eval_problems, seed=0),
        correctness_reward,
        [calculator],
        MAX_COMPLETION_LENGTH,
        MAX_TOOL_CALLS,
        examples=6,
    )


if __name__ == "__main__":
    main()
