"""`trl-aspo train` and `trl-aspo evaluate` with `trainer: async` configs, run for real."""

from __future__ import annotations

import json

import pytest
import torch


@pytest.mark.slow
def test_trl_aspo_train_runs_the_quickstart_async_config(tmp_path):
    """Two steps of configs/quickstart_async.yaml through `trl-aspo train` (local worker, jitter, evaluation)."""
    from trl_aspo import AsyncASPOConfig
    from trl_aspo.cli.main import main

    output_dir = tmp_path / "quickstart_async"
    overrides = ["--max_steps", "2", "--builtin_test_size", "4", "--eval_samples_per_problem", "1"]
    assert (
        main(["train", "--config", "configs/quickstart_async.yaml", "--output_dir", str(output_dir), *overrides]) == 0
    )
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["before"]["num_problems"] == 4 and summary["after"]["num_problems"] == 4
    assert 0.0 <= summary["after"]["accuracy"] <= 1.0
    assert (output_dir / "training_curves.png").stat().st_size > 0
    assert (output_dir / "model.safetensors").exists()
    args = torch.load(output_dir / "training_args.bin", weights_only=False)
    assert type(args) is AsyncASPOConfig and args.max_steps == 2 and args.output_dir == str(output_dir)
    assert args.loss_type == "aspo" and args.advantage_estimator == "spo++" and args.num_generations == 1


def test_trl_aspo_evaluate_reads_an_async_config(tmp_path):
    from trl_aspo.cli.main import main

    output = tmp_path / "evaluation.json"
    argv = ["evaluate", "--model", "builtin:tiny-calculator", "--config", "configs/quickstart_async.yaml"]
    assert main([*argv, "--limit", "2", "--output", str(output)]) == 0
    evaluation = json.loads(output.read_text())
    assert evaluation["settings"]["max_completion_length"] == 64
