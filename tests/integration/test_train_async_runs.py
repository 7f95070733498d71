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


@pytest.mark.slow
def test_the_spo_pp_recipe_config_runs(tmp_path):
    """configs/spo_pp_async.yaml (the SPO++ asynchronous recipe, issue 30) through `trl-aspo train`, shortened: the
    run ends with its model and curves, and the recipe's fields reach the trainer (the decoupled objective's
    diagnostics are checked in tests/integration/test_async_decoupled.py)."""
    from trl_aspo.cli.main import main

    output_dir = tmp_path / "spo_pp"
    overrides = ["--max_steps", "2", "--builtin_train_size", "8", "--value_init_samples", "2"]
    overrides += ["--save_strategy", "steps", "--save_steps", "2"]
    assert main(["train", "--config", "configs/spo_pp_async.yaml", "--output_dir", str(output_dir), *overrides]) == 0
    args = torch.load(output_dir / "training_args.bin", weights_only=False)
    recipe = {
        "advantage_estimator": "spo++",
        "value_rho": 0.875,
        "advantage_normalization": "token",
        "value_prior_strength": 8.0,
        "prioritized_sampling": True,
        "priority_epsilon": 0.05,
        "loss_type": "ppo",
        "epsilon": 0.2,
        "epsilon_high": 0.28,
        "vllm_importance_sampling_correction": True,
        "vllm_importance_sampling_mode": "token_truncate",
        "vllm_importance_sampling_clip_max": 2.0,
        "vllm_importance_sampling_clip_min": None,
        "num_generations": 1,
        "temperature": 1.0,
        "top_p": 1.0,
        "weight_decay": 0.1,
        "ppo_dual_clip": 2.0,
        "steps_per_rollout_batch": 2,
        "proximal_policy": "recompute",
        "weight_sync_steps": 2,
        "max_inflight_per_prompt": 1,
        "drain_on_publish": True,
    }
    assert {name: getattr(args, name) for name in recipe} == recipe
    state = json.loads((output_dir / "checkpoint-2" / "trainer_state.json").read_text())
    logs = [log for log in state["log_history"] if "loss" in log]
    assert "ppo/dual_clip_frac_later_steps" in logs[-1] and "offpolicy/proximal_log_ratio_abs_mean" in logs[0]
    spans = [log["rollout/turns_across_publish_total"] for log in logs if "rollout/turns_across_publish_total" in log]
    assert spans and sum(spans) == 0  # drained at every publish
    assert (output_dir / "model.safetensors").exists() and (output_dir / "training_curves.png").stat().st_size > 0
