"""Rebuild the shipped `builtin:tiny-calculator` checkpoint, reproducibly (seeded), on CPU in about 10 minutes.

    python scripts/build_tiny_calculator.py [--output DIR] [--steps N] [--eval-problems N]

Trains a tiny Qwen2 from scratch with the supervised warm start of `warmstart.calculator`, saves it (bf16
safetensors, a few MB, plus the tokenizer) and prints its held-out tool-use metrics, measured on the saved checkpoint
exactly as it will be loaded.
"""

from __future__ import annotations

import time

import torch
from warmstart.build import parse_build_args, save_and_report
from warmstart.calculator import WarmStartConfig, init_number_embeddings, warm_start

from trl_aspo.builtin.model import CHECKPOINT_DIR, build_random_model
from trl_aspo.builtin.task import calculator, correctness_reward, make_dataset
from trl_aspo.builtin.tokenizer import build_tokenizer

MODEL_SHAPE = {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "num_kv_heads": 4, "intermediate_size": 256}


def main() -> None:
    args, config = parse_build_args(__doc__, WarmStartConfig, CHECKPOINT_DIR)
    torch.set_num_threads(args.threads)

    start = time.perf_counter()
    tokenizer = build_tokenizer()
    model = build_random_model(tokenizer, seed=config.seed, **MODEL_SHAPE)
    init_number_embeddings(model, tokenizer, seed=config.seed)
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters; warm start: {config}")
    losses = warm_start(model, tokenizer, config)
    save_and_report(
        model,
        tokenizer,
        args.output,
        losses,
        time.perf_counter() - start,
        make_dataset("test", args.eval_problems, seed=0),
        correctness_reward,
        [calculator],
        max_completion_length=64,
    )


if __name__ == "__main__":
    main()
