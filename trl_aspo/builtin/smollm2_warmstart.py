"""`builtin:smollm2-135m-calculator`: `builtin:smollm2-135m-instruct` warm-started to use the calculator tool.

The untrained model never calls the tool by itself, so RL has no call to reinforce. A short supervised fine-tuning
(TRL's `SFTTrainer`, full fine-tuning in float32) on transcripts of the built-in calculator task teaches the format:
the system message and question of `builtin:calculator-chat`, then an assistant turn (a preamble and one calculator
call), the tool's result, and "The answer is N.". The transcripts are rendered by TRL's Qwen2.5 template, so the call
follows its text after "\\n", which is also how TRL's asynchronous worker renders a turn again (a call right after
'.' would come back as other ids there). Problems are drawn from the training split only.

Built on first use (or by `make smollm2-warmstart`) into the cache beside the converted model, under the same lock
and staging rename (trl_aspo.builtin.smollm2.build_once), in a folder named after the conversion and the SFT
settings: changing `WARMSTART` builds a new one.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import time
from pathlib import Path

import trl_aspo.builtin.smollm2 as smollm2
from trl_aspo.builtin.task import OPERATIONS, PREAMBLES, SYSTEM_MESSAGE, make_problems, solve

NAME = "builtin:smollm2-135m-calculator"
# The SFT's sizes (docs/smollm2.md has their measured time): 32 transcripts, 101 s on the quiet 2-core machine (23 min
# at load 7). The loss falls from 2.3 to about 0.2; sampled at temperature 1, the result calls the tool on 98% of the
# held-out problems.
WARMSTART = {"steps": 16, "batch_size": 2, "learning_rate": 1e-4, "seed": 0}


def warmstart_dir(settings: dict | None = None) -> Path:
    settings = settings or WARMSTART
    key = "-".join(
        f"{name}{value:g}" if isinstance(value, float) else f"{name}{value}" for name, value in settings.items()
    )
    return smollm2.converted_dir().with_name(
        smollm2.converted_dir().name.replace("instruct", "calculator") + f"-{key}"
    )


def transcripts(count: int, seed: int):
    """`count` conversational prompt/completion rows of the built-in task's training problems, with the tool schema."""
    from datasets import Dataset
    from transformers.utils import get_json_schema

    from trl_aspo.builtin.task import QUESTION_TEMPLATE, calculator

    rng = random.Random(seed)
    problems = make_problems("train", count, seed=seed, operations=tuple(OPERATIONS))
    rows = {"prompt": [], "completion": [], "tools": []}
    schema = json.dumps([get_json_schema(calculator)])
    for a, op, b in problems:
        call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": f"{a}{op}{b}"}}}
        rows["prompt"].append(
            [
                {"role": "system", "content": SYSTEM_MESSAGE},
                {"role": "user", "content": QUESTION_TEMPLATE.format(a=a, op=op, b=b)},
            ]
        )
        rows["completion"].append(
            [
                {"role": "assistant", "content": rng.choice(PREAMBLES), "tool_calls": [call]},
                {"role": "tool", "name": "calculator", "content": str(solve(a, op, b))},
                {"role": "assistant", "content": f"The answer is {solve(a, op, b)}."},
            ]
        )
        rows["tools"].append(schema)
    return Dataset.from_dict(rows)


def ensure_warm_started(settings: dict | None = None) -> Path:
    """The warm-started model's folder, built first when the cache has none (once, under its lock)."""
    settings = settings or WARMSTART
    final = warmstart_dir(settings)
    if final.is_dir():
        return final
    source = smollm2.ensure_converted()
    return smollm2.build_once(final, lambda staging: _warm_start(source, staging, settings))


def _warm_start(source: Path, staging: Path, settings: dict) -> None:
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    steps, batch = settings["steps"], settings["batch_size"]
    print(
        f"{NAME}: supervised warm start of {source.name}, {steps} steps of {batch} calculator transcripts (once; "
        "measured at 6 s a step on 2 quiet CPU cores, 87 s at load average 7; the bar's estimate is this machine's) "
        "...",
        file=sys.stderr,
    )
    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(source)
    args = SFTConfig(
        output_dir=str(staging / "sft"),
        max_steps=steps,
        per_device_train_batch_size=batch,
        learning_rate=settings["learning_rate"],
        lr_scheduler_type="constant",
        seed=settings["seed"],
        max_length=512,
        logging_steps=max(steps // 10, 1),
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        model_init_kwargs={"dtype": "float32"},
    )
    trainer = SFTTrainer(
        model=str(source),
        args=args,
        train_dataset=transcripts(steps * batch, settings["seed"]),
        processing_class=tokenizer,
    )
    trainer.train()
    trainer.model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    record = {"name": NAME, "from": source.name, "settings": settings, "losses": losses}
    (staging / "trl_aspo_source.json").write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(staging / "sft", ignore_errors=True)  # the trainer's run folder: nothing in it is kept
    print(f"{NAME}: warm-started in {time.monotonic() - started:.0f} s.", file=sys.stderr)


def main() -> None:
    """`make smollm2-warmstart`: build the warm-started model (after `make install-smollm2`)."""
    message = smollm2.missing_message()
    if message is not None:
        raise SystemExit(message)
    print(ensure_warm_started())


if __name__ == "__main__":
    main()
