"""The SmolLM2 recipes (configs/smollm2_calculator.yaml and its asynchronous twin) and the warm start's transcripts,
so none can rot: each config trains one step through `trl-aspo train` (on the converted model: the warm start itself
takes minutes, and the config's own model name is checked by the command's checks), and each transcript renders to a
call that TRL's parser reads back and that survives TRL's asynchronous worker (it follows its text after a newline)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import REPO_ROOT

from trl_aspo.builtin import SMOLLM2, load_builtin
from trl_aspo.builtin.smollm2_warmstart import transcripts
from trl_aspo.builtin.task import solve

CONFIG = REPO_ROOT / "configs" / "smollm2_calculator.yaml"


def test_each_transcript_renders_a_call_trl_parses(smollm2_dir):
    from trl.chat_template_utils import parse_response

    _, tokenizer = load_builtin(SMOLLM2)
    rows = transcripts(6, seed=0)
    for row in rows:
        tools = json.loads(row["tools"])
        prompt_ids = tokenizer.apply_chat_template(row["prompt"], tools=tools, add_generation_prompt=True)["input_ids"]
        full_ids = tokenizer.apply_chat_template(row["prompt"] + row["completion"][:1], tools=tools)["input_ids"]
        assert full_ids[: len(prompt_ids)] == prompt_ids
        turn = full_ids[len(prompt_ids) :]
        turn = turn[: turn.index(tokenizer.eos_token_id) + 1]
        text = tokenizer.decode(turn)
        assert "\n<tool_call>\n" in text and text.index("<tool_call>") > 0
        message = parse_response(tokenizer, turn, prefix=prompt_ids, tools=tools)
        call = message["tool_calls"][0]["function"]
        a, op, b = row["prompt"][-1]["content"].removeprefix("What is ").removesuffix("?").split(" ")
        assert call == {"name": "calculator", "arguments": {"expression": f"{a}{op}{b}"}}
        assert row["completion"][1]["content"] == str(solve(int(a), op, int(b)))
        assert row["completion"][2]["content"] == f"The answer is {solve(int(a), op, int(b))}."


# Each recipe's own batch shape, cut to one step of 2 short completions.
RECIPES = {
    "smollm2_calculator.yaml": {"steps_per_generation": "1"},
    "smollm2_calculator_async.yaml": {"steps_per_rollout_batch": "1"},
}


@pytest.mark.slow
@pytest.mark.parametrize("config", sorted(RECIPES))
def test_the_recipe_config_trains_one_step(tmp_path, smollm2_dir, config):
    overrides = {
        "model_name_or_path": SMOLLM2,
        "output_dir": str(tmp_path / "out"),
        "max_steps": "1",
        **RECIPES[config],
        "per_device_train_batch_size": "2",
        "max_completion_length": "16",
        # The before/after evaluation on one problem: the asynchronous recipe once crashed there (a tokenizer loaded
        # from the folder has no response template to parse calls with).
        "builtin_test_size": "1",
        "eval_samples_per_problem": "1",
        "save_strategy": "no",
        "plot": "false",
    }
    flags = [item for name, value in overrides.items() for item in (f"--{name}", value)]
    result = subprocess.run(
        [sys.executable, "-m", "trl_aspo.cli.main", "train", "--config", str(CONFIG.with_name(config)), *flags],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert f"Model saved to {tmp_path / 'out'}." in result.stdout
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["before"]["num_problems"] == summary["after"]["num_problems"] == 1


def test_trainer_async_refuses_use_peft_on_the_command_line_by_name():
    """LoRA runs in AsyncASPOTrainer through the Python API (`peft_config=`, test_training.py), but `trl-aspo train
    --trainer async` takes no ModelConfig LoRA field: refused before torch loads, naming it."""
    from trl_aspo.cli.command_line import check_command_line
    from trl_aspo.cli.config_errors import ConfigurationError

    argv = ["--trainer", "async", "--model_name_or_path", SMOLLM2, "--use_peft", "true", "--lora_r", "8"]
    with pytest.raises(ConfigurationError) as error:
        check_command_line(argv)
    assert [str(problem) for problem in error.value.problems] == [
        f"--{name} (command line): '{name}' is a field of ModelConfig (trainer: sync), which trainer: async does "
        "not take; remove it, or set trainer: sync"
        for name in ("use_peft", "lora_r")
    ]
