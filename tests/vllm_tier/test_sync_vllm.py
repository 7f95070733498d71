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
from helpers import tiny_run_fields
from safetensors.torch import load_file
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


def test_vllm_correction_multiplies_the_asymmetric_term(vllm_server, tmp_path, monkeypatch):
    """In a server-mode run with TRL's correction on and a second pass over each batch (so r != 1): the flip's old
    policy is the trainer's recomputation, and the per-token loss that is aggregated is `c * aspo term`, with
    `c = min(exp(lp_old - lp_vllm), 3)` computed here from the batch."""
    from helpers import digit_share_reward
    from transformers import AutoModelForCausalLM

    import trl_aspo.algorithms.aspo_policy_loss as aspo_registration
    import trl_aspo.trainers.loss_assembly as loss_assembly
    from trl_aspo import ASPOConfig, ASPOTrainer
    from trl_aspo.builtin import load_tokenizer
    from trl_aspo.builtin.task import make_dataset

    calls = {"aspo": [], "aggregate": [], "inputs": []}
    asymmetric_policy_loss, aggregate_loss = aspo_registration.asymmetric_policy_loss, loss_assembly.aggregate_loss

    def recording_aspo(per_token_logps, old_per_token_logps, advantages, **kwargs):
        per_token_loss, stats = asymmetric_policy_loss(per_token_logps, old_per_token_logps, advantages, **kwargs)
        calls["aspo"].append((old_per_token_logps.detach(), per_token_loss.detach(), stats["ratio"]))
        return per_token_loss, stats

    def recording_aggregate(per_token_loss, *args, **kwargs):
        calls["aggregate"].append(per_token_loss.detach())
        return aggregate_loss(per_token_loss, *args, **kwargs)

    class RecordingTrainer(ASPOTrainer):
        def _compute_registered_loss(self, model, inputs, policy_loss):
            calls["inputs"].append({key: value for key, value in inputs.items() if isinstance(value, torch.Tensor)})
            return super()._compute_registered_loss(model, inputs, policy_loss)

    monkeypatch.setattr(aspo_registration, "asymmetric_policy_loss", recording_aspo)
    monkeypatch.setattr(loss_assembly, "aggregate_loss", recording_aggregate)
    fields = _fields(
        tmp_path,
        "corrected",
        "server",
        vllm_server.url,
        max_steps=2,
        num_iterations=2,
        loss_type="aspo",
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_max=3.0,
    )
    tokenizer = load_tokenizer(CHECKPOINT_DIR)
    trainer = RecordingTrainer(
        model=AutoModelForCausalLM.from_pretrained(str(CHECKPOINT_DIR), dtype=torch.float32),
        reward_funcs=[digit_share_reward],
        args=ASPOConfig(**fields),
        train_dataset=make_dataset("train", 32, seed=0),
        processing_class=tokenizer,
    )
    trainer.train()

    assert len(calls["inputs"]) == 2 and len(calls["aspo"]) == 2 and len(calls["aggregate"]) == 2
    off_policy = 0
    for inputs, (old, aspo_term, ratio), aggregated in zip(
        calls["inputs"], calls["aspo"], calls["aggregate"], strict=True
    ):
        mask = inputs["completion_mask"].bool()
        correction = torch.exp(inputs["old_per_token_logps"] - inputs["sampling_per_token_logps"]).clamp(max=3.0)
        torch.testing.assert_close(inputs["importance_sampling_ratio"][mask], correction[mask])
        torch.testing.assert_close(old, inputs["old_per_token_logps"])  # the flip's old policy: the recomputation
        torch.testing.assert_close(aggregated[mask], (aspo_term * correction)[mask])
        off_policy += int((ratio[mask] - 1).abs().max() > 1e-6)
    assert off_policy >= 1  # the second pass over a batch saw r != 1, so the flip acted under the correction
    for key in ("sampling/importance_sampling_ratio/mean", "aspo/flip_weight_mean"):
        assert any(key in row for row in trainer.state.log_history), key
