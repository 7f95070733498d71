"""Run TRL's own trainer tests twice, once as written and once with trl-aspo's trainers swapped in, and print where
the two differ. With every trl-aspo option at its default the swapped trainers must pass and fail exactly where TRL's
do; any test whose outcome (or failure message) changes is listed, and the script exits 1.

    python scripts/trl_suite_swapped.py --trl-tests PATH/TO/trl/tests [--work DIR] [-k EXPRESSION]

PATH/TO/trl/tests is the `tests` folder of a TRL checkout (pip's wheel and sdist carry no tests); use the one of the
installed TRL's version where you can, since a test file from another version may not import against the installed
TRL (the script says so and skips that file). The hub is not needed: the test models and the prompt datasets the
tests load (`trl-internal-testing/tiny-*`, `trl-internal-testing/zen`) are built as small random local stand-ins in
the work folder, which the tests run from (transformers and datasets read a local folder of the same name first).
Tests that need a model without a stand-in (vision models, remote code, other architectures) fail on both sides
with the same message, and so do not count as a difference. A stand-in has a byte-level tokenizer and random
weights, so tests that assert on a real model's tokens or outputs may fail on both sides too.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

# The test files swapped, and the import each one gets instead of TRL's.
SWAPS = {
    "test_grpo_trainer.py": (
        "from trl import GRPOConfig, GRPOTrainer\n",
        "from trl_aspo import ASPOConfig as GRPOConfig, ASPOTrainer as GRPOTrainer\n",
    ),
    "experimental/test_async_grpo_trainer.py": (
        "from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer\n",
        "from trl_aspo import AsyncASPOConfig as AsyncGRPOConfig, AsyncASPOTrainer as AsyncGRPOTrainer\n",
    ),
}
SWAPPED_SUFFIX = "_trl_aspo"
# Class names and addresses differ between the two runs' failure messages without meaning anything.
MESSAGE_NOISE = [
    (re.compile(r"\b(Async)?ASPO(Trainer|Config)\b"), r"\1GRPO\2"),
    (re.compile(r"0x[0-9a-f]+"), "0x"),
    (re.compile(re.escape(SWAPPED_SUFFIX)), ""),
]
# A test package's helpers may ask trl.import_utils for `is_<package>_available` functions another TRL version
# does not have: answered "not available", so the tests that need the package skip instead of the file not loading.
CONFTEST_SHIM = """

import importlib


def _missing_availability_check(name):
    if name.startswith("is_") and name.endswith("_available"):
        return lambda *args, **kwargs: False
    raise AttributeError(f"module 'trl.import_utils' has no attribute {name!r}")


importlib.import_module("trl.import_utils").__getattr__ = _missing_availability_check
"""
PROMPTS = [
    "Solve 3*x + 4 = 10",
    "The sky is",
    "Why is water wet?",
    "What color is the sun?",
    "Tell me a joke",
    "Count to five",
    "Name a fruit",
    "The capital of France is",
    "Write a haiku",
    "2 + 2 =",
    "Hello",
    "The best way to learn",
    "Describe a cat",
    "Once upon a time",
    "A list of primes:",
    "Translate 'dog'",
    "Summarize the news",
]
CHATML = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>'"
    " + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_stand_ins(work: Path) -> None:
    """Random tiny models with a byte-level ChatML tokenizer, and the zen prompt datasets, under `work`."""
    import datasets
    import torch
    import transformers
    from datasets import Dataset
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    hub = work / "trl-internal-testing"
    byte_vocab = {symbol: index for index, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=byte_vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHATML
    shape = {
        "vocab_size": len(tokenizer),
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": None,
    }
    stand_ins = {
        "tiny-Qwen2ForCausalLM-2.5": ("Qwen2", "ForCausalLM", {}),
        "tiny-Qwen2ForSequenceClassification-2.5": ("Qwen2", "ForSequenceClassification", {"num_labels": 1}),
        "tiny-Qwen3ForCausalLM": ("Qwen3", "ForCausalLM", {"head_dim": 4}),
        "tiny-Qwen3ForSequenceClassification": (
            "Qwen3",
            "ForSequenceClassification",
            {"head_dim": 4, "num_labels": 1},
        ),
        "tiny-Qwen3MoeForCausalLM": (
            "Qwen3Moe",
            "ForCausalLM",
            {"head_dim": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
        ),
        "tiny-LlamaForCausalLM-3.2": ("Llama", "ForCausalLM", {}),
        "tiny-LlamaForSequenceClassification-3.2": ("Llama", "ForSequenceClassification", {"num_labels": 1}),
        "tiny-MistralForCausalLM-0.2": ("Mistral", "ForCausalLM", {}),
        "tiny-Gemma2ForCausalLM": ("Gemma2", "ForCausalLM", {"head_dim": 4}),
    }
    torch.manual_seed(0)
    for name, (family, head, extra) in stand_ins.items():
        config = getattr(transformers, f"{family}Config")(**shape, **extra)
        model = getattr(transformers, f"{family}{head}")(config)
        if head == "ForCausalLM":
            model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.save_pretrained(hub / name)
        tokenizer.save_pretrained(hub / name)

    zen = hub / "zen"
    conversational = [[{"role": "user", "content": prompt}] for prompt in PROMPTS]
    splits = {
        "standard_prompt_only": {"train": PROMPTS, "test": PROMPTS[:2]},
        "conversational_prompt_only": {"train": conversational, "test": conversational[:2]},
    }
    card = ["---", "configs:"]
    for config_name, by_split in splits.items():
        card += [f"- config_name: {config_name}", "  data_files:"]
        for split, prompts in by_split.items():
            (zen / config_name).mkdir(parents=True, exist_ok=True)
            Dataset.from_dict({"prompt": prompts}).to_parquet(zen / config_name / f"{split}-00000-of-00001.parquet")
            card += [f"  - split: {split}", f"    path: {config_name}/{split}-*"]
    (zen / "README.md").write_text("\n".join([*card, "---", ""]))


def prepare_tests(trl_tests: Path, work: Path) -> list[tuple[Path, Path]]:
    """Copy TRL's tests into `work` and write a swapped copy beside each file of SWAPS: (stock, swapped) pairs."""
    tests = work / "tests"
    if tests.exists():
        shutil.rmtree(tests)
    shutil.copytree(trl_tests, tests)
    (tests / "conftest.py").write_text((tests / "conftest.py").read_text() + CONFTEST_SHIM)
    pairs = []
    for relative, (stock_import, swapped_import) in SWAPS.items():
        stock = tests / relative
        if not stock.exists():
            print(f"skipped {relative}: not in {trl_tests}")
            continue
        source = stock.read_text()
        if stock_import not in source:
            print(f"skipped {relative}: it does not import the trainer as `{stock_import.strip()}`")
            continue
        swapped = stock.with_name(f"{stock.stem}{SWAPPED_SUFFIX}.py")
        swapped.write_text(source.replace(stock_import, swapped_import))
        pairs.append((stock, swapped))
    return pairs


