"""The `trl-aspo` command in a user's first hour (issue 25, items 6, 7, 9, 10, 11, 12), without training: one safe
YAML loader with bounded aliases, overrides typed before a resumed comparison compares them, reward entries that
are not names, only complete checkpoints resumed, the output_dir warning, `--num_processes` on a CPU, the checks that
answer before torch loads, `report_to` packages, and a resume command that runs as printed.

The runs themselves (two CPU processes, resuming past an incomplete checkpoint):
tests/integration/test_cli_first_hour_runs.py."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import textwrap
import time
from importlib.util import find_spec
from pathlib import Path

import pytest
from helpers import REPO_ROOT, two_by_two

from trl_aspo.cli.command_line import check_command_line
from trl_aspo.cli.compare import finished_summary, write_json
from trl_aspo.cli.config_errors import SHOWN_CHARACTERS, ConfigurationError, shown
from trl_aspo.cli.experiment_file import apply_command_line, load_experiment, parse_override
from trl_aspo.cli.run_checks import existing_checkpoints_warning
from trl_aspo.cli.value_checks import BUILTIN_DATASET_NAMES, BUILTIN_REWARD_NAMES, BUILTIN_TOOL_NAMES
from trl_aspo.cli.yaml_loading import ALIAS_EXPANSION_LIMIT, load_yaml, read_config
from trl_aspo.trainers.resume import resolve_resume_checkpoint, resume_command, skipped_checkpoints_note

# The commands below answer from the field table before torch loads: built once, before the first of them.
pytestmark = pytest.mark.usefixtures("field_table_cache")

SMOKE = str(REPO_ROOT / "configs" / "smoke.yaml")
# Runs the command in a fresh interpreter and reports, at exit, whether torch was imported on the way.
RUNNER = textwrap.dedent(
    """
    import atexit, sys
    atexit.register(lambda: sys.stderr.write("\\n@@torch_imported=%s\\n" % ("torch" in sys.modules)))
    from trl_aspo.cli.main import main
    sys.exit(main(sys.argv[1:]))
    """
)


def run_cli(*argv, cwd=None):
    """(exit status, stderr without the marker, whether torch was imported, seconds) of `trl-aspo ARGV`."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", RUNNER, *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd or REPO_ROOT,
        env=env,
    )
    stderr, _, marker = result.stderr.rpartition("\n@@torch_imported=")
    return result.returncode, stderr.strip(), marker.strip() == "True", time.perf_counter() - start


def alias_bomb(levels: int = 9) -> str:
    """A flow list of `levels` nested anchors, each level ten aliases of the one below: 10^levels leaves."""
    value = "&a0 [x, x, x, x, x, x, x, x, x, x]"
    for level in range(1, levels):
        value = f"&a{level} [{value}, " + ", ".join([f"*a{level - 1}"] * 9) + "]"
    return value


def smoke_with(tmp_path, **lines: str):
    """configs/smoke.yaml with some keys replaced (each value written as YAML text)."""
    kept = [line for line in Path(SMOKE).read_text().splitlines() if line.split(":")[0].strip() not in lines]
    text = "".join(f"{line}\n" for line in kept) + "".join(f"{key}: {value}\n" for key, value in lines.items())
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


