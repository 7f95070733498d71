"""A researcher's first hour, as the README's first sections and docs/experiments.md tell it: every command and code
block of the README's "Quick start", "Use it in existing TRL code" and "The `trl-aspo` command", and of
docs/experiments.md's "YAML experiments", runs, with the smallest overrides (a couple of steps, a few held-out
problems) and hub names replaced by the built-in model and task, in a scratch folder.

A command line in those sections that no rule below knows fails the test, so a new documented command gets a rule."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = next(folder for folder in Path(__file__).resolve().parents if (folder / "pyproject.toml").exists())
# (page, sections of it whose fenced blocks run), in reading order.
SOURCES = (
    ("README.md", ("Quick start", "Use it in existing TRL code", "The `trl-aspo` command")),
    ("docs/experiments.md", ("YAML experiments",)),
)
# The smallest run of the quickstart configs: 2 steps, 4 held-out problems x 1 sample.
SMALL_TRAIN = ["--max_steps", "2", "--builtin_test_size", "4", "--eval_samples_per_problem", "1"]
# my_run.yaml names a hub model, dataset and user modules: the built-in ones stand in, at the smallest sizes.
BUILTIN_STAND_INS = [
    "--model_name_or_path",
    "builtin:tiny-random",
    "--dataset_name",
    "builtin:calculator",
    "--reward_funcs",
    "builtin:correctness",
    "--tools",
    "builtin:calculator",
    # The stand-in's context is 512 tokens; the README's model takes the default completion length.
    "--max_completion_length",
    "64",
]
SMALL_MY_RUN = [
    *BUILTIN_STAND_INS,
    "--builtin_train_size",
    "16",
    "--max_steps",
    "2",
    "--per_device_train_batch_size",
    "4",
    "--num_generations",
    "2",
    "--max_completion_length",
    "12",
    "--use_cpu",
    "true",
    "--bf16",
    "false",
    "--report_to",
    "none",
]
SMALL_COMPARE = ["max_steps=2", "builtin_test_size=4", "builtin_train_size=64", "per_device_train_batch_size=8"]


def readme_blocks() -> list[tuple[str, str, str]]:
    """(section, language, code) of every fenced block in the SOURCES sections, in reading order."""
    blocks = []
    for page, sections in SOURCES:
        text = (ROOT / page).read_text()
        found = set()
        for match in re.finditer(r"^## (.+?)\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL):
            title = match[1].strip()
            if any(title.startswith(section) for section in sections):
                found.update(section for section in sections if title.startswith(section))
                for fence in re.finditer(r"^```(\w*)\n(.*?)^```", match[2], re.MULTILINE | re.DOTALL):
                    blocks.append((title, fence[1], fence[2]))
        assert found == set(sections), f"{page} has no section {sorted(set(sections) - found)}"
    return blocks


def command_lines(code: str) -> list[list[str]]:
    return [shlex.split(line, comments=True) for line in code.splitlines() if shlex.split(line, comments=True)]


def small_command(words: list[str], workspace: Path) -> list[str] | None:
    """The documented command `words` at its smallest, as argv of `python -m trl_aspo.cli.main`; None = not run (why
    below)."""
    if words[:1] == ["source"]:
        return None  # activating .venv: the test already runs in the environment
    if words[:1] == [".venv/bin/trl-aspo"]:
        words = ["trl-aspo", *words[1:]]  # the same command, by its path in .venv
    if words == ["make", "test"]:
        return None  # the test suite, of which this test is a part
    if words == ["make", "test-vllm"]:
        return None  # the vLLM tier: its own environment and server, run by .ci/run after this suite
    if words in (["make", "install-smollm2"], ["make", "test-real-model"]):
        return None  # the real-model tier and its download: run by .ci/run after this suite
    if words == ["make", "smollm2-calculator"]:
        return None  # the real model's recipe: tests/real_model/test_recipe.py trains its config one step
    if words[:1] == ["make"]:
        target = {"quickstart": "configs/quickstart.yaml", "quickstart-async": "configs/quickstart_async.yaml"}
        assert len(words) == 2 and words[1] in target, f"no rule for documented command {words}"
        return ["train", "--config", target[words[1]], *SMALL_TRAIN]
    assert words[0] == "trl-aspo", f"no rule for documented command {words}"
    command, rest = words[1], words[2:]
    if rest == ["--help"]:
        return [command, "--help"]
    if command == "train" and rest[:2] == ["--config", "my_run.yaml"]:
        return [command, *rest, *SMALL_MY_RUN]
    if command == "evaluate" and "my_run.yaml" in rest:
        return [command, *rest, *BUILTIN_STAND_INS, "--limit", "2"]
    if command == "compare":
        experiment = yaml.safe_load((ROOT / rest[rest.index("--config") + 1]).read_text())
        subset = [] if "--variants" in rest else ["--seeds", "0", "--variants", next(iter(experiment["variants"]))]
        return [command, *rest, *subset, *SMALL_COMPARE]
    if command == "plot":
        runs = sorted(str(path) for path in workspace.glob("outputs/experiments/*/runs/*/seed0"))
        assert len(runs) >= 2, f"plot needs the two runs the compare commands train, found {runs}"
        placeholders = [word for word in rest if word.startswith("outputs/run_")]
        return [command, *runs[: len(placeholders)], *(word for word in rest if word not in placeholders)]
    raise AssertionError(f"no rule for documented command {words}")


def run_in(workspace: Path, argv: list[str]) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    return subprocess.run(argv, cwd=workspace, capture_output=True, text=True, env=env, timeout=900)


@pytest.mark.slow
def test_every_command_of_the_readme_first_sections_runs(tmp_path):
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    ran = []
    for section, language, code in readme_blocks():
        if language == "yaml":
            name = re.match(r"# (\S+\.yaml)", code)
            assert name, f"a YAML block of {section!r} without a '# file.yaml' first line"
            if not (ROOT / name[1]).exists():  # a file the reader writes; repository files are shown abridged
                (tmp_path / name[1]).write_text(code)
            continue
        if language == "python":
            result = run_in(tmp_path, [sys.executable, "-c", code])
            assert result.returncode == 0, f"{section} python block:\n{result.stderr[-3000:]}"
            ran.append("python block")
            continue
        if language in ("bash", "sh"):
            for words in command_lines(code):
                argv = small_command(words, tmp_path)
                if argv is None:
                    continue
                result = run_in(tmp_path, [sys.executable, "-m", "trl_aspo.cli.main", *argv])
                assert result.returncode == 0, f"{shlex.join(words)} -> {argv}:\n{result.stderr[-3000:]}"
                ran.append(shlex.join(words))
            continue
        # Output shown in the docs (```` ``` ```` without a language) is not a command.
        assert language == "", f"a {language!r} block in {section!r}: add a rule"
    assert "python block" in ran and any(line.startswith("trl-aspo compare") for line in ran)
    assert (tmp_path / "ab.png").stat().st_size > 0


@pytest.mark.slow
def test_the_trl_code_example_runs_as_written_on_a_cpu(tmp_path):
    """The "Use it in existing TRL code" block, unchanged: the built-in model, task, reward and tool on a CPU; it logs
    every step and prints no warning a user cannot act on (issue 25, item 13: torch's pin_memory notice, TRL's calls
    of transformers' renamed gradient-checkpointing API)."""
    ((_, _, code),) = [block for block in readme_blocks() if block[0].startswith("Use it in existing TRL code")]
    result = run_in(tmp_path, [sys.executable, "-c", code])
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "out" / "checkpoint-6" / "model.safetensors").exists()
    output = result.stdout + result.stderr
    assert output.count("'loss':") == 6
    assert "Warning" not in output, [line for line in output.splitlines() if "Warning" in line]
