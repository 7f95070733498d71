"""The `trl-aspo` command as a user runs it: help without torch, every configuration mistake as one block with
status 2 (no traceback), missing local paths refused at once, and what a run without max_steps will train."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import REPO_ROOT as REPO

# The commands below answer from the field table before torch loads: built once, before the first of them.
pytestmark = pytest.mark.usefixtures("field_table_cache")

# Runs the command in a fresh interpreter and reports, at exit, whether torch was imported on the way.
RUNNER = textwrap.dedent(
    """
    import atexit, sys
    atexit.register(lambda: sys.stderr.write("\\n@@torch_imported=%s\\n" % ("torch" in sys.modules)))
    from trl_aspo.cli.main import main
    sys.exit(main(sys.argv[1:]))
    """
)


def run_cli(*argv, cwd=None, timeout=300):
    """(exit status, stdout, stderr without the marker, whether torch was imported, seconds)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", RUNNER, *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd or REPO,
        env=env,
    )
    seconds = time.perf_counter() - start
    stderr, _, marker = result.stderr.rpartition("\n@@torch_imported=")
    return result.returncode, result.stdout, stderr.strip(), marker.strip() == "True", seconds


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text).lstrip())
    return path


BASE = """
output_dir: out
report_to: none
use_cpu: true
model_name_or_path: builtin:tiny-calculator
dataset_name: builtin:calculator
reward_funcs: [builtin:correctness]
max_steps: 1
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["train", "--help"],
        ["train", "--trainer", "async", "--help"],
        ["evaluate", "--help"],
        ["values", "--help"],
        ["compare", "--help"],
        ["plot", "--help"],
    ],
)
def test_help_of_every_command_answers_without_importing_torch(argv):
    status, stdout, stderr, torch_imported, seconds = run_cli(*argv)
    assert status == 0, stderr
    assert stdout.startswith("usage: trl-aspo")
    assert not torch_imported
    # Importing torch and TRL alone took 4 s on a quiet 2-core machine (25-69 s under load); help takes ~0.1 s.
    assert seconds < 10


def test_train_help_lists_trl_aspo_fields_by_method_first_with_complete_choices():
    from trl_aspo.cli.parsers import make_parser

    _, stdout, _, _, _ = run_cli("train", "--help")
    lines = stdout.splitlines()
    assert lines[0] == "usage: trl-aspo train --config X.yaml [--key value ...]"
    assert "  --config FILE" in lines
    groups = [line for line in lines if line.endswith(":") and not line.startswith(" ")]
    assert groups[1:6] == [
        "trl-aspo: what to train on, evaluation and trainer choice (ASPOScriptArguments):",
        "trl-aspo: Policy loss:",
        "trl-aspo: Asymmetric IS loss:",
        "trl-aspo: Recipe options of the ASPO reference (Archer2.0):",
        "trl-aspo: Tool-position advantage shaping:",
    ]
    assert groups.index("TRL GRPOConfig and transformers TrainingArguments:") > groups.index(
        "trl-aspo: Single-stream value tracking:"
    )
    loss_help = stdout[stdout.index("  --loss_type") :].split("\n  --", 1)[0]
    for value in ("aspo", "grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"):
        assert f"'{value}'" in loss_help
    # Every option the real parser has a choice list for shows all its choices.
    for action in make_parser()._actions:
        if action.choices is not None and action.option_strings[0] != "-h":
            usage = f"  {action.option_strings[0]} {{{','.join(str(choice) for choice in action.choices)}}}"
            assert usage in lines, usage


def test_yaml_typo_is_one_line_with_a_suggestion_before_torch(tmp_path):
    path = write(tmp_path / "run.yaml", BASE + "tool_shapng: true\n")
    status, _, stderr, torch_imported, _ = run_cli("train", "--config", path)
    assert status == 2 and not torch_imported and "Traceback" not in stderr
    assert (
        stderr.splitlines()[0] == f"trl-aspo train: tool_shapng (in {path}): unknown key; did you mean tool_shaping?"
    )


def test_flag_typo_reads_like_the_yaml_typo(tmp_path):
    path = write(tmp_path / "run.yaml", BASE)
    status, _, stderr, torch_imported, _ = run_cli("train", "--config", path, "--tool_shapng", "true")
    assert status == 2 and not torch_imported
    assert stderr.splitlines()[0] == (
        "trl-aspo train: --tool_shapng (command line): unknown flag; did you mean --tool_shaping?"
    )


def test_every_mistake_of_yaml_and_flags_comes_in_one_block(tmp_path):
    path = write(tmp_path / "run.yaml", BASE.replace("max_steps: 1", "max_steps: ten") + "lerning_rate: 0.1\n")
    status, _, stderr, _, _ = run_cli(
        "train", "--config", path, "--num_generatons", "2", "--max_staleness", "2", "--loss_type"
    )
    assert status == 2 and "Traceback" not in stderr
    assert stderr.splitlines() == [
        "trl-aspo train: 5 configuration errors:",
        f"  max_steps (in {path}): 'ten' is not an integer",
        f"  lerning_rate (in {path}): unknown key; did you mean learning_rate?",
        "  --num_generatons (command line): unknown flag; did you mean --num_generations?",
        "  --max_staleness (command line): 'max_staleness' is a field of AsyncASPOConfig (trainer: async), which "
        "trainer: sync does not take; remove it, or set trainer: async",
        "  --loss_type (command line): takes one value, got none",
        "Run `trl-aspo train --help` for every field.",
    ]


def test_async_trainer_mistakes_are_found_the_same_way(tmp_path):
    path = write(tmp_path / "run.yaml", "trainer: async\n" + BASE + "max_stalenes: 2\nnum_iterations: 2\n")
    status, _, stderr, _, _ = run_cli("train", "--config", path, "--rollout_worker", "vlm")
    assert status == 2
    assert stderr.splitlines()[:4] == [
        "trl-aspo train: 3 configuration errors:",
        f"  max_stalenes (in {path}): unknown key; did you mean max_staleness?",
        f"  num_iterations (in {path}): 'num_iterations' is a field of ASPOConfig (trainer: sync), which trainer: "
        "async does not take; remove it, or set trainer: sync",
        "  rollout_worker (command line): 'vlm' is not one of ['auto', 'local', 'trl']",
    ]


def test_missing_config_file_is_named(tmp_path):
    status, _, stderr, torch_imported, _ = run_cli("train", "--config", tmp_path / "nope.yaml")
    assert status == 2 and not torch_imported
    assert stderr.splitlines()[0] == f"trl-aspo train: --config '{tmp_path / 'nope.yaml'}': no such file"


def test_a_value_the_config_validation_refuses_is_one_line_not_a_traceback(tmp_path):
    path = write(tmp_path / "run.yaml", BASE)
    status, _, stderr, _, _ = run_cli("train", "--config", path, "--aspo_dual_clip", "0.5")
    assert status == 2 and "Traceback" not in stderr
    assert stderr.splitlines()[0].startswith("trl-aspo train: ASPOConfig.aspo_dual_clip=0.5")


def test_reward_entries_must_be_a_list_of_functions(tmp_path):
    path = write(tmp_path / "run.yaml", BASE.replace("[builtin:correctness]", "builtin:correctness"))
    status, _, stderr, _, _ = run_cli("train", "--config", path)
    assert status == 2
    assert stderr.splitlines()[0] == (
        f"trl-aspo train: reward_funcs (in {path}): a list, e.g. [builtin:correctness]; got the str "
        "'builtin:correctness'"
    )
    path = write(tmp_path / "pi.yaml", BASE.replace("[builtin:correctness]", "[math.pi, builtin:correctness]"))
    status, _, stderr, _, _ = run_cli("train", "--config", path)
    assert status == 2 and "Traceback" not in stderr
    assert stderr.splitlines()[0] == (
        "trl-aspo train: reward_funcs entry 'math.pi' is a float (3.141592653589793), not a function."
    )


@pytest.mark.parametrize(
    ("argv", "first_line"),
    [
        (["evaluate", "--model", "out/nope"], "trl-aspo evaluate: --model 'out/nope': no such directory"),
        (["evaluate", "--model", "./nope"], "trl-aspo evaluate: --model './nope': no such directory"),
        (["evaluate", "--config", "nope.yaml"], "trl-aspo evaluate: --config 'nope.yaml': no such file"),
        (
            ["train", "--config", "run.yaml", "--model_name_or_path", "out/nope"],
            "trl-aspo train: --model_name_or_path (command line) 'out/nope': no such directory",
        ),
        (
            ["train", "--config", "run.yaml", "--resume_from_checkpoint", "out/checkpoint-9"],
            "trl-aspo train: --resume_from_checkpoint (command line) 'out/checkpoint-9': no such directory",
        ),
        (["plot", "out/run_a"], "trl-aspo plot: RUN_DIR 'out/run_a': no such directory"),
        (["values", "out/checkpoint-9"], "trl-aspo values: CHECKPOINT 'out/checkpoint-9': no such directory"),
        (["compare", "--config", "nope.yaml"], "trl-aspo compare: --config 'nope.yaml': no such file"),
    ],
)
def test_a_mistyped_local_path_is_refused_at_once(tmp_path, argv, first_line):
    """`out/` exists, so `out/nope` is a local path (not a hub id 'org/name') that does not exist."""
    (tmp_path / "out").mkdir()
    write(tmp_path / "run.yaml", BASE)
    status, _, stderr, torch_imported, _ = run_cli(*argv, cwd=tmp_path)
    assert status == 2 and "Traceback" not in stderr
    assert stderr.splitlines()[0] == first_line
    assert not torch_imported


def test_evaluate_with_a_config_measures_what_the_before_after_summary_measures(tmp_path):
    """`evaluate --config configs/quickstart.yaml` uses its eval_samples_per_problem (4) and eval_temperature (1.0)
    and gives the numbers of the before/after code path (BeforeAfterReport) on the same model and problems."""
    output = tmp_path / "evaluation.json"
    overrides = ["--builtin_test_size", "6", "--output_dir", str(tmp_path / "run")]
    status, stdout, stderr, _, _ = run_cli(
        "evaluate", "--model", "builtin:tiny-calculator", "--config", "configs/quickstart.yaml", *overrides,
        "--output", output,
    )  # fmt: skip
    assert status == 0, stderr
    assert stdout.splitlines()[0] == (
        "Evaluating builtin:tiny-calculator on builtin:calculator [test]: 6 problems x 4 sample(s), temperature "
        "1.0, max_completion_length 64, max_tool_calling_iterations 1, seed 0."
    )
    evaluated = json.loads(output.read_text())
    assert evaluated["settings"]["num_samples"] == 4 and evaluated["settings"]["temperature"] == 1.0

    import yaml

    from trl_aspo.cli.train import build_sync_trainer, load_datasets, parse_config, resolve_functions
    from trl_aspo.evaluation.report import BeforeAfterReport

    config = yaml.safe_load((REPO / "configs/quickstart.yaml").read_text())
    config.pop("env")
    config.update(builtin_test_size=6, output_dir=str(tmp_path / "run"))
    script, training, model, dataset_args = parse_config(config)
    reward_funcs, tools = resolve_functions(script)
    train, test = load_datasets(script, dataset_args)
    trainer = build_sync_trainer(training, model, reward_funcs, tools, train, test)
    report = BeforeAfterReport(
        trainer, test, reward_funcs, tools, script.eval_samples_per_problem, script.eval_temperature
    )
    report.measure("before")
    assert report.results["before"] == pytest.approx(evaluated["metrics"], nan_ok=True)


def test_prompt_id_column_is_checked_when_the_synchronous_trainer_reads_the_dataset(
    tiny_model, tiny_tokenizer, tiny_config
):
    """A None id in row 5 stops ASPOTrainer before training, naming the row and the column (it used to stop the
    run when row 5 was first drawn)."""
    from trl_aspo import ASPOTrainer
    from trl_aspo.builtin.task import correctness_reward, make_dataset

    dataset = make_dataset("train", 8, seed=0)
    dataset = dataset.add_column("pid", [f"p{i}" if i != 5 else None for i in range(8)])
    args = tiny_config(advantage_estimator="spo", num_generations=1, prompt_id_column="pid")
    with pytest.raises(ValueError, match=r"^dataset row 5: prompt id column 'pid' holds None"):
        ASPOTrainer(
            tiny_model, reward_funcs=[correctness_reward], args=args, train_dataset=dataset,
            processing_class=tiny_tokenizer,
        )  # fmt: skip


@pytest.mark.slow
def test_max_steps_unset_says_how_many_optimizer_steps_it_trains(tiny_model, tiny_tokenizer, tiny_config):
    """The start-up line's count is the one transformers then trains (`state.max_steps`)."""
    from trl_aspo import ASPOTrainer
    from trl_aspo.builtin.task import correctness_reward, make_dataset
    from trl_aspo.cli.train import training_length_message

    dataset = make_dataset("train", 32, seed=0)
    args = tiny_config(max_steps=-1, num_train_epochs=0.25, steps_per_generation=2, gradient_accumulation_steps=1)
    trainer = ASPOTrainer(
        tiny_model, reward_funcs=[correctness_reward], args=args, train_dataset=dataset,
        processing_class=tiny_tokenizer,
    )  # fmt: skip
    message = training_length_message(trainer, dataset)
    trainer.train()
    # A round is 8 x 2 completions = 4 prompts x 4: 8 rounds of 2 steps per epoch, a quarter of that is 4 steps.
    assert trainer.state.max_steps == 4
    assert message == (
        "max_steps=-1: training num_train_epochs=0.25 epochs over 32 prompts (8 generation rounds of 4 prompts per "
        "epoch) = 4 optimizer steps."
    )