# ----------------------------------------------------------------------------------------------- item 6: YAML
def test_an_alias_bomb_in_a_scalar_field_is_refused_by_every_loader_and_a_small_merge_is_not(tmp_path):
    """10^9 leaves in `learning_rate` (9 levels of 10 aliases): refused in a moment, naming the file and the
    aliases, by `train --config`, a `compare` experiment file and a `compare` override; the message itself is
    short. An ordinary `<<: *common` merge stays allowed."""
    config = smoke_with(tmp_path, learning_rate=alias_bomb())
    start = time.perf_counter()
    with pytest.raises(ConfigurationError) as refused:
        check_command_line(["--config", config])
    assert time.perf_counter() - start < 5
    (message,) = refused.value.problems
    assert message.startswith(f"--config {config!r}: its aliases (*a0 (line ")
    assert "expand to 1,111,111,1" in message and f"at most {ALIAS_EXPANSION_LIMIT:,} more" in message
    assert len(message) < 400

    experiment = tmp_path / "bomb_experiment.yaml"
    experiment.write_text(
        f"output_dir: out\nseeds: [0]\nvariants: {{a: {{}}}}\nbase: {{learning_rate: {alias_bomb()}}}\n"
    )
    with pytest.raises(ValueError, match=rf"^experiment file {experiment}: its aliases \(\*a0"):
        load_experiment(str(experiment))
    with pytest.raises(ValueError, match=r"^override 'learning_rate=&a8 \[&a7 .*\.\.\..*\*a7\]': its aliases \(\*a0"):
        parse_override(f"learning_rate={alias_bomb()}")

    merged = load_yaml("common: &common {loss_type: aspo, beta: 0.0}\nvariant: {<<: *common, beta: 0.1}\n", "x.yaml")
    assert merged["variant"] == {"loss_type": "aspo", "beta": 0.1}
    with pytest.raises(ConfigurationError, match="an alias inside its own anchor"):
        load_yaml("a: &loop [1, *loop]\n", "loop.yaml")


def test_a_python_tag_is_refused_with_a_message_naming_the_file_or_override(tmp_path, capsys):
    """`!!python/object/apply:os.system` builds nothing and runs nothing: a `compare` override is a usage error
    (exit 2) naming the override, an experiment file and a `--config` file name themselves and the line."""
    marker = tmp_path / "ran"
    config, _ = two_by_two(tmp_path)
    from trl_aspo.cli.compare import compare_main

    with pytest.raises(SystemExit) as exit_info:
        compare_main(["--config", config, f"max_steps=!!python/object/apply:os.makedirs [{marker}]"])
    assert exit_info.value.code == 2 and not marker.exists()
    error = capsys.readouterr().err
    assert "Traceback" not in error
    # The override is shown cut in its middle (it may be long); the tag in full.
    assert "trl-aspo compare: error: override 'max_steps=!!python/object/apply:os.ma..." in error
    assert f"{marker.name}]' (line 1): could not determine a constructor" in error
    assert "could not determine a constructor for the tag '!!python/object/apply:os.makedirs'" in error
    assert "trl-aspo reads plain YAML only" in error

    tagged = tmp_path / "tagged.yaml"
    tagged.write_text(
        f"output_dir: out\nseeds: [0]\nvariants: {{a: {{}}}}\nbase: !!python/object/apply:os.makedirs [{marker}]\n"
    )
    with pytest.raises(ValueError, match=rf"^experiment file {tagged} \(line 4\): could not determine a constructor"):
        load_experiment(str(tagged))
    with pytest.raises(ConfigurationError, match=rf"^--config '{tagged}' \(line 4\): could not determine"):
        read_config(str(tagged))
    assert not marker.exists()


def test_a_resumed_comparison_compares_overrides_with_their_fields_type(tmp_path):
    """The run finished with learning_rate 1e-3 (the base); `learning_rate=2e-4` (a string to YAML 1.1) is the
    number 0.0002 when the run configs are compared, and an override written as text then and as a number now is the
    same run."""
    config, _ = two_by_two(tmp_path)
    experiment = apply_command_line(load_experiment(config), seeds=[0], variants=["dapo"])
    write_json(experiment.run_dir("dapo", 0) / "run_summary.json", {"config": experiment.run_config("dapo", 0)})
    changed = apply_command_line(
        load_experiment(config), seeds=[0], variants=["dapo"], overrides=["learning_rate=2e-4"]
    )
    assert changed.overrides == {"learning_rate": 0.0002}
    with pytest.raises(
        ValueError,
        match=r"\(learning_rate: 0\.001 then, 0\.0002 now; command-line overrides then: "
        r"none, now: learning_rate=0\.0002\)",
    ):
        finished_summary(changed, "dapo", 0)

    # A summary written before overrides were typed recorded the text '2e-4': the same run as 0.0002 now.
    old_style = {**experiment.run_config("dapo", 0), "learning_rate": "2e-4"}
    write_json(experiment.run_dir("dapo", 0) / "run_summary.json", {"config": old_style, "overrides": {}})
    assert finished_summary(changed, "dapo", 0)["config"]["learning_rate"] == "2e-4"


