"""`trl-aspo compare --seeds ... --variants ... key=value`: shrinking an experiment from the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_experiments import BASE, write_experiment

from trl_aspo.cli.compare import apply_command_line, load_experiment, parse_override


def compare_cli(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(
        [sys.executable, "-m", "trl_aspo.cli.main", "compare", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def two_by_two(tmp_path) -> tuple[str, object]:
    output = tmp_path / "cmp"
    body = f"""
        output_dir: {output}
        seeds: [0, 1]
        variants:
          dapo: {{loss_type: dapo}}
          aspo: {{loss_type: aspo}}
        """
    return write_experiment(tmp_path, body, base=BASE_THREE_STEPS), output


BASE_THREE_STEPS = BASE.replace("max_steps: 2", "max_steps: 3")


@pytest.mark.slow
def test_compare_runs_only_the_chosen_seed_and_variant_with_overrides_and_refuses_other_overrides(tmp_path):
    config, output = two_by_two(tmp_path)
    result = compare_cli("--config", config, "--seeds", "0", "--variants", "aspo", "max_steps=2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(str(p.relative_to(output)) for p in output.glob("runs/*/*")) == ["runs/aspo/seed0"]
    run = output / "runs" / "aspo" / "seed0"
    state = json.loads((run / "trainer_state.json").read_text())
    assert [row["step"] for row in state["log_history"] if "reward" in row] == [1, 2]
    summary = json.loads((run / "run_summary.json").read_text())
    assert summary["overrides"] == {"max_steps": 2} and summary["config"]["max_steps"] == 2
    results_md = (output / "results.md").read_text()
    assert "Command-line overrides of base: max_steps=2." in results_md
    assert "| aspo (n=1) |" in results_md and "dapo" not in results_md.split("\n\n", 1)[1]
    assert json.loads((output / "results.json").read_text())["overrides"] == {"max_steps": 2}

    refused = compare_cli("--config", config, "--seeds", "0", "--variants", "aspo", "max_steps=1")
    assert refused.returncode == 2
    message = refused.stderr.strip().splitlines()[-1]
    assert message.startswith(
        f"trl-aspo compare: error: {run / 'run_summary.json'} was trained with a different config"
    )
    assert "(keys ['max_steps'])" in message
    assert "max_steps: 2 then, 1 now; command-line overrides then: max_steps=2, now: max_steps=1" in message

    # The same overrides again: the finished run is skipped.
    again = compare_cli("--config", config, "--seeds", "0", "--variants", "aspo", "max_steps=2")
    assert again.returncode == 0 and "finished before, skipped" in again.stdout


def test_command_line_errors_name_the_variant_seed_or_key(tmp_path):
    config, _ = two_by_two(tmp_path)
    unknown = compare_cli("--config", config, "--variants", "grpo")
    assert unknown.returncode == 2
    assert f"--variants: 'grpo' is not a variant of {config}; it has: 'dapo', 'aspo'" in unknown.stderr
    with pytest.raises(ValueError, match="override 'seed=3': 'seed' is set by compare per run"):
        apply_command_line(load_experiment(config), overrides=["seed=3"])
    with pytest.raises(ValueError, match=r"variant 'dapo' \(base \+ overrides \{'lerning_rate': 1\}\).*lerning_rate"):
        apply_command_line(load_experiment(config), overrides=["lerning_rate=1"])
    with pytest.raises(ValueError, match="--seeds must be distinct"):
        apply_command_line(load_experiment(config), seeds=[0, 0])
    bad_seed = compare_cli("--config", config, "--seeds", "zero")
    assert bad_seed.returncode == 2 and "--seeds must be integers, got ['zero']" in bad_seed.stderr


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
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"Interrupted; finished runs are kept. Continue with: trl-aspo compare --config {config} --seeds 0 max_steps=2"
    )
