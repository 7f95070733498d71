"""`trl-aspo compare` with `trainer: async` runs, and the shipped configs parse with the trainer they name."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from trl_aspo.cli.compare import compare, load_experiment, parse_run_config

ASYNC_BASE = """
base:
  trainer: async
  rollout_worker: local
  rollout_jitter_s: 0.02
  model_name_or_path: builtin:tiny-calculator
  dataset_name: builtin:calculator
  builtin_train_size: 16
  builtin_test_size: 2
  reward_funcs: [builtin:correctness]
  tools: [builtin:calculator]
  max_steps: 2
  per_device_train_batch_size: 4
  max_completion_length: 12
  max_tool_calling_iterations: 1
  token_budget: 0
  max_staleness: 2
  learning_rate: 1.0e-3
  logging_steps: 1
  save_strategy: "no"
  report_to: none
  use_cpu: true
  bf16: false
"""


def write_experiment(tmp_path, body: str) -> str:
    path = tmp_path / "experiment.yaml"
    path.write_text(textwrap.dedent(body) + textwrap.dedent(ASYNC_BASE))
    return str(path)


def test_a_variant_with_a_key_the_async_trainer_lacks_is_named_before_anything_runs(tmp_path):
    path = write_experiment(
        tmp_path,
        f"""
        output_dir: {tmp_path / "out"}
        seeds: [0]
        variants:
          spo++ 4x1: {{num_generations: 1, advantage_estimator: spo++}}
          group 2x2 on-policy: {{num_generations: 2, steps_per_generation: 1}}
        """,
    )
    with pytest.raises(
        ValueError, match=r"variant 'group 2x2 on-policy'.*'steps_per_generation' is a field of ASPOConfig"
    ):
        load_experiment(path)


@pytest.mark.parametrize(
    "path",
    [
        "configs/quickstart_async.yaml",
        "configs/quickstart.yaml",
        "configs/experiments/async_single_stream.yaml",
        "configs/experiments/async_single_stream_60.yaml",
    ],
)
def test_shipped_configs_parse_with_the_trainer_they_name(path):
    import yaml

    from trl_aspo import AsyncASPOConfig

    spec = yaml.safe_load(Path(path).read_text())
    if "variants" in spec:
        experiment = load_experiment(path)
        configs = [experiment.run_config(name, experiment.seeds[0]) for name in experiment.variants]
        assert len(experiment.seeds) >= 3
    else:
        spec.pop("env", None)
        configs = [spec]
    for config in configs:
        _, training_args, _, _ = parse_run_config(config)
        assert isinstance(training_args, AsyncASPOConfig) == (config.get("trainer") == "async")


@pytest.mark.slow
def test_compare_trains_async_variants_and_tabulates_them(tmp_path):
    path = write_experiment(
        tmp_path,
        f"""
        output_dir: {tmp_path / "out"}
        seeds: [0]
        evaluation: {{samples_per_problem: 1, temperature: 1.0, initial: false}}
        variants:
          spo++ 4x1: {{num_generations: 1, advantage_estimator: spo++, loss_type: aspo}}
          group 2x2: {{num_generations: 2, advantage_estimator: group}}
        """,
    )
    results = compare(load_experiment(path))
    for variant, runs in results.items():
        (summary,) = runs
        assert summary["completions_per_step"] == 4, variant
        assert summary["config"]["trainer"] == "async"
        assert summary["heldout"]["num_problems"] == 2
        assert len([row for row in summary["history"] if "loss" in row]) == 2
    table = json.loads((tmp_path / "out" / "results.json").read_text())["mean_sd"]
    assert set(table) == {"spo++ 4x1", "group 2x2"}
    assert (tmp_path / "out" / "comparison.png").stat().st_size > 0
