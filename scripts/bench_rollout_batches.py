"""The cost of rollout batches and of the proximal policy: seconds per optimizer step of AsyncASPOTrainer with
`steps_per_rollout_batch` k = 2 and 4, under `proximal_policy` `recompute` and `loglinear`, against k = 1.

Every run trains the built-in tiny model with `loss_type: aspo` and the decoupled objective (`token_truncate`, at most
2) on the same stream of samples, which a worker hands out as fast as the trainer takes them (completions drawn once,
stamped with the trainer's current model version when taken), so the time measured is the trainer's own: fetching,
packing, scoring, the proximal forward of `recompute`, forward, backward and optimizer step. A step's seconds are
the time between the ends of consecutive optimizer steps; the first `--warmup` steps are left out, and `--steps -
--warmup` must be a multiple of 4 so every variant's window holds whole rollout batches. Each run is a fresh Python
process; runs are interleaved (k1, k2 recompute, k2 loglinear, ... then again) so load changes hit all alike; the
number per variant is the median over repeats of the window's mean seconds per step, and its ratio to k = 1's;
`paired` is the median over repeats of each run's ratio to the k = 1 run of the same repeat (what load drift between
repeats cancels out of), with its range.

    python scripts/bench_rollout_batches.py [--steps 20] [--warmup 4] [--repeats 5] [--batch 16] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = {
    "k=1": {},
    "k=2 recompute": {"steps_per_rollout_batch": 2, "proximal_policy": "recompute"},
    "k=2 loglinear": {"steps_per_rollout_batch": 2, "proximal_policy": "loglinear"},
    "k=4 recompute": {"steps_per_rollout_batch": 4, "proximal_policy": "recompute"},
    "k=4 loglinear": {"steps_per_rollout_batch": 4, "proximal_policy": "loglinear"},
}


def stream(model, tokenizer, prompts, batch: int, length: int, seed: int = 0):
    """`4 * batch` samples, two per group: each prompt with a random completion of `length` tokens, the generator's
    log-probs the policy's plus N(0, 0.1^2) noise, advantages N(0, 1)."""
    import numpy as np
    import torch
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    generator = torch.Generator().manual_seed(seed)
    samples = []
    for index in range(4 * batch):
        prompt = prompts[(index // 2) % len(prompts)]
        prompt_ids = list(
            tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
        )
        completion = torch.randint(5, tokenizer.vocab_size - 5, (length,), generator=generator).tolist()
        ids = torch.tensor([prompt_ids + completion])
        with torch.no_grad():
            logps = model(ids).logits[0, :-1].log_softmax(-1).gather(1, ids[0, 1:, None])[:, 0]
        noisy = logps[-length:] + 0.1 * torch.randn(length, generator=generator)
        samples.append(
            RolloutSample(
                prompt=prompt,
                completion=[{"role": "assistant", "content": tokenizer.decode(completion)}],
                input_ids=ids[0].numpy(),
                completion_mask=np.asarray([0] * len(prompt_ids) + [1] * length, dtype=np.int64),
                old_log_probs=np.asarray([0.0] * len(prompt_ids) + noisy.tolist(), dtype=np.float32),
                advantage=float(torch.randn(1, generator=generator)),
                model_version=0,
                group_id=index // 2,
                metrics={"reward": 0.5, "reward_std": 0.0},
            )
        )
    return samples


def measure(variant: str, steps: int, warmup: int, batch: int, output_dir: str) -> float:
    """Mean seconds per optimizer step over steps `warmup + 1 .. steps` of one run."""
    from transformers import AutoModelForCausalLM, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl.chat_template_utils import add_response_schema

    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer
    from trl_aspo.builtin import CHECKPOINT_DIR, load_tokenizer
    from trl_aspo.builtin.task import correctness_reward, make_dataset
    from trl_aspo.infra import NoOpWeightTransfer, ReplayRolloutWorker, install_cpu_fallbacks

    install_cpu_fallbacks()
    model_path = str(CHECKPOINT_DIR)
    tokenizer = add_response_schema(load_tokenizer(CHECKPOINT_DIR))
    dataset = make_dataset("train", 64, seed=0)
    samples = stream(AutoModelForCausalLM.from_pretrained(model_path), tokenizer, dataset["prompt"], batch, 48)
    args = AsyncASPOConfig(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=batch,
        max_completion_length=64,
        num_generations=2,
        token_budget=0,
        max_staleness=8,
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        loss_type="aspo",
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_max=2.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
        **VARIANTS[variant],
    )
    ends = []

    class StepEnds(TrainerCallback):
        def on_step_end(self, *_, **__):
            ends.append(time.perf_counter())

    trainer = AsyncASPOTrainer(
        model_path,
        reward_funcs=correctness_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        rollout_worker=ReplayRolloutWorker(samples, cycle=True, restamp_version=True),
        weight_transfer=NoOpWeightTransfer(),
        callbacks=[StepEnds()],
    )
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return (ends[-1] - ends[warmup - 1]) / (steps - warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.warmup < 1 or (options.steps - options.warmup) <= 0 or (options.steps - options.warmup) % 4:
        parser.error("--steps minus --warmup must be a positive multiple of 4, and --warmup at least 1")
    if options.variant is not None:
        import torch

        torch.set_num_threads(options.threads)
        with tempfile.TemporaryDirectory() as output_dir:
            seconds = measure(options.variant, options.steps, options.warmup, options.batch, output_dir)
        print(json.dumps(seconds))
        return
    load_start = os.getloadavg()[0]
    runs: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    for repeat in range(options.repeats):
        for variant in VARIANTS:
            command = [sys.executable, __file__, "--variant", variant, "--threads", str(options.threads)]
            command += ["--steps", str(options.steps), "--warmup", str(options.warmup), "--batch", str(options.batch)]
            env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", "TRANSFORMERS_VERBOSITY": "error"}
            done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
            runs[variant].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(
                f"repeat {repeat + 1}/{options.repeats} {variant}: {runs[variant][-1] * 1000:.1f} ms/step", flush=True
            )
    base = statistics.median(runs["k=1"])
    print(
        f"\n{options.batch} samples x 48 completion tokens per optimizer step, {options.threads} thread(s), "
        f"steps {options.warmup + 1}-{options.steps}, median of {options.repeats} interleaved runs; "
        f"load {load_start:.2f} at start, {os.getloadavg()[0]:.2f} at end"
    )
    print(f"{'variant':<16}{'ms / step':>12}{'vs k=1':>10}{'paired':>10}{'paired range':>16}{'spread (ms)':>16}")
    for variant, values in runs.items():
        median = statistics.median(values)
        paired = [value / reference for value, reference in zip(values, runs["k=1"], strict=True)]
        spread = f"{min(values) * 1000:.1f}-{max(values) * 1000:.1f}"
        paired_range = f"{min(paired):.3f}-{max(paired):.3f}"
        print(
            f"{variant:<16}{median * 1000:>12.1f}{median / base:>9.3f}x{statistics.median(paired):>9.3f}x"
            f"{paired_range:>16}{spread:>16}"
        )


if __name__ == "__main__":
    main()
