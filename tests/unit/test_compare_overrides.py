"""`trl-aspo compare key=value` overrides read as YAML in file order, and the Ctrl-C message of a comparison (the
command itself: tests/integration/test_experiments_overrides.py)."""

from __future__ import annotations

import shlex

import pytest
from helpers import two_by_two

from trl_aspo.cli.experiment_file import apply_command_line, load_experiment, parse_override
from trl_aspo.trainers.resume import cli_command


def test_overrides_are_read_as_yaml_and_kept_in_file_order(tmp_path):
    assert parse_override("max_steps=2") == ("max_steps", 2)
    assert parse_override("tools=[]") == ("tools", [])
    assert parse_override("learning_rate=1.0e-4") == ("learning_rate", 1.0e-4)
    with pytest.raises(ValueError, match="not of the form key=value"):
        parse_override("=2")
    config, _ = two_by_two(tmp_path)
    experiment = apply_command_line(load_experiment(config), seeds=[1], variants=["aspo", "dapo"])
    assert list(experiment.variants) == ["dapo", "aspo"] and experiment.seeds == [1]
    assert experiment.run_config("aspo", 1)["loss_type"] == "aspo"


def test_ctrl_c_during_a_comparison_says_how_to_continue(tmp_path, monkeypatch, capsys):
    from trl_aspo.cli import compare as experiments

    config, _ = two_by_two(tmp_path)

    def interrupted(experiment):
        raise KeyboardInterrupt

    monkeypatch.setattr(experiments, "compare", interrupted)
    with pytest.raises(SystemExit) as exit_info:
        experiments.compare_main(["--config", config, "--seeds", "0", "max_steps=2"])
    assert exit_info.value.code == 130
    command = shlex.join([*cli_command(), "compare", "--config", config, "--seeds", "0", "max_steps=2"])
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"Interrupted; finished runs are kept. Continue with: {command}"
    )