def run_pytest(test_file: Path, work: Path, keyword: str | None) -> tuple[dict[str, tuple[str, str]], str]:
    """{test id: (outcome, failure message)} of one pytest run in `work`, and the run's last line."""
    report = test_file.with_suffix(".xml")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", str(test_file)]
    command += [f"--junitxml={report}"] + (["-k", keyword] if keyword else [])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_DISABLED": "true"}
    result = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True)
    last_line = ((result.stdout + result.stderr).strip().splitlines() or ["no output"])[-1]
    outcomes = {}
    if report.exists():
        for case in ET.parse(report).iter("testcase"):
            outcome, message = "passed", ""
            for tag in ("failure", "error", "skipped"):
                element = case.find(tag)
                if element is not None:
                    outcome, message = tag, element.get("message") or ""
                    break
            for pattern, replacement in MESSAGE_NOISE:
                message = pattern.sub(replacement, message)
            test_id = f"{case.get('classname', '').replace(SWAPPED_SUFFIX, '')}::{case.get('name')}"
            outcomes[test_id] = (outcome, message[:300])
    return outcomes, last_line


def compare_swapped(trl_tests: Path, work: Path, keyword: str | None = None) -> int:
    """Run each file of SWAPS as written and swapped in `work`, print the outcomes that differ; how many differ."""
    differences = 0
    for stock, swapped in prepare_tests(trl_tests, work):
        name = stock.relative_to(work / "tests")
        print(f"{name}: running as written, then swapped (each a few minutes)", flush=True)
        stock_outcomes, stock_line = run_pytest(stock, work, keyword)
        if not stock_outcomes or all(outcome == "error" for outcome, _ in stock_outcomes.values()):
            print(f"  skipped: as written it does not load against the installed TRL ({stock_line})")
            continue
        swapped_outcomes, swapped_line = run_pytest(swapped, work, keyword)
        print(f"  TRL's trainer:      {stock_line}\n  trl-aspo's trainer: {swapped_line}")
        for test_id in sorted(set(stock_outcomes) | set(swapped_outcomes)):
            before, after = stock_outcomes.get(test_id), swapped_outcomes.get(test_id)
            if before != after:
                differences += 1
                print(f"  DIFFERS {test_id}\n    TRL's:      {before}\n    trl-aspo's: {after}")
    print(f"{differences} test(s) differ")
    return differences


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trl-tests", type=Path, required=True, help="the tests folder of a TRL checkout")
    parser.add_argument("--work", type=Path, default=Path("outputs/trl_suite_swapped"), help="where to build and run")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression, to run a part of the tests")
    args = parser.parse_args()
    if not (args.trl_tests / "conftest.py").is_file():
        parser.error(f"--trl-tests {args.trl_tests}: no conftest.py there; give the `tests` folder of a TRL checkout")
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    build_stand_ins(work)
    return 1 if compare_swapped(args.trl_tests.resolve(), work, args.keyword) else 0


if __name__ == "__main__":
    sys.exit(main())
