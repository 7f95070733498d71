"""Rebuild the shipped `builtin:tiny-calculator` checkpoint, reproducibly (seeded), on CPU in about 10 minutes.

    python scripts/build_tiny_calculator.py [--output DIR] [--steps N] [--eval-problems N]

Trains a tiny Qwen2 from scratch with the supervised warm start of `trl_aspo.builtin.warmstart`, saves it (bf16
safetensors, a few MB, plus the tokenizer) and prints its held-out tool-use metrics, measured on the saved checkpoint
exactly as it will be loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
from transformers import Qwen2ForCausalLM

from trl_aspo.builtin.model import CHECKPOINT_DIR, build_random_model
from trl_aspo.builtin.task import calculator, correctness_reward, make_dataset
from trl_aspo.builtin.tokenizer import build_tokenizer, load_tokenizer
from trl_aspo.builtin.warmstart import WarmStartConfig, init_number_embeddings, warm_start
from trl_aspo.evaluation import evaluate_tool_use

MODEL_SHAPE = {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "num_kv_heads": 4, "intermediate_size": 256}


def main() -> None:
    defaults = WarmStartConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=CHECKPOINT_DIR)
    parser.add_argument("--eval-problems", type=int, default=400, help="held-out problems for the final metrics")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest on a busy 2-core box)")
    for field in dataclasses.fields(WarmStartConfig):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(getattr(defaults, field.name)))
    args = parser.parse_args()
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(WarmStartConfig)}
    config = dataclasses.replace(defaults, **{k: v for k, v in overrides.items() if v is not None})
    torch.set_num_threads(args.threads)

    start = time.perf_counter()
    tokenizer = build_tokenizer()
    model = build_random_model(tokenizer, seed=config.seed, **MODEL_SHAPE)
    init_number_embeddings(model, tokenizer, seed=config.seed)
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters; warm start: {config}")
    losses = warm_start(model, tokenizer, config)
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
        max_completion_length=64,
    )
    summary = {k: v for k, v in metrics.items() if k != "records"}
    size = sum(f.stat().st_size for f in args.output.iterdir() if f.is_file())
    print(f"final loss (mean of last 50 steps): {sum(losses[-50:]) / len(losses[-50:]):.4f}")
    print(f"train time: {train_seconds:.0f} s; checkpoint: {args.output} ({size / 2**20:.1f} MiB)")
    print("held-out metrics (temperature 1.0, max_completion_length 64):")
    print(json.dumps(summary, indent=2))
    for record in metrics["records"][:4]:
        print(f"--- reward {record['reward']}: {record['prompt'][0]['content']}\n{record['text']}")


if __name__ == "__main__":
    main()
