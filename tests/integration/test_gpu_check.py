"""scripts/gpu_check.py in its small CPU mode: it runs both trainers on the pre-made rows and writes every field."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest
from helpers import REPO_ROOT as ROOT
from helpers import load_script


@pytest.mark.slow
def test_gpu_check_small_mode_writes_the_result(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--small", "--out", str(out)]
    command += ["--repeats", "2", "--steps", "3", "--batch", "4"]
    completed = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    assert "| aspo |" in completed.stdout and "ratio aspo/grpo" in completed.stdout

    result = json.loads(out.read_text())
    assert result["mode"] == "small-cpu" and result["dtype"] == "float32"
    model = result["model"]
    assert (model["hidden"], model["layers"], model["vocab"], model["completion_length"]) == (64, 2, 4096, 64)
    assert result["repeats"] == 2 and result["timed_steps_per_call"] == 2
    grpo, aspo = result["trainers"]["grpo"], result["trainers"]["aspo"]
    for row in (grpo, aspo):
        assert len(row["step_s"]) == 2 * 2 and all(t > 0 for t in row["step_s"])
        assert row["median_step_s"] == pytest.approx(statistics.median(row["step_s"]))
        assert row["peak_memory_bytes"] is None and row["syncs_per_step"] is None  # CUDA only
    assert result["ratio_aspo_over_grpo"] == pytest.approx(aspo["median_step_s"] / grpo["median_step_s"])
    assert result["meets_goal"] == (result["ratio_aspo_over_grpo"] <= 1.02)

    # The pre-made rows: of 4 completions of 64 tokens, rows 0 and 2 hold a call whose 34-token tool response is
    # masked, so TRL counts (30 + 64 + 30 + 64) / 4 = 47 model tokens; both calling rows have reward 1 (pattern
    # 1, 0, 1, 1), so half the completions are eligible for tool shaping.
    for row in (grpo, aspo):
        assert row["last_log"]["completions/mean_length"] == 47.0
    assert aspo["last_log"]["tools/tool_call_frac"] == 0.5
    assert aspo["last_log"]["shaping/eligible_frac"] == 0.5

    names = {check["name"] for check in result["checks"]}
    assert {"asymmetric_policy_loss", "asymmetric_policy_loss gradient", "tool_shaping_bias"} <= names
    assert {f"{trainer} step {what}" for trainer in ("grpo", "aspo") for what in ("loss", "advantages")} <= names
    assert result["all_checks_ok"], [check for check in result["checks"] if not check["ok"]]
    assert set(result["versions"]) >= {"torch", "transformers", "trl", "datasets"}


@pytest.mark.slow
def test_a_check_that_raises_is_recorded_and_the_timings_still_written(tmp_path, monkeypatch):
    gpu_check = load_script("gpu_check")

    def broken(*args):
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(gpu_check, "device_dtype_checks", broken)
    out = tmp_path / "gpu_check.json"
    result = gpu_check.main(["--small", "--out", str(out), "--repeats", "1", "--steps", "2", "--batch", "2"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert not result["all_checks_ok"]
    assert result["checks"][0] == {"name": "device_dtype_checks", "ok": False, "error": "RuntimeError: no such kernel"}
    assert len(result["trainers"]["aspo"]["step_s"]) == 1
