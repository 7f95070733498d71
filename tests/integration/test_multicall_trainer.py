"""The shipped `builtin:tiny-multicall`: a short training run that makes several calls, and `trl-aspo evaluate`
defaulting to the multicall task for it."""

from __future__ import annotations

import json

import pytest
from helpers import tiny_run_fields

from trl_aspo import ASPOConfig, ASPOTrainer
from trl_aspo.builtin import MULTICALL_CHECKPOINT_DIR, TINY_MULTICALL, load_builtin
from trl_aspo.builtin.multicall import calculator, correctness_reward, make_dataset, make_problems, question
from trl_aspo.evaluation.tool_use import evaluate_tool_use

needs_checkpoint = pytest.mark.skipif(
    not (MULTICALL_CHECKPOINT_DIR / "model.safetensors").is_file(),
    reason="the warm-started builtin:tiny-multicall checkpoint is not built (scripts/build_tiny_multicall.py)",
)


# ----------------------------------------------------------------------------------------- shipped model
@pytest.mark.slow
@needs_checkpoint
def test_shipped_model_trains_and_makes_several_calls(tmp_path):
    model, tokenizer = load_builtin(TINY_MULTICALL)
    dataset = make_dataset("train", 8, seed=0)
    args = ASPOConfig(
        **tiny_run_fields(
            tmp_path,
            per_device_train_batch_size=4,
            num_generations=2,
            max_completion_length=128,
            max_tool_calling_iterations=4,
            learning_rate=1e-4,
        )
    )
    trainer = ASPOTrainer(
        model, [correctness_reward], args, train_dataset=dataset, processing_class=tokenizer, tools=[calculator]
    )
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "tools/calls_per_completion" in entry]
    assert len(logged) == 2
    metrics = evaluate_tool_use(
        trainer.model,
        tokenizer,
        make_dataset("test", 32, seed=0),
        correctness_reward,
        [calculator],
        temperature=1.0,
        max_completion_length=128,
        max_tool_calls=4,
        progress=False,
    )
    assert metrics["calls_per_completion"] > 1.2
    assert max(record["num_calls"] for record in metrics["records"]) >= 2


@pytest.mark.slow
@needs_checkpoint
def test_evaluate_command_defaults_to_the_multicall_task_for_its_model(tmp_path):
    from trl_aspo.cli.main import main as cli_main

    output = tmp_path / "eval.json"
    argv = ["evaluate", "--model", TINY_MULTICALL, "--limit", "4", "--records", "--output", str(output)]
    code = cli_main([*argv, "--max_completion_length", "128", "--max_tool_calling_iterations", "4"])
    assert code == 0
    report = json.loads(output.read_text())
    assert (report["model"], report["dataset"], report["split"]) == (TINY_MULTICALL, "builtin:multicall", "test")
    questions = [record["prompt"][0]["content"] for record in report["records"]]
    assert questions == [question(problem) for problem in make_problems("test", 4, seed=0)]
    assert report["settings"]["max_tool_calling_iterations"] == 4
