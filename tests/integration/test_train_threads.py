"""`trl-aspo train` on a shared CPU (README, Training on a shared CPU): `--threads N` sets torch's CPU threads of the
training process, and the processes run with `OMP_WAIT_POLICY=PASSIVE` unless the environment sets a policy (torch's
OpenMP threads otherwise spin while they wait for each other, which slowed runs on the shared 2-core machine 4 to 9
times over). A reward function records what the training process sees."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import REPO_ROOT

RECORDING_REWARD = """
import json
import os

import torch


def recording_reward(completions, **kwargs):
    seen = {"threads": torch.get_num_threads(), "wait_policy": os.environ.get("OMP_WAIT_POLICY")}
    with open(os.path.join(os.path.dirname(__file__), "seen.json"), "w") as handle:
        json.dump(seen, handle)
    return [0.0] * len(completions)
"""


def train_smoke(tmp_path, *flags: str, **env_overrides: str) -> dict:
    (tmp_path / "recording.py").write_text(RECORDING_REWARD)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **env_overrides}
    for name in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY"):
        if name not in env_overrides:
            env.pop(name, None)
    command = [
        sys.executable, "-m", "trl_aspo.cli.main", "train", "--config", str(REPO_ROOT / "configs" / "smoke.yaml"),
        "--output_dir", str(tmp_path / "run"), "--max_steps", "1", "--plot", "false",
        "--reward_funcs", "recording.recording_reward", *flags,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((tmp_path / "seen.json").read_text())


@pytest.mark.slow
def test_threads_sets_torch_threads_and_the_wait_policy_is_passive(tmp_path):
    assert train_smoke(tmp_path, "--threads", "1") == {"threads": 1, "wait_policy": "PASSIVE"}


@pytest.mark.slow
def test_a_wait_policy_the_environment_sets_is_kept(tmp_path):
    seen = train_smoke(tmp_path, OMP_WAIT_POLICY="ACTIVE")
    assert seen == {"threads": torch_default_threads(), "wait_policy": "ACTIVE"}


def torch_default_threads() -> int:
    """torch's own default in a fresh interpreter without OMP_NUM_THREADS (one per core)."""
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    result = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"], capture_output=True, text=True, env=env
    )
    return int(result.stdout)
