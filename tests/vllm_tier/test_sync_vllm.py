"""ASPOTrainer generating with vLLM (server and colocate modes) on CPU: TRL's GRPOTrainer computed again with every
switch off, the three methods with the calculator tool and one completion per prompt, weights that reach the engine,
and TRL's vLLM importance-sampling correction composed with the asymmetric loss."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_fields import tiny_run_fields
from vllm_common import LOGPROB_TOLERANCE

from trl_aspo.builtin import CHECKPOINT_DIR

RUNNER = Path(__file__).with_name("sync_run.py")
MODES = ["server", "colocate"]


def _fields(tmp_path, name, mode, server_url, **overrides) -> dict:
    # Two trainers must see the same generations. The shared server's sampler runs on between requests, so each
    # request carries a seed (TRL asks for a group's completions in one request); a colocated engine is created
    # afresh per run with TRL's fixed seed, while a seed per request would repeat one completion across its group.
    if mode == "server":
        engine = {"vllm_server_base_url": server_url, "generation_kwargs": {"seed": 0}}
    else:
        engine = {"vllm_max_model_length": 512}
    fields = tiny_run_fields(tmp_path / name, use_vllm=True, vllm_mode=mode, learning_rate=1e-2, **engine)
    fields.update(overrides)
    fields["output_dir"] = str(fields["output_dir"])
    return fields


def _run(tmp_path, name, mode, trainer, config, reward="digit_share", tools=False) -> tuple[dict, dict]:
    """One run through `sync_run.py`: in this process for server mode, in a fresh one for colocate."""
    spec = {"trainer": trainer, "config": config, "reward": reward, "tools": tools}
    spec_path, result_path = tmp_path / f"{name}.json", tmp_path / f"{name}.result.json"
    spec_path.write_text(json.dumps(spec))
    if mode == "server":
        sys.path.insert(0, str(RUNNER.parent))
        from sync_run import run

        run(spec, result_path)
    else:
        done = subprocess.run(
            [sys.executable, str(RUNNER), str(spec_path), str(result_path)], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return json.loads(result_path.read_text()), load_file(str(result_path.with_suffix(".safetensors")))


def _history(result, key):
    return [row[key] for row in result["log_history"] if key in row and "train_runtime" not in row]


@pytest.mark.parametrize("mode", MODES)
def test_everything_off_computes_what_grpo_computes(vllm_server, tmp_path, mode):
    fields = _fields(tmp_path, "run", mode, vllm_server.url, max_steps=2)
    grpo, grpo_params = _run(tmp_path, "grpo", mode, "grpo", {**fields, "output_dir": str(tmp_path / "grpo")})
    aspo, aspo_params = _run(tmp_path, "aspo", mode, "aspo", {**fields, "output_dir": str(tmp_path / "aspo")})
    assert len(_history(aspo, "loss")) == 2
    assert _history(grpo, "reward") == _history(aspo, "reward")
    assert _history(grpo, "loss") == _history(aspo, "loss")
    assert grpo_params.keys() == aspo_params.keys()
    for name in grpo_params:
        assert torch.equal(grpo_params[name], aspo_params[name]), name
    initial = load_file(str(CHECKPOINT_DIR / "model.safetensors"))
    assert any(not torch.equal(initial[name].float(), aspo_params[name]) for name in aspo_params)


@pytest.mark.parametrize("mode", MODES)
def test_three_methods_train_with_the_tool_and_reach_the_engine(vllm_server, tmp_path, mode):
    config = _fields(
        tmp_path,
        "methods",
        mode,
        vllm_server.url,
        num_generations=1,
        max_steps=3,
        loss_type="aspo",
        tool_shaping=True,
        advantage_estimator="spo++",
        max_tool_calling_iterations=1,
        max_completion_length=64,
        learning_rate=1e-4,
    )
    result, params = _run(tmp_path, "methods", mode, "aspo", config, reward="correctness", tools=True)
    losses = _history(result, "loss")
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
    assert max(_history(result, "tools/tool_call_frac")) > 0  # the built-in model calls its calculator
    for key in ("aspo/flipped_frac", "value/mean", "shaping/eligible_frac", "zero_advantage_share"):
        assert _history(result, key), key
    initial = load_file(str(CHECKPOINT_DIR / "model.safetensors"))
    assert any(not torch.equal(initial[name].float(), params[name]) for name in params)
    # After the optimizer steps and a weight sync the engine scores a completion as the policy does (float32).
    assert result["completion_length"] > 0
    assert result["logprob_gap"] <= LOGPROB_TOLERANCE
