"""Inputs the `trl-aspo` command used to pass on to TRL, which then ended in a raw error, a run that never ends or a
silent surprise (issue 31, items 9, 15 and 18): each now refused before torch loads, naming the key and what is
allowed; and `trl-aspo plot RUN` writes its figure beside the run, not into the current folder.

Each test runs the real command in a fresh interpreter, as a user does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import REPO_ROOT

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
# A run the checks accept (line 7 is max_steps).
BASE = """\
output_dir: out
report_to: none
use_cpu: true
model_name_or_path: builtin:tiny-calculator
dataset_name: builtin:calculator
reward_funcs: [builtin:correctness]
max_steps: 1
"""


def run_cli(*argv, cwd):
    """(exit status, stdout, stderr lines without the marker, whether torch was imported, seconds)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", RUNNER, *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
        env=env,
    )
    stderr, _, marker = result.stderr.rpartition("\n@@torch_imported=")
    lines = stderr.strip().splitlines()
    return result.returncode, result.stdout, lines, marker.strip() == "True", time.perf_counter() - start


def base_with(**replaced: str) -> str:
    """BASE with some keys' values replaced (each written as YAML text); other keys are appended."""
    lines = [line for line in BASE.splitlines() if line.split(":")[0] not in replaced]
    return "\n".join([*lines, *(f"{key}: {value}" for key, value in replaced.items())]) + "\n"


PATH_MAX = os.pathconf(".", "PC_PATH_MAX")


