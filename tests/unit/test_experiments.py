"""`trl-aspo compare` experiment files (errors name the key) and `trl-aspo plot` on crafted log histories and weight
maps (the runs: tests/integration/test_experiments_runs.py)."""

from __future__ import annotations

import json
import math

import pytest
from helpers import write_experiment

from trl_aspo.cli.experiment_file import load_experiment
from trl_aspo.cli.plot import mean_and_spread
from trl_aspo.cli.results_table import mean_sd, tail_mean


@pytest.mark.parametrize(
    "body, message",
    [
        ("output_dir: o\nseeds: [0]\nvariants: {a: {}}\ncolour: red\n", "unknown key 'colour' in the file"),
        ("output_dir: o\nseeds: [0]\nvariants: {}\n", "'variants' must be a non-empty mapping"),
        ("output_dir: o\nseeds: []\nvariants: {a: {}}\n", "'seeds' must be a non-empty list"),
        ("output_dir: o\nseeds: [0, -1]\nvariants: {a: {}}\n", "'seeds' entry -1 is not a non-negative integer"),
        ("output_dir: o\nseeds: [1, 1]\nvariants: {a: {}}\n", "'seeds' has a repeated seed"),
        ("output_dir: o\nseeds: [0.5]\nvariants: {a: {}}\n", "'seeds' entry 0.5"),
        ("seeds: [0]\nvariants: {a: {}}\n", "missing key 'output_dir'"),
        ("output_dir: o\nseeds: [0]\nvariants: {a: {seed: 3}}\n", "key 'seed' in variant 'a'"),
        ("output_dir: o\nseeds: [0]\nvariants: {a: {lerning_rate: 1}}\n", "variant 'a' .*lerning_rate"),
        ("output_dir: o\nseeds: [0]\nvariants: {a: {aspo_dual_clip: 0.5}}\n", "variant 'a' .*aspo_dual_clip=0.5"),
        ("output_dir: o\nseeds: [0]\nvariants: {a: 3}\n", "variant 'a' must be a mapping"),
        ("output_dir: o\nseeds: [0]\nvariants: {a b: {}, a_b: {}}\n", "same folder name"),
        (
            "output_dir: o\nseeds: [0]\nvariants: {a: {}}\nevaluation: {samples: 2}\n",
            "unknown key 'samples' in 'evaluation'",
        ),
        (
            "output_dir: o\nseeds: [0]\nvariants: {a: {}}\nevaluation: {samples_per_problem: 0}\n",
            "'evaluation.samples_per_problem' must be an integer >= 1",
        ),
        (
            "output_dir: o\nseeds: [0]\nvariants: {a: {}}\nevaluation: {every_steps: 0}\n",
            r"'evaluation.every_steps' must be an integer >= 1 \(or left out\), got 0",
        ),
        (
            "output_dir: o\nseeds: [0]\nvariants: {a: {}}\nevaluation: {every_steps: true}\n",
            "'evaluation.every_steps' must be an integer >= 1",
        ),
    ],
)
def test_experiment_file_errors_name_the_key(tmp_path, body, message):
    with pytest.raises(ValueError, match=message):
        load_experiment(write_experiment(tmp_path, body))