def test_a_reward_entry_that_is_not_a_name_is_named_with_what_is_allowed(tmp_path):
    """`reward_funcs: [5]`: train's checks, compare's run configs and the resolver itself name the field, the entry
    and what an entry may be (no AttributeError from `5.rpartition`)."""
    allowed = "each entry is a built-in name ['builtin:correctness'] or a dotted import path 'module.function'"
    config = smoke_with(tmp_path, reward_funcs="[5]")
    with pytest.raises(ConfigurationError) as refused:
        check_command_line(["--config", config])
    assert refused.value.problems == [f"reward_funcs (in {config}): entry 5 (int) is not a name; {allowed}"]

    experiment, _ = two_by_two(tmp_path)
    with pytest.raises(ValueError, match=r"reward_funcs \(run config\): entry 5 \(int\) is not a name; each entry"):
        apply_command_line(load_experiment(experiment), overrides=["reward_funcs=[5]"])

    from trl_aspo.builtin.registry import BUILTIN_REWARDS
    from trl_aspo.cli.parsers import resolve_callable

    with pytest.raises(ValueError, match=r"^reward_funcs entry 5 \(int\) is not a name: give a built-in name"):
        resolve_callable(5, BUILTIN_REWARDS, "reward_funcs entry")


def test_a_list_for_a_number_is_refused_and_messages_show_values_bounded(tmp_path):
    config = smoke_with(tmp_path, learning_rate="[0.1, 0.2]", max_steps="{a: 1}")
    with pytest.raises(ConfigurationError) as refused:
        check_command_line(["--config", config])
    assert refused.value.problems == [
        f"learning_rate (in {config}): one value (a number), not the list [0.1, 0.2]",
        f"max_steps (in {config}): one value (an integer), not the dict {{'a': 1}}",
    ]
    # A value a billion leaves deep (shared, as YAML aliases build it) is shown in a moment and briefly.
    level = ["x"] * 10
    for _ in range(8):
        level = [level] * 10
    start = time.perf_counter()
    text = shown(level)
    assert time.perf_counter() - start < 0.1 and len(text) <= SHOWN_CHARACTERS and text.startswith("[[[")


def test_the_spelled_out_builtin_names_are_the_registry_names():
    from trl_aspo.builtin.registry import BUILTIN_DATASETS, BUILTIN_REWARDS, BUILTIN_TOOLS

    assert tuple(BUILTIN_REWARDS) == BUILTIN_REWARD_NAMES
    assert tuple(BUILTIN_TOOLS) == BUILTIN_TOOL_NAMES
    assert tuple(BUILTIN_DATASETS) == BUILTIN_DATASET_NAMES


# --------------------------------------------------------------------------------------- item 7: checkpoints
def test_resume_true_takes_the_latest_complete_checkpoint_and_names_the_skipped_one(tmp_path):
    """checkpoint-30 lost its trainer_state.json (written last by Trainer._save_checkpoint): resume from
    checkpoint-20 and say that checkpoint-30 was skipped; with no complete checkpoint, or an explicit incomplete
    one, an error that says so (not transformers' FileNotFoundError later)."""
    for step in (10, 20, 30):
        (tmp_path / f"checkpoint-{step}").mkdir()
    for step in (10, 20):
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    assert resolve_resume_checkpoint(True, str(tmp_path)) == str(tmp_path / "checkpoint-20")
    assert skipped_checkpoints_note(str(tmp_path), str(tmp_path / "checkpoint-20")) == (
        f"Skipped checkpoint-30 in {tmp_path}: no trainer_state.json, so it was not saved to the end (a run stopped "
        f"while saving, or a full disk); resuming from the latest complete one, {tmp_path / 'checkpoint-20'}."
    )
    with pytest.raises(
        ValueError,
        match=r"not a complete checkpoint \(no trainer_state\.json.*the latest complete one "
        rf"beside it is {tmp_path / 'checkpoint-20'}",
    ):
        resolve_resume_checkpoint(str(tmp_path / "checkpoint-30"), str(tmp_path))
    for step in (10, 20):
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").unlink()
    with pytest.raises(
        ValueError,
        match=r"no checkpoint-\* folder in output_dir .* is complete \(checkpoint-10, "
        r"checkpoint-20, checkpoint-30 have no trainer_state\.json",
    ):
        resolve_resume_checkpoint("true", str(tmp_path))


