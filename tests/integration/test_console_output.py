"""What `trl-aspo train` prints: a progress bar with a few numbers, not a dict of every metric per logging step, and
no notices the package can avoid; every metric still reaches the log history."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

METRICS_DICT = re.compile(r"\{'[^']+': ")


def run_cli(argv: list[str]) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(
        [sys.executable, "-m", "trl_aspo.cli.main", *argv], capture_output=True, text=True, env=env, timeout=600
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    return output


def console_lines(output: str) -> list[str]:
    """The lines a terminal shows, a progress bar's redraws (carriage returns) included."""
    return [line for line in re.split(r"[\r\n]", output) if line.strip()]


def assert_readable(output: str) -> None:
    lines = console_lines(output)
    assert not [line for line in lines if METRICS_DICT.search(line)], "a metrics dict was printed"
    assert max(len(line) for line in lines) <= 200, max(lines, key=len)
    assert "there is already one" not in output  # transformers' duplicate-callback notice
    assert "past_key_values" not in output
    assert "deprecated" not in output
    bar = [line for line in lines if line.startswith("train:") and "step" in line][-1]
    assert "reward=" in bar and "loss=" in bar and "lr=" in bar, bar


@pytest.mark.slow
def test_sync_training_console_is_a_progress_bar_and_the_log_history_keeps_every_metric(tmp_path):
    output_dir = tmp_path / "run"
    output = run_cli(
        ["train", "--config", "configs/quickstart.yaml", "--output_dir", str(output_dir), "--plot", "false"]
        + ["--max_steps", "2", "--save_steps", "2", "--builtin_test_size", "4"]
        + ["--eval_samples_per_problem", "1"]
    )
    assert_readable(output)
    assert re.search(r"^train: 2 steps in \d+ s \(mean loss ", output, re.MULTILINE), output[-2000:]
    history = json.loads((output_dir / "checkpoint-2" / "trainer_state.json").read_text())["log_history"]
    logged = [row for row in history if "loss" in row]
    assert len(logged) == 1
    for key in ("reward", "entropy", "learning_rate", "aspo/flip_weight_mean", "tools/tool_call_frac", "grad_norm"):
        assert all(key in row for row in logged), key
    assert min(len(row) for row in logged) >= 40


@pytest.mark.slow
def test_async_training_console_has_no_duplicate_callback_or_cache_notice(tmp_path):
    output = run_cli(
        ["train", "--config", "configs/quickstart_async.yaml", "--output_dir", str(tmp_path / "run")]
        + ["--max_steps", "2", "--builtin_test_size", "4", "--eval_samples_per_problem", "1", "--plot", "false"]
    )
    assert_readable(output)


def test_evaluate_prints_no_deprecation_notice(tmp_path):
    """`trl-aspo evaluate` ignores TRL's gradient-checkpointing notice as `train` does (one place: cli.main)."""
    output = run_cli(
        ["evaluate", "--model", "builtin:tiny-calculator", "--config", "configs/quickstart.yaml"]
        + ["--builtin_test_size", "2", "--output", str(tmp_path / "evaluation.json")]
    )
    assert "deprecated" not in output and "FutureWarning" not in output
    assert (tmp_path / "evaluation.json").exists()
