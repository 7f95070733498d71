"""`trl-aspo train` runs of issue 25: `--num_processes 2` on a CPU trains in two gloo processes (not one, silently),
and `resume_from_checkpoint: true` passes over a checkpoint that lost its trainer_state.json (the checks without
training: tests/unit/test_cli_first_hour.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from helpers import REPO_ROOT

CLI = [sys.executable, "-m", "trl_aspo.cli.main"]
SMOKE = str(REPO_ROOT / "configs" / "smoke.yaml")
# A reward that records which rank scored it (the file name), beside its module.
# At exit it records whether the rank's process group was still alive: gloo left for interpreter exit aborts a
# process now and then ("terminate called without an active exception"), failing a run that trained and saved.
RANK_REWARD = """
import atexit
import os

import torch.distributed


def rank_reward(completions, **kwargs):
    open(os.path.join(os.path.dirname(__file__), "rank-" + os.environ.get("RANK", "unset")), "a").close()
    return [0.0] * len(completions)


def record_group_at_exit():
    state = "alive" if torch.distributed.is_initialized() else "destroyed"
    open(os.path.join(os.path.dirname(__file__), f"exit-{os.environ.get('RANK', 'unset')}-group-{state}"), "a").close()


atexit.register(record_group_at_exit)
"""


def cli(*argv, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([*CLI, *argv], capture_output=True, text=True, env=env, cwd=cwd, timeout=600)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_num_processes_2_on_a_cpu_trains_in_two_processes(tmp_path):
    (tmp_path / "rank_reward.py").write_text(RANK_REWARD)
    result = cli(
        "train", "--num_processes", "2", "--main_process_port", str(_free_port()), "--config", SMOKE,
        "--output_dir", str(tmp_path / "run"), "--reward_funcs", "rank_reward.rank_reward", "--plot", "false",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert sorted(path.name for path in tmp_path.glob("rank-*")) == ["rank-0", "rank-1"]
    assert sorted(path.name for path in tmp_path.glob("exit-*")) == [
        "exit-0-group-destroyed",
        "exit-1-group-destroyed",
    ]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["model_type"]


@pytest.mark.slow
def test_a_plain_ddp_launch_says_it_trains_on_two_processes(tmp_path):
    """`trl-aspo train` started by a plain `accelerate launch --config_file configs/accelerate/ddp.yaml
    --num_processes 2`: the run says once that it trains data parallel on 2 processes (before: nothing, where FSDP
    and DeepSpeed launches say how they shard)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/ddp.yaml",
        "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", str(_free_port()),
        "-m", "trl_aspo.cli.train", "--config", SMOKE, "--output_dir", str(tmp_path / "run"), "--max_steps", "1",
        "--plot", "false",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert output.count("Data parallel on 2 CPU processes: DistributedType.MULTI_CPU (each holds the whole model") == 1


@pytest.mark.slow
def test_resume_true_passes_over_a_checkpoint_without_trainer_state(tmp_path):
    """A kill (or a full disk) while checkpoint-4 was saved leaves it without trainer_state.json: resuming takes
    checkpoint-2, says checkpoint-4 was skipped, and trains to step 4 again (transformers alone picks checkpoint-4
    and fails with FileNotFoundError)."""
    output_dir = tmp_path / "run"
    argv = ["train", "--config", SMOKE, "--output_dir", str(output_dir), "--max_steps", "4", "--save_strategy",
            "steps", "--save_steps", "2", "--plot", "false"]  # fmt: skip
    first = cli(*argv)
    assert first.returncode == 0, first.stderr[-3000:]
    (output_dir / "checkpoint-4" / "trainer_state.json").unlink()

    resumed = cli(*argv, "--resume_from_checkpoint", "true")
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-3000:]
    assert "Traceback" not in output
    assert f"Resuming from {output_dir / 'checkpoint-2'}." in output
    assert f"Skipped checkpoint-4 in {output_dir}: no trainer_state.json, so it was not saved to the end" in output
    assert json.loads((output_dir / "checkpoint-4" / "trainer_state.json").read_text())["global_step"] == 4