# ------------------------------------------------------------------------- item 9: output_dir, --num_processes
def test_a_fresh_run_in_a_folder_with_checkpoints_is_warned_before_training(tmp_path, monkeypatch, capsys):
    for step in (20, 40):
        (tmp_path / f"checkpoint-{step}").mkdir()
    warning = existing_checkpoints_warning({"output_dir": str(tmp_path)})
    assert warning == (
        f"output_dir {str(tmp_path)!r} already holds checkpoint-20, checkpoint-40, and no resume_from_checkpoint "
        "is set: this run starts at step 0, and its checkpoints overwrite those of the same step (the others stay, "
        "unless save_total_limit deletes them). To continue that run, add --resume_from_checkpoint true; to keep it, "
        "give another --output_dir."
    )
    assert existing_checkpoints_warning({"output_dir": str(tmp_path), "resume_from_checkpoint": "true"}) is None
    assert existing_checkpoints_warning({"output_dir": str(tmp_path / "new")}) is None

    import trl_aspo.cli.train as train_module
    from trl_aspo.cli.main import main

    seen = []
    monkeypatch.setattr(train_module, "main", lambda argv: seen.append(capsys.readouterr().err))
    main(["train", "--config", SMOKE, "--output_dir", str(tmp_path)])
    (printed,) = seen
    assert " ".join(printed.split()) == f"trl-aspo train: warning: {warning}"
    assert max(len(line) for line in printed.splitlines()) <= 119


def test_num_processes_on_a_cpu_launches_that_many_gloo_processes_or_says_why_not():
    """accelerate launch without a config file starts one process on a machine without GPUs; `--multi_gpu` picks
    its torch.distributed launcher, whose CPU processes form a gloo group (the run itself:
    tests/integration/test_cli_first_hour_runs.py)."""
    import torch

    from trl_aspo.cli.main import cpu_launch

    if torch.cuda.device_count():
        pytest.skip("this machine has a CUDA device")
    launch = ["--num_processes", "2"]
    assert cpu_launch(launch, {"use_cpu": True}) == [*launch, "--multi_gpu"]
    assert cpu_launch(["--num_processes", "1"], {"use_cpu": True}) == ["--num_processes", "1"]
    assert cpu_launch([*launch, "--config_file", "ddp.yaml"], {"use_cpu": True}) == [
        *launch,
        "--config_file",
        "ddp.yaml",
    ]
    with pytest.raises(SystemExit, match=r"--num_processes 2 on a machine without a CUDA device: add --use_cpu true"):
        cpu_launch(launch, {})


# ------------------------------------------------------------------------------- items 10, 11: before torch
@pytest.mark.parametrize(
    ("argv", "first_line"),
    [
        (
            ["train"],
            "trl-aspo train: no --config and no fields: give the run's YAML file, e.g. `trl-aspo train --config "
            "configs/quickstart.yaml`, or at least --model_name_or_path, --dataset_name and --reward_funcs",
        ),
        (
            ["train", "--config", SMOKE, "--loss_type", "dapo", "--aspo_dual_clip", "2"],
            "trl-aspo train: ASPOConfig.aspo_dual_clip=2.0 is invalid: it only acts in the aspo loss, so it needs "
            "loss_type='aspo' (got loss_type='dapo'). Remove aspo_dual_clip or change loss_type.",
        ),
        (
            ["train", "--config", SMOKE, "--tool_shaping", "false", "--tool_shaping_k", "0.5"],
            "trl-aspo train: ASPOConfig.tool_shaping_k=0.5 is invalid: it only acts in tool-position shaping, so it "
            "needs tool_shaping=True (got tool_shaping=False). Remove tool_shaping_k or change tool_shaping.",
        ),
        (
            ["train", "--config", SMOKE, "--aspo_dual_clip", "0.5"],
            "trl-aspo train: ASPOConfig.aspo_dual_clip=0.5 is invalid: must lie in (1, 100].",
        ),
        (
            ["train", "--dataset_name", "builtin:calculator", "--reward_funcs", "builtin:correctness"],
            "trl-aspo train: model_name_or_path: not set (no --config); give a local model directory, a hub id or "
            "'builtin:tiny-calculator'",
        ),
    ],
)
def test_what_the_values_decide_is_answered_before_torch_loads(argv, first_line):
    status, stderr, torch_imported, seconds = run_cli(*argv)
    assert status == 2 and "Traceback" not in stderr
    assert stderr.splitlines()[0] == first_line
    assert not torch_imported
    print(f"{argv}: {seconds:.2f} s")


