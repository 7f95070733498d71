"""A preempted `trl-aspo train` (issue 43 item 1), in real processes: SIGTERM to a `--num_processes 2` launch
(synchronous), SIGUSR1 (synchronous) and SIGTERM (asynchronous) to a one-process `--accelerate_config` launch; the
asynchronous trainer's local worker runs in one process only, so it has no two-process case on CPU. The run stops
at the first boundary after the signal with a checkpoint there, prints the resume command and exits 75; that command
reaches `max_steps`. With `steps_per_generation: 2` and the signal mid-round, the resumed synchronous run ends with
the uninterrupted run's weights, bit for bit (`torch.equal`): the checkpoint is at a round boundary, where a resumed
run draws, generates and trains what the uninterrupted one did."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest
import yaml

CLI = [sys.executable, "-m", "trl_aspo.cli.main", "train"]
EXIT_STOPPED = 75

# 4 optimizer steps; the synchronous rounds and the asynchronous rollout batches are 2 steps long.
COMMON = {
    "env": {"TOKENIZERS_PARALLELISM": "false"},
    "model_name_or_path": "builtin:tiny-calculator",
    "dataset_name": "builtin:calculator",
    "builtin_train_size": 64,
    "builtin_test_size": 4,
    "reward_funcs": ["builtin:correctness"],
    "tools": ["builtin:calculator"],
    "evaluate_before_after": False,
    "plot": False,
    "max_steps": 4,
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 1,
    "num_generations": 1,
    "max_completion_length": 16,
    "max_tool_calling_iterations": 1,
    "learning_rate": 1.0e-3,
    "lr_scheduler_type": "constant",
    "advantage_estimator": "spo++",
    "loss_type": "aspo",
    "tool_shaping": True,
    # Every step logs a line on stdout (transformers' PrinterCallback): the test signals after the first.
    "logging_steps": 1,
    "disable_tqdm": True,
    "save_strategy": "steps",
    "save_steps": 100,  # no checkpoint but the stop's (and the last step's)
    "report_to": "none",
    "use_cpu": True,
    "bf16": False,
    "seed": 0,
}
SYNC = {**COMMON, "steps_per_generation": 2, "prioritized_sampling": True, "beta": 0.0}
# Rollout batches of 2 optimizer steps: the signal after step 1 stops at step 2, the batch's end.
ASYNC = {
    **COMMON,
    "trainer": "async",
    "rollout_worker": "local",
    "token_budget": 0,
    "max_staleness": 2,
    "steps_per_rollout_batch": 2,
}
ONE_PROCESS = {
    "compute_environment": "LOCAL_MACHINE",
    "distributed_type": "NO",
    "num_processes": 1,
    "num_machines": 1,
    "machine_rank": 0,
    "mixed_precision": "no",
    "use_cpu": True,
}


def environment() -> dict[str, str]:
    # Unbuffered: the test reads the log lines as they are written.
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }


def launch_words(folder, launcher: str) -> list[str]:
    if launcher == "two processes":
        return ["--num_processes", "2"]
    accelerate_config = folder / "one_process.yaml"
    accelerate_config.write_text(yaml.safe_dump(ONE_PROCESS))
    return ["--accelerate_config", str(accelerate_config)]


def command(folder, config: dict, launcher: str, output_dir) -> list[str]:
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return [*CLI, *launch_words(folder, launcher), "--config", str(path), "--output_dir", str(output_dir)]


def stopped_run(words: list[str], signum: int) -> tuple[int, str]:
    """Run `words`, send `signum` to the launcher once the first optimizer step has logged; (status, stderr)."""
    process = subprocess.Popen(
        words, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment(), start_new_session=True
    )
    try:
        for line in process.stdout:
            if "'loss'" in line:
                process.send_signal(signum)
                break
        _, stderr = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return process.returncode, stderr


def resumed_run(stderr: str, name: str, step: int, boundary: str) -> None:
    """The stop's last line names `step` and its checkpoint, and its command resumes to max_steps."""
    last = stderr.strip().splitlines()[-1]
    match = re.fullmatch(
        rf"Stopped on {name} at step (\d+) \({boundary}\); latest checkpoint (\S+)\. Resume with: (.*)", last
    )
    assert match, stderr[-3000:]
    assert int(match[1]) == step and match[2].endswith(f"checkpoint-{step}") and os.path.isabs(match[2])
    assert os.path.exists(os.path.join(match[2], "trainer_state.json"))
    resumed = subprocess.run(shlex.split(match[3]), capture_output=True, text=True, env=environment(), timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Resuming from {match[2]}." in resumed.stdout + resumed.stderr
    output_dir = os.path.dirname(match[2])
    assert os.path.exists(os.path.join(output_dir, f"checkpoint-{COMMON['max_steps']}", "trainer_state.json"))


def weights(output_dir):
    from safetensors.torch import load_file

    return load_file(os.path.join(output_dir, "model.safetensors"))


@pytest.mark.slow
def test_sigterm_to_a_two_process_launcher_mid_round_resumes_to_the_uninterrupted_weights(tmp_path):
    """The signal during step 2 of the first round (steps 1-2): both processes stop at step 2, the round boundary,
    whichever of them the signal reached first; the resumed run's final weights equal the uninterrupted run's."""
    reference = subprocess.run(
        command(tmp_path, SYNC, "two processes", tmp_path / "reference"),
        capture_output=True,
        text=True,
        env=environment(),
        timeout=300,
    )
    assert reference.returncode == 0, reference.stderr[-3000:]
    started = time.monotonic()
    status, stderr = stopped_run(command(tmp_path, SYNC, "two processes", tmp_path / "run"), signal.SIGTERM)
    assert status == EXIT_STOPPED, stderr[-3000:]
    assert time.monotonic() - started < 240
    assert "Traceback" not in stderr and "exitcode: 75" not in stderr
    assert sorted(os.listdir(tmp_path / "run")) == ["README.md", "checkpoint-2"]  # no final model, no plot
    resumed_run(stderr, "SIGTERM", 2, "a generation-round boundary")
    import torch

    expected, resumed = weights(tmp_path / "reference"), weights(tmp_path / "run")
    assert expected.keys() == resumed.keys()
    assert all(torch.equal(expected[name], resumed[name]) for name in expected)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("trainer", "signum", "boundary"),
    [
        ("sync", signal.SIGUSR1, "a generation-round boundary"),
        ("async", signal.SIGTERM, "a rollout-batch boundary"),
    ],
    ids=["sync-SIGUSR1", "async-SIGTERM"],
)
def test_a_signal_to_a_one_process_accelerate_config_launch_stops_with_a_checkpoint(
    tmp_path, trainer, signum, boundary
):
    """accelerate's one-process launcher alone kills its child 5 s after a SIGTERM and dies of SIGUSR1, orphaning
    it; through trl-aspo train the run stops at its boundary (synchronous: step 2, the end of the first round;
    asynchronous: step 2, the next rollout batch after the signal) and resumes."""
    words = command(tmp_path, SYNC if trainer == "sync" else ASYNC, "one process", tmp_path / "run")
    status, stderr = stopped_run(words, signum)
    assert status == EXIT_STOPPED, stderr[-3000:]
    assert f"{signal.Signals(signum).name} received: stopping at the next" in stderr
    resumed_run(stderr, signal.Signals(signum).name, 2, boundary)