# (YAML text, launcher flags (before --config), flags (after it), the one problem (for the file at {path}))
REFUSED = {
    "max_steps .inf": (base_with(max_steps=".inf"), [], [], "max_steps (in {path}): inf is not an integer"),
    "a YAML date as the seed": (
        base_with(seed="2020-01-01"),
        [],
        [],
        "seed (in {path}): 2020-01-01 is a date (YAML reads it as one), not an integer",
    ),
    "a key that is no text": (
        BASE + "1: one\n",
        [],
        [],
        "key 1 (in {path}): keys are field names (text), not the int 1",
    ),
    "a NUL byte in output_dir": (
        base_with(output_dir='"out\\0x"'),
        [],
        [],
        "output_dir (in {path}): 'out\\x00x' holds a NUL character, which no option's text may hold",
    ),
    "a 1 MB output_dir": (
        base_with(output_dir="a" * 2**20),
        [],
        [],
        "output_dir (in {path}): a path of 1,048,576 bytes; a path may have at most "
        f"{PATH_MAX - 1:,} on this system",
    ),
    "a !!binary output_dir": (
        base_with(output_dir="!!binary b3V0"),
        [],
        [],
        "output_dir (in {path}): binary data (a !!binary value), not text",
    ),
    "max_steps 10**21": (
        base_with(max_steps=str(10**21)),
        [],
        [],
        "max_steps (in {path}): 1000000000000000000000 is out of range; allowed: an integer in "
        "[-9223372036854775808, 9223372036854775807] (a 64-bit integer)",
    ),
    "--num_processes 0": (
        BASE,
        ["--num_processes", "0"],
        [],
        "--num_processes: '0' is not a number of processes; give an integer >= 1",
    ),
    "a key given twice": (
        BASE + "max_steps: 2\n",
        [],
        [],
        "--config '{path}' (line 8): the key 'max_steps' is given twice (first on line 7); YAML would keep only the "
        "last value: write each key once",
    ),
    "--per_device_batch_size": (
        BASE,
        [],
        ["--per_device_batch_size", "4"],
        "--per_device_batch_size (command line): unknown flag; did you mean --per_device_train_batch_size or "
        "--per_device_eval_batch_size?",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_an_input_trl_would_fail_on_is_refused_before_torch_naming_the_key(tmp_path, case):
    text, launcher_flags, flags, problem = REFUSED[case]
    path = tmp_path / "run.yaml"
    path.write_text(text)
    status, _, stderr, torch_imported, _ = run_cli("train", *launcher_flags, "--config", path, *flags, cwd=tmp_path)
    assert (status, torch_imported) == (2, False), stderr
    assert stderr == [f"trl-aspo train: {problem.format(path=path)}", "Run `trl-aspo train --help` for every field."]


def test_a_misspelled_loss_type_is_refused_before_torch_with_every_other_mistake(tmp_path):
    """`loss_type: asp` passed the checks and died 58 s later inside TRL, and only the file's other mistake was
    listed; now both are, in a moment, and the loss names a registry holds are the choices."""
    path = tmp_path / "run.yaml"
    path.write_text(BASE + "loss_type: asp\nlerning_rate: 0.1\n")
    status, _, stderr, torch_imported, seconds = run_cli("train", "--config", path, cwd=tmp_path)
    assert (status, torch_imported) == (2, False)
    assert stderr[0] == "trl-aspo train: 2 configuration errors:"
    assert stderr[1].startswith(f"  loss_type (in {path}): 'asp' is not one of ['")
    assert (
        "'aspo'" in stderr[1]
        and "'dapo'" in stderr[1]
        and stderr[1].endswith("] (or a name that a module listed in plugins registers); did you mean aspo?")
    )
    assert stderr[2:] == [
        f"  lerning_rate (in {path}): unknown key; did you mean learning_rate?",
        "Run `trl-aspo train --help` for every field.",
    ]
    # Importing torch and TRL alone took 4 s on a quiet 2-core machine; the checks take ~0.15 s.
    assert seconds < 10


def trainer_state(steps: int) -> dict:
    rows = [{"step": step, "reward": 0.1 * step, "loss": 1.0 / step} for step in range(1, steps + 1)]
    return {"global_step": steps, "log_history": rows, "train_batch_size": 8}


def test_plot_writes_its_figure_beside_the_runs_not_into_the_current_folder(tmp_path):
    """One run: into its folder. Several: into the folder that holds them all."""
    runs = tmp_path / "outputs"
    for name in ("run_a", "run_b"):
        (runs / name).mkdir(parents=True)
        (runs / name / "trainer_state.json").write_text(json.dumps(trainer_state(3)))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    status, stdout, stderr, _, _ = run_cli("plot", runs / "run_a", cwd=elsewhere)
    assert status == 0, stderr
    assert stdout.strip() == f"Figure written to {runs / 'run_a' / 'comparison.png'}."
    assert (runs / "run_a" / "comparison.png").stat().st_size > 0

    status, stdout, stderr, _, _ = run_cli("plot", "../outputs/run_a", "../outputs/run_b", cwd=elsewhere)
    assert status == 0, stderr
    assert stdout.strip() == f"Figure written to {runs / 'comparison.png'}."
    assert (runs / "comparison.png").stat().st_size > 0
    assert list(elsewhere.iterdir()) == []


def test_numbers_seeds_and_dates_are_checked_as_their_fields_take_them(tmp_path):
    """The rules behind the refusals above, in one place: a seed within numpy's range, an optional number's
    'none', an integer field's text that is no integer, a boolean for a number, a date for text."""
    from trl_aspo.cli.command_line import check_command_line, given_values
    from trl_aspo.cli.config_errors import ConfigurationError
    from trl_aspo.cli.field_cache import field_table

    path = tmp_path / "run.yaml"
    path.write_text(base_with(learning_rate="true", run_name="2020-01-01"))
    flags = ["--seed", "-1", "--data_seed", str(2**32), "--num_generations", "1.5", "--max_completion_length", "none"]
    with pytest.raises(ConfigurationError) as refused:
        check_command_line(["--config", str(path), *flags])
    seeds = (
        "is out of range; allowed: an integer in [0, 4294967295] (numpy's seed range, which transformers' set_seed "
        "uses)"
    )
    assert refused.value.problems == [
        f"learning_rate (in {path}): True is not a number",
        f"run_name (in {path}): 2020-01-01 is a date (YAML reads it as one), not text; write '2020-01-01' in quotes "
        "for text",
        f"seed (command line): -1 {seeds}",
        f"data_seed (command line): 4294967296 {seeds}",
        "num_generations (command line): '1.5' is not an integer",
    ]
    path = tmp_path / "ok.yaml"
    path.write_text(BASE)
    argv = ["--config", str(path), "--seed", str(2**32 - 1), "--max_completion_length", "null"]
    config, _ = check_command_line(argv)
    fields = {field["name"]: field for field in field_table()["trainers"]["sync"]}
    values = given_values(argv, config, fields)
    assert values["seed"] == 2**32 - 1 and values["max_completion_length"] is None


def test_a_key_given_twice_is_refused_in_every_yaml_a_command_reads_and_a_merge_override_is_not(tmp_path):
    """Nested mappings and quoted spellings count (`'x'` and `x` are one key), and an experiment file is read by
    the same loader; a key written after `<<: *anchor` overrides the merged one by YAML's merge rule (no repeat)."""
    from trl_aspo.cli.config_errors import ConfigurationError
    from trl_aspo.cli.experiment_file import load_experiment
    from trl_aspo.cli.yaml_loading import load_yaml

    with pytest.raises(ConfigurationError) as refused:
        load_yaml("env:\n  x: 1\n  'x': 2\n", "a.yaml")
    assert refused.value.problems == [
        "a.yaml (line 3): the key 'x' is given twice (first on line 2); YAML would keep only the last value: write "
        "each key once"
    ]
    assert load_yaml("c: &c {beta: 0.0}\nv: {<<: *c, beta: 0.1}\n", "b.yaml")["v"] == {"beta": 0.1}
    experiment = tmp_path / "experiment.yaml"
    experiment.write_text("output_dir: out\nseeds: [0]\nseeds: [1]\nvariants: {a: {}}\nbase: {}\n")
    with pytest.raises(ValueError, match=rf"^experiment file {experiment} \(line 3\): the key 'seeds' is given twice"):
        load_experiment(str(experiment))
