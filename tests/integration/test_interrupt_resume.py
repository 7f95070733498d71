"""Stopping and resuming `trl-aspo train` as a user does: Ctrl-C, the printed resume command, `--resume_from_checkpoint
true`, and the held-out "before" numbers that survive an interrupt."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest
from helpers import REPO_ROOT

CLI = [sys.executable, "-m", "trl_aspo.cli.main"]


def quickstart_argv(output_dir, max_steps: int, config: str = "configs/quickstart.yaml") -> list[str]:
    """The quickstart config at its smallest: 2-step checkpoints, 4 held-out problems, no figure."""
    return [
        "train",
        "--config",
        config,
        "--output_dir",
        str(output_dir),
        "--max_steps",
        str(max_steps),
        "--save_steps",
        "2",
        "--builtin_test_size",
        "4",
        "--eval_samples_per_problem",
        "1",
        "--plot",
        "false",
    ]


def cli_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.mark.slow
def test_ctrl_c_after_a_checkpoint_stops_at_a_round_boundary_prints_the_resume_command_and_that_command_resumes(
    tmp_path,
):
    """Ctrl-C (one SIGINT) stops at the next generation-round boundary with a checkpoint there and exits 75
    (`stop_signals`, issue 43; before, it exited 130 at once and lost every step since the last save_steps one).
    Started in one folder with a relative config and output_dir, resumed from another folder by the printed
    command (before, its relative paths made it exit 2 there: `--config ...: no such file`)."""
    first, elsewhere = tmp_path / "first", tmp_path / "elsewhere"
    (first / "configs").mkdir(parents=True)
    elsewhere.mkdir()
    shutil.copy(REPO_ROOT / "configs" / "quickstart.yaml", first / "configs" / "quickstart.yaml")
    output_dir = first / "run"
    process = subprocess.Popen(
        [*CLI, *quickstart_argv("run", max_steps=12)],
        cwd=first,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(),
        # Ctrl-C in a terminal: a suite started in the background (`make test &`, nohup) ignores SIGINT, which the
        # child would inherit, and Python then installs no KeyboardInterrupt handler at all.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    first_checkpoint = output_dir / "checkpoint-2" / "trainer_state.json"
    deadline = time.monotonic() + 240
    while not first_checkpoint.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process.poll() is None, "the run ended before it could be interrupted"
    # The "before" numbers are on disk as soon as they are measured, before training.
    assert json.loads((output_dir / "summary.json").read_text())["before"]["num_problems"] == 4
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=120)

    assert process.returncode == 75, stderr[-3000:]
    assert "Traceback" not in stdout + stderr
    last_line = stderr.strip().splitlines()[-1]
    match = re.fullmatch(
        r"Stopped on SIGINT at step (\d+) \(a generation-round boundary\); latest checkpoint (\S+)\. Resume with: "
        r"(.* train .*)",
        last_line,
    )
    assert match, last_line
    step, checkpoint, command = int(match[1]), match[2], match[3]
    # The quickstart's rounds are steps_per_generation=2 optimizer steps long: the stop's checkpoint is the step.
    assert 2 < step < 12 and step % 2 == 0 and checkpoint == str(output_dir / f"checkpoint-{step}")
    assert not (output_dir / "model.safetensors").exists()  # the final save_model is skipped
    # The command runs as printed (this interpreter with -m trl_aspo.cli.main: the run was started that way), every
    # path absolute.
    config = str(first / "configs" / "quickstart.yaml")
    assert shlex.split(command) == [
        *CLI,
        *quickstart_argv(output_dir, 12, config=config),
        "--resume_from_checkpoint",
        checkpoint,
    ]

    resumed = subprocess.run(
        shlex.split(command), cwd=elsewhere, capture_output=True, text=True, env=cli_env(), timeout=600
    )
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-3000:]
    assert f"Resuming from {checkpoint}." in output
    assert "Held-out numbers before training: reused from" in output
    # The tied output head is loaded through its embedding, not reported missing.
    assert "missing keys" not in output
    assert json.loads((output_dir / "checkpoint-12" / "trainer_state.json").read_text())["global_step"] == 12
    assert not os.listdir(elsewhere)
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["before"]["num_problems"] == 4 and summary["after"]["num_problems"] == 4


@pytest.mark.slow
def test_resume_from_checkpoint_true_without_a_checkpoint_says_so(tmp_path):
    result = subprocess.run(
        [*CLI, *quickstart_argv(tmp_path / "empty", max_steps=2), "--resume_from_checkpoint", "true"],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=300,
    )
    assert result.returncode != 0
    assert f"resume_from_checkpoint=true: there is no checkpoint-* folder in output_dir '{tmp_path / 'empty'}'" in (
        result.stderr
    )
