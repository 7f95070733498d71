"""`trl-aspo compare --seeds ... --variants ... key=value`: shrinking an experiment from the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import two_by_two

from trl_aspo.cli.experiment_file import apply_command_line, load_experiment


def compare_cli(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(
        [sys.executable, "-m", "trl_aspo.cli.main", "compare", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


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