def test_a_report_to_integration_that_is_not_installed_is_named_with_its_package():
    if find_spec("tensorboard") or find_spec("tensorboardX") or find_spec("trackio"):
        pytest.skip("tensorboard or trackio is installed here")
    status, stderr, torch_imported, _ = run_cli("train", "--config", SMOKE, "--report_to", "tensorboard")
    assert status == 2 and not torch_imported
    install = shlex.join([sys.executable, "-m", "pip", "install", "tensorboard"])
    assert stderr.splitlines()[0] == (
        f"trl-aspo train: report_to: 'tensorboard' needs the package 'tensorboard', which is not installed: "
        f"`{install}`, or remove it from report_to"
    )
    from trl_aspo.cli.run_checks import report_to_problems

    assert report_to_problems(["none"]) == [] and report_to_problems("all") == []
    assert [problem.split(":")[1] for problem in report_to_problems(["trackio", "tensorbord"])] == [
        " 'trackio' needs the package 'trackio', which is not installed",
        " 'tensorbord' is not one of ['all', 'azure_ml', 'clearml', 'codecarbon', 'comet_ml', 'dagshub', 'dvclive', "
        "'flyte', 'kubeflow', 'mlflow', 'neptune', 'none', 'swanlab', 'tensorboard', 'trackio', 'wandb']; did you "
        "mean tensorboard?",
    ]


# -------------------------------------------------------------------------------- item 12: the resume command
def _without_venv_on_path() -> dict[str, str]:
    bin_dir = os.path.dirname(sys.executable)
    path = os.pathsep.join(entry for entry in os.environ.get("PATH", "").split(os.pathsep) if entry != bin_dir)
    return {**os.environ, "PATH": path, "HF_HUB_OFFLINE": "1"}


@pytest.mark.parametrize("started_by", ["python -m", "the trl-aspo executable"])
def test_the_printed_resume_command_runs_as_printed_from_another_folder(tmp_path, monkeypatch, started_by):
    """Started as `python -m trl_aspo.cli.main` (as under accelerate) or through `.venv/bin/trl-aspo` (given as a
    relative path), the command runs from another folder with .venv/bin not on PATH (after `make quickstart`)."""
    if started_by != "python -m":
        executable = os.path.join(os.path.dirname(sys.executable), "trl-aspo")
        if not os.path.isfile(executable):
            pytest.skip("no trl-aspo executable beside this interpreter")
        monkeypatch.chdir(os.path.dirname(os.path.dirname(executable)))
        monkeypatch.setattr(sys, "argv", [os.path.join("bin", "trl-aspo"), "train"])
    monkeypatch.delenv("TRL_ASPO_RELAUNCH", raising=False)
    command = resume_command(["--help"], "out/checkpoint-4")
    words = shlex.split(command)
    assert words[-4:] == ["train", "--help", "--resume_from_checkpoint", "out/checkpoint-4"]
    assert os.path.isabs(words[0])
    result = subprocess.run(
        words, capture_output=True, text=True, cwd=tmp_path, env=_without_venv_on_path(), timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("usage: trl-aspo train --config X.yaml")


def test_a_multi_process_run_prints_its_launcher_flags_in_the_resume_command(monkeypatch):
    monkeypatch.setenv("TRL_ASPO_RELAUNCH", json.dumps(["/venv/bin/trl-aspo", "train", "--num_processes", "2"]))
    assert resume_command(["--config", "a.yaml"], "out/checkpoint-2") == (
        "/venv/bin/trl-aspo train --num_processes 2 --config a.yaml --resume_from_checkpoint out/checkpoint-2"
    )
