"""scripts/gpu_check.py in its small CPU mode: each case runs its trainers on the pre-made rows and writes every field
(the Qwen case: GRPOTrainer against ASPOTrainer; the SmolLM2 case: ASPOTrainer and AsyncASPOTrainer on a 2-layer
SmolLM2 with the real tokenizer, in bf16 and fp32)."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys

import pytest
from helpers import REPO_ROOT as ROOT
from helpers import load_script


def run_small(tmp_path, *arguments) -> tuple[subprocess.CompletedProcess, dict]:
    """The script in its small CPU mode as a separate process (one thread): its output and its JSON result."""
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--small", "--out", str(out), *arguments]
    completed = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return completed, json.loads(out.read_text())


@pytest.mark.slow
def test_gpu_check_small_mode_writes_the_result(tmp_path):
    completed, result = run_small(tmp_path, "--case", "qwen", "--repeats", "2", "--steps", "3", "--batch", "4")
    assert "| aspo |" in completed.stdout and "ratio aspo/grpo" in completed.stdout
    assert "smollm2" not in result

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
def test_both_cases_by_default_with_the_smollm2_case_in_both_trainers_and_dtypes(tmp_path):
    """The default runs the Qwen case, then the SmolLM2 one: each trainer in each dtype ran 2 steps (1 timed) on the
    real tokenizer's ids, found the call of the even row, and kept its parameters in the run's dtype."""
    completed, result = run_small(tmp_path, "--repeats", "1", "--steps", "2", "--batch", "2")
    assert result["case"] == "all" and len(result["trainers"]["aspo"]["step_s"]) == 1
    assert "| bfloat16 | async_aspo |" in completed.stdout

    smollm2 = result["smollm2"]
    assert smollm2["assets"] == "scripts/gpu_assets/smollm2_135m"
    assert (smollm2["model"]["layers"], smollm2["model"]["hidden"], smollm2["model"]["vocab"]) == (2, 64, 49156)
    assert smollm2["completion_length"] == 96 and smollm2["timed_steps"] == 1
    runs = smollm2["runs"]
    assert [(run["dtype"], run["trainer"]) for run in runs] == [
        (dtype, trainer) for dtype in ("bfloat16", "float32") for trainer in ("aspo", "async_aspo")
    ], runs
    for run in runs:
        assert len(run["step_s"]) == 1 and run["peak_memory_bytes"] is None  # CUDA only
        assert run["last_log"]["tools/tool_call_frac"] == 0.5
        assert run["last_log"]["shaping/eligible_frac"] == 0.5  # the calling row has reward 1
        assert math.isfinite(run["last_log"]["loss"])
    assert {run["tree_attention"] for run in runs if run["trainer"] == "async_aspo"} == {"PyTorch fallback"}
    names = {check["name"] for check in smollm2["checks"]}
    for dtype in ("bfloat16", "float32"):
        for trainer in ("aspo", "async_aspo"):
            for what in ("model parameters", "step loss", "step advantages", "tool calls detected"):
                assert f"smollm2 {dtype} {trainer} {what}" in names
    assert result["all_checks_ok"], [check for check in result["checks"] + smollm2["checks"] if not check["ok"]]


@pytest.mark.slow
def test_a_check_that_raises_is_recorded_and_the_timings_still_written(tmp_path, monkeypatch):
    gpu_check = load_script("gpu_check")

    def broken(*args):
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(gpu_check, "device_dtype_checks", broken)
    out = tmp_path / "gpu_check.json"
    arguments = ["--small", "--case", "qwen", "--out", str(out), "--repeats", "1", "--steps", "2", "--batch", "2"]
    result = gpu_check.main(arguments)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert not result["all_checks_ok"]
    assert result["checks"][0] == {"name": "device_dtype_checks", "ok": False, "error": "RuntimeError: no such kernel"}
    assert len(result["trainers"]["aspo"]["step_s"]) == 1
