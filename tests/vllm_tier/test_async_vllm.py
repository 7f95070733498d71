"""AsyncASPOTrainer with TRL's own rollout worker (its spawned process) against a real vLLM server on CPU: the three
methods, prioritized sampling, the CPU weight sync, a checkpoint and a resume, through the API and the CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile

import pytest
from helpers import MODEL, async_fields, calculator_tokenizer, digit_share_reward
from safetensors.torch import load_file
from vllm_common import (
    LOGPROB_TOLERANCE,
    fixed_prompt_ids,
    moved,
    policy_logprobs,
    server_completion,
    server_logprobs,
)

from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer
from trl_aspo.builtin.task import calculator, make_dataset
from trl_aspo.infra.vllm_cpu import CPUWeightTransfer

METHOD_FIELDS = dict(
    num_generations=1,
    per_device_train_batch_size=4,
    advantage_estimator="spo++",
    loss_type="aspo",
    tool_shaping=True,
    prioritized_sampling=True,
    max_inflight_tasks=4,
    dtype="float32",
)


def _trainer(tmp_path, server_url, reward=digit_share_reward, **overrides):
    args = AsyncASPOConfig(
        **async_fields(tmp_path, vllm_server_base_url=server_url, **{**METHOD_FIELDS, **overrides}),
    )
    return AsyncASPOTrainer(
        MODEL,
        reward_funcs=reward,
        args=args,
        train_dataset=make_dataset("train", 16, seed=0),
        processing_class=calculator_tokenizer(),
        tools=[calculator],
    )


def _logged(trainer, key):
    return [row[key] for row in trainer.state.log_history if key in row]


def test_trl_worker_trains_syncs_checkpoints_and_resumes(vllm_server, tmp_path, monkeypatch):
    from trl_aspo.infra.prompt_stream import PrioritizedPromptLoop
    from trl_aspo.infra.worker_stop import SafeStopAsyncRolloutWorker

    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    trainer = _trainer(tmp_path, vllm_server.url, max_steps=3, save_strategy="steps", save_steps=2)
    assert isinstance(trainer.weight_transfer, CPUWeightTransfer)  # chosen because the device is a CPU
    assert trainer.weight_transfer.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    # TRL's own worker, spawned at train begin, with the stop that does not hang on a dead child (infra/worker_stop.py)
    assert type(trainer.rollout_worker) is SafeStopAsyncRolloutWorker
    assert issubclass(trainer.rollout_worker._loop_cls, PrioritizedPromptLoop)
    trainer.train()
    initial = {name: tensor.float() for name, tensor in load_file(f"{MODEL}/model.safetensors").items()}
    assert moved(trainer.model, initial)

    losses = _logged(trainer, "loss")
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
    for key in ("aspo/flipped_frac", "value/mean", "shaping/eligible_frac"):
        assert _logged(trainer, key), key
    assert trainer.rollout_worker._process is None  # the child was stopped at train end
    assert not list(temporary.glob("trl-aspo-vllm-weights-*"))  # every synced copy of the policy was removed

    # The trainer's own sync path once more, then the server scores a fixed completion as the policy does.
    trainer._sync_weight()
    tokenizer = calculator_tokenizer()
    prompt = fixed_prompt_ids(tokenizer)
    completion = server_completion(vllm_server.url, prompt)
    gap = policy_logprobs(trainer.model, prompt, completion) - server_logprobs(vllm_server.url, prompt, completion)
    assert gap.abs().max().item() <= LOGPROB_TOLERANCE

    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert (checkpoint / "aspo_state.json").exists()
    resumed = _trainer(tmp_path, vllm_server.url, max_steps=4, save_strategy="steps", save_steps=2)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 4
    steps = [row["step"] for row in resumed.state.log_history if "loss" in row]
    assert steps == [1, 2, 3, 4]  # the checkpoint's history, then steps 3 and 4 trained after the resume


def test_cli_trains_with_trl_worker(vllm_server, tmp_path):
    """The asynchronous quickstart config with `--rollout_worker trl`: on a CPU the trainer picks the CPU weight sync
    and the CPU fallbacks by itself."""
    output_dir = tmp_path / "cli"
    command = [
        sys.executable,
        "-m",
        "trl_aspo.cli.main",
        "train",
        "--config",
        "configs/quickstart_async.yaml",
        "--rollout_worker",
        "trl",
        "--rollout_jitter_s",
        "0",
        "--vllm_server_base_url",
        vllm_server.url,
        "--dtype",
        "float32",
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "4",
        "--evaluate_before_after",
        "false",
        "--save_strategy",
        "steps",
        "--save_steps",
        "2",
        "--output_dir",
        str(output_dir),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    checkpoint = output_dir / "checkpoint-2"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    assert [row["step"] for row in state["log_history"] if "loss" in row] == [2]  # the config logs every 2 steps
    assert (checkpoint / "aspo_state.json").exists()
    assert (output_dir / "model.safetensors").exists()


def test_a_server_serving_another_model_name_is_refused_by_name(vllm_server, tmp_path):
    """TRL's worker asks the server for the policy's path or hub id; a server started under another name would answer
    404 to every request (TRL's worker retries them for minutes): the CPU weight transfer refuses at train begin."""
    import shutil

    from trl_aspo.builtin import CHECKPOINT_DIR

    copy = tmp_path / "tiny-calculator-copy"
    shutil.copytree(CHECKPOINT_DIR, copy)
    args = AsyncASPOConfig(**async_fields(tmp_path, vllm_server_base_url=vllm_server.url, **METHOD_FIELDS))
    trainer = AsyncASPOTrainer(
        str(copy),
        reward_funcs=digit_share_reward,
        args=args,
        train_dataset=make_dataset("train", 16, seed=0),
        processing_class=calculator_tokenizer(),
        tools=[calculator],
    )
    with pytest.raises(ValueError, match=f"asks for '{copy}': start the server with `--model {copy}`"):
        trainer.train()


def test_trl_worker_rollout_batches_move_the_proximal_ratio(vllm_server, tmp_path):
    """TRL's worker with the decoupled objective, rollout batches of two steps under `loglinear` (its samples carry
    their version's publication step) and TRL's PPO loss with the dual clip: the proximal ratio is 1 on each batch's
    first step and moves on its second."""
    trainer = _trainer(
        tmp_path,
        vllm_server.url,
        max_steps=4,
        logging_steps=1,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        loss_type="ppo",
        ppo_dual_clip=2.0,
        tool_shaping=False,
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_max=2.0,
        steps_per_rollout_batch=2,
        proximal_policy="loglinear",
    )
    trainer.train()
    moved_ratio = _logged(trainer, "offpolicy/proximal_log_ratio_abs_mean")
    assert len(moved_ratio) == 4
    assert moved_ratio[0] == 0.0 and moved_ratio[2] == 0.0
    assert moved_ratio[1] > 0.0 and moved_ratio[3] > 0.0
    assert len(_logged(trainer, "ppo/dual_clip_frac_later_steps")) == 2
    alphas = _logged(trainer, "offpolicy/proximal_alpha_mean")
    assert alphas[0] == 1.0 and alphas[2] == 1.0 and all(0.0 <= alpha < 1.0 for alpha in alphas[1::2])


def test_trl_worker_keeps_one_request_per_prompt_and_drains_at_publish(vllm_server, tmp_path):
    """SPO++'s runtime in TRL's spawned worker: three prompts and four generation slots, so one request in flight per
    prompt leaves a slot parked in a hold; every publish waits for the old weights' conversations, so no turn spans
    one (`rollout/turns_across_publish_total` 0 on every step), and training ends (no hold or drain hangs)."""
    args = AsyncASPOConfig(
        **async_fields(
            tmp_path,
            vllm_server_base_url=vllm_server.url,
            **{**METHOD_FIELDS, "tool_shaping": False, "prioritized_sampling": False},
            max_steps=3,
            logging_steps=1,
            max_inflight_per_prompt=1,
            drain_on_publish=True,
        ),
    )
    trainer = AsyncASPOTrainer(
        MODEL,
        reward_funcs=digit_share_reward,
        args=args,
        train_dataset=make_dataset("train", 3, seed=0),
        processing_class=calculator_tokenizer(),
        tools=[calculator],
    )
    trainer.train()
    assert trainer.state.global_step == 3
    across = _logged(trainer, "rollout/turns_across_publish_total")
    assert across and all(count == 0.0 for count in across)
    assert len(_logged(trainer, "perf/publish_drain_s")) >= 2
