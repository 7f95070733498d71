"""`trl-aspo compare` with `trainer: async` variants: a key the async trainer lacks is named before anything runs,
and the shipped configs parse with the trainer they name."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import write_async_experiment

from trl_aspo.cli.experiment_file import load_experiment, parse_run_config


def test_a_variant_with_a_key_the_async_trainer_lacks_is_named_before_anything_runs(tmp_path):
    path = write_async_experiment(
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