class _OpensAFile:
    """Unpickling this creates `path`: the stand-in for a crafted `training_args.bin` that runs a command."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_plot_never_unpickles_training_args_of_a_run_folder(tmp_path):
    """Issue 17 item 7: a folder without a compare summary used to have its `training_args.bin` unpickled with
    `weights_only=False`; now the batch size comes from `trainer_state.json` and the pickle is never opened."""
    import torch

    from trl_aspo.cli.main import main
    from trl_aspo.cli.plot_command import load_run

    run_dir = tmp_path / "handed_over"
    checkpoint = run_dir / "checkpoint-3"
    checkpoint.mkdir(parents=True)
    history = [{"step": step, "reward": 0.1 * step, "loss": 0.0} for step in (1, 2, 3)]
    (checkpoint / "trainer_state.json").write_text(json.dumps({"log_history": history, "train_batch_size": 6}))
    marker = tmp_path / "command_ran"
    torch.save(_OpensAFile(str(marker)), checkpoint / "training_args.bin")
    run = load_run(str(run_dir))
    assert run["completions_per_step"] == 6
    assert main(["plot", str(run_dir), "--output", str(tmp_path / "plot.png")]) == 0
    assert not marker.exists()
    torch.load(checkpoint / "training_args.bin", weights_only=False)  # the file is live: loading it runs the payload
    assert marker.exists()


def test_plot_names_a_bad_batch_size(tmp_path):
    from trl_aspo.cli.plot_command import load_run

    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": [], "train_batch_size": "six"}))
    with pytest.raises(ValueError, match=r"trainer_state.json: train_batch_size must be a positive integer"):
        load_run(str(tmp_path))
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": []}))
    assert load_run(str(tmp_path))["completions_per_step"] is None  # no number: the figure falls back to steps


def test_plot_names_a_folder_without_a_log(tmp_path):
    from trl_aspo.cli.main import main

    with pytest.raises(SystemExit):
        main(["plot", str(tmp_path)])


def test_mean_and_spread_by_hand():
    steps, means, spreads = mean_and_spread([{1: 1.0, 2: 2.0}, {1: 3.0, 2: 2.0, 3: 9.0}])
    assert steps == [1, 2]  # step 3 is not logged by every run
    assert means == [2.0, 2.0]
    assert spreads == pytest.approx([math.sqrt(2.0), 0.0])
    assert mean_sd([1.0, 2.0, 3.0]) == pytest.approx((2.0, 1.0))
    history = [{"step": s, "x": float(s)} for s in range(1, 21)] + [{"train_loss": 0.1}]
    assert tail_mean(history, "x") == pytest.approx(19.5)  # the last 10% = the last 2 of 20 values


def test_completions_per_step_is_not_rounded():
    """8 completions per optimizer step over 3 iterations: 8/3 generated per step (the x axis of the figure)."""
    from types import SimpleNamespace

    from trl_aspo.cli.compare import completions_per_step

    sync = SimpleNamespace(per_device_train_batch_size=8, gradient_accumulation_steps=1, num_iterations=3)
    assert completions_per_step(sync) == pytest.approx(8 / 3)
    assert completions_per_step(sync, num_processes=3) == 8
    asynchronous = SimpleNamespace(per_device_train_batch_size=16, gradient_accumulation_steps=2)
    assert completions_per_step(asynchronous) == 32


def test_pool_weight_maps_adds_the_runs_cell_by_cell():
    """Seeds of one variant under one label: weight sums and counts add, so a cell's mean is over all their tokens."""
    from trl_aspo.cli.plot_command import pool_weight_maps

    def state(weight, count, loss_type="aspo"):
        grid = {"weight_sum": [[weight, 0.0], [0.0, 0.0]], "count": [[count, 0], [0, 1]]}
        return {"loss_type": loss_type, "bins": 2, "total": {"positive": grid, "negative": grid}, "windows": [{}]}

    pooled = pool_weight_maps([state(3.0, 2), state(1.0, 2)], "aspo")
    assert pooled["total"]["positive"] == {"weight_sum": [[4.0, 0.0], [0.0, 0.0]], "count": [[4, 0], [0, 2]]}
    assert pooled["windows"] == []
    with pytest.raises(ValueError, match="--labels 'x': runs pooled under one label must share 'loss_type'"):
        pool_weight_maps([state(1.0, 1), state(1.0, 1, "dapo")], "x")


def test_plot_weights_pools_runs_with_one_label(tmp_path):
    from trl_aspo.cli.main import main

    grid = {"weight_sum": [[2.0, 0.0], [0.0, 1.0]], "count": [[2, 0], [0, 1]]}
    state = {"format": 1, "loss_type": "aspo", "bins": 2, "total": {"positive": grid, "negative": grid}, "windows": []}
    runs = []
    for seed in (0, 1):
        run = tmp_path / f"seed{seed}"
        run.mkdir()
        (run / "weight_map.json").write_text(json.dumps(state))
        runs.append(str(run))
    output = tmp_path / "pooled.png"
    assert main(["plot", "--weights", *runs, "--labels", "aspo", "aspo", "--output", str(output)]) == 0
    assert output.stat().st_size > 0


def test_a_number_yaml_reads_as_a_string_gets_its_field_type(tmp_path):
    """YAML 1.1 reads `1e-3` (no dot) as a string; `trl-aspo train` converts it, and so must compare (it reached
    torch's optimizer as a string before)."""
    from trl_aspo.cli.experiment_file import apply_command_line, parse_run_config

    body = """
        output_dir: o
        seeds: [0]
        variants:
          a: {learning_rate: 1e-3}
        """
    experiment = load_experiment(write_experiment(tmp_path, body))
    _, training_args, _, _ = parse_run_config(experiment.run_config("a", 0))
    assert training_args.learning_rate == 0.001
    apply_command_line(experiment, overrides=["max_steps=3", "beta=1e-2"])
    _, training_args, _, _ = parse_run_config(experiment.run_config("a", 0))
    assert (training_args.max_steps, training_args.beta) == (3, 0.01)
    with pytest.raises(ValueError, match="variant 'a'.*learning_rate"):
        load_experiment(write_experiment(tmp_path, body.replace("1e-3", "fast")))
