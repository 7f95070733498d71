"""The `trl-aspo` command run for real: help in a fresh interpreter, the configuration reference check, and two steps
of the quickstart configuration."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"]])
def test_cli_help(argv):
    result = subprocess.run(
        [sys.executable, "-m", "trl_aspo.cli.main", *argv], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "trl-aspo" in result.stdout
    if argv[0] == "train":
        assert "--aspo_dual_clip" in result.stdout and "--advantage_estimator" in result.stdout


def test_readme_configuration_reference_is_current():
    result = subprocess.run(
        [sys.executable, "scripts/config_reference.py", "--check"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_trl_aspo_train_runs_the_quickstart_config(tmp_path):
    """Two RL steps of the real quickstart configuration through the `trl-aspo` command, with its evaluation."""
    from trl_aspo.cli.main import main

    output_dir = tmp_path / "quickstart"
    overrides = ["--max_steps", "2", "--builtin_test_size", "4", "--eval_samples_per_problem", "1"]
    assert main(["train", "--config", "configs/quickstart.yaml", "--output_dir", str(output_dir), *overrides]) == 0
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["before"]["num_problems"] == 4 and 0.0 <= summary["after"]["accuracy"] <= 1.0
    assert (output_dir / "training_curves.png").stat().st_size > 0
    assert (output_dir / "model.safetensors").exists()
