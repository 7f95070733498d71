"""`trl-aspo plot` (curves and `--weights`) and `trl-aspo compare` read run folders bounded and checked: every bad
file or field is refused with the file, the field, the value and what is allowed (issue 25 item 5); the held-out
panel draws the whole held-out history over the training range, with tick labels that differ (item 13).

Each case writes the files a real run writes (shapes from `Trainer.save_state`, `WeightMapLog.write` and
`compare`'s `run_summary.json`) with one field spoiled, and runs the real command."""

from __future__ import annotations

import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from trl_aspo.algorithms.weight_map import WeightMapLog  # noqa: E402
from trl_aspo.cli.plot_command import plot_main  # noqa: E402


def history(steps: int = 4) -> list[dict]:
    return [
        {"step": step, "reward": 0.1 * step, "loss": 1.0 / step, "train_seconds": 2.0 * step}
        for step in range(1, steps + 1)
    ]


def trainer_state(log_history) -> dict:
    return {"global_step": 4, "log_history": log_history, "train_batch_size": 8}


def plot_error(capsys, *argv) -> str:
    """The error `trl-aspo plot` exits with (status 2), as printed."""
    with pytest.raises(SystemExit) as exit_info:
        plot_main([*argv, "--output", os.path.join(argv[0], "figure.png")])
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def spoiled_row(**fields) -> dict:
    return trainer_state([*history(2), {"step": 3, **fields}])


@pytest.mark.parametrize(
    ("content", "argv", "expected"),
    [
        ([1, 2], (), "trainer_state.json: the top level must be a JSON object, got list [1, 2]."),
        ({"log_history": "abc"}, (), "trainer_state.json: log_history must be a JSON list, got str 'abc'."),
        ({"log_history": [1]}, (), "trainer_state.json: log_history[0] must be a JSON object, got int 1."),
        (
            trainer_state([{"step": "x", "reward": 1.0}]),
            (),
            "trainer_state.json: log_history[0].step must be an integer >= 0, got 'x'.",
        ),
        (
            spoiled_row(reward="abc"),
            (),
            "trainer_state.json: log_history[2]['reward'] must be a number (a logged metric), got 'abc'.",
        ),
        (
            spoiled_row(loss="abc"),
            ("--metrics", "loss"),
            "trainer_state.json: log_history[2]['loss'] must be a number (a logged metric), got 'abc'.",
        ),
        (
            spoiled_row(**{"heldout/accuracy": 7.5}),
            (),
            "trainer_state.json: log_history[2]['heldout/accuracy'] must be a fraction in [0, 1], got 7.5.",
        ),
        (
            spoiled_row(**{"heldout/accuracy": -3}),
            (),
            "trainer_state.json: log_history[2]['heldout/accuracy'] must be a fraction in [0, 1], got -3.",
        ),
        (
            spoiled_row(train_seconds=-1.0),
            (),
            "trainer_state.json: log_history[2]['train_seconds'] must be a number of seconds >= 0, got -1.0.",
        ),
        (
            spoiled_row(**{"timing/advantages_s": -0.5}),
            (),
            "trainer_state.json: log_history[2]['timing/advantages_s'] must be a number of seconds >= 0, got -0.5.",
        ),
    ],
)
def test_plot_refuses_a_bad_trainer_state_naming_the_file_and_field(tmp_path, capsys, content, argv, expected):
    (tmp_path / "trainer_state.json").write_text(json.dumps(content))
    assert f"{tmp_path}/{expected}" in plot_error(capsys, str(tmp_path), *argv)


def test_plot_names_a_truncated_trainer_state_and_where_it_breaks(tmp_path, capsys):
    (tmp_path / "trainer_state.json").write_text(json.dumps(trainer_state(history()))[:40])
    message = plot_error(capsys, str(tmp_path))
    assert f"{tmp_path}/trainer_state.json is not valid JSON (truncated or corrupt?): " in message
    assert "at line 1 column 3" in message


def test_plot_refuses_a_trainer_state_linked_to_dev_zero_without_reading_it(tmp_path, capsys):
    """The old reader read /dev/zero until MemoryError; the file is now refused before it is opened."""
    (tmp_path / "trainer_state.json").symlink_to("/dev/zero")
    message = plot_error(capsys, str(tmp_path))
    assert f"{tmp_path}/trainer_state.json is a character device, not a regular file" in message


def test_plot_skips_checkpoint_folders_not_named_by_a_step(tmp_path, saved_figures):
    """`checkpoint-abc` is not a checkpoint transformers writes: skipped (as get_last_checkpoint skips it), and the
    latest numbered checkpoint (10, not 9: by number, not by name) is read."""
    from trl_aspo.cli.plot_command import load_run

    for name, steps in (("checkpoint-abc", 7), ("checkpoint-9", 2), ("checkpoint-10", 3)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "trainer_state.json").write_text(json.dumps(trainer_state(history(steps))))
    assert load_run(str(tmp_path))["history"] == history(3)
    assert plot_main([str(tmp_path), "--output", str(tmp_path / "figure.png")]) == 0


def compare_run(root, summary: dict, initial: dict | None = None):
    """A comparison's folder as `compare` leaves it: `runs/aspo/seed0/` with `trainer_state.json` and
    `run_summary.json`, and `initial_evaluation.json` of the starting model."""
    run = root / "cmp" / "runs" / "aspo" / "seed0"
    run.mkdir(parents=True)
    (run / "trainer_state.json").write_text(json.dumps(trainer_state(summary.get("history", []))))
    (run / "run_summary.json").write_text(json.dumps(summary))
    if initial is not None:
        (root / "cmp" / "initial_evaluation.json").write_text(json.dumps(initial))
    return run


@pytest.mark.parametrize(
    ("summary", "expected"),
    [
        ([1, 2], "run_summary.json: the top level must be a JSON object, got list [1, 2]."),
        (
            {"history": history(), "heldout": {"accuracy": 7.5}},
            "run_summary.json: heldout.accuracy must be a held-out accuracy, a fraction in [0, 1], got 7.5.",
        ),
        (
            {"history": history(), "completions_per_step": -4},
            "run_summary.json: completions_per_step must be a number > 0 (or null), got -4.",
        ),
        ({"heldout": None}, "run_summary.json: history is missing (the run's log history, a JSON list)."),
    ],
)
def test_plot_refuses_a_bad_run_summary(tmp_path, capsys, summary, expected):
    run = compare_run(tmp_path, summary if isinstance(summary, dict) else {})
    (run / "run_summary.json").write_text(json.dumps(summary))
    assert f"{run}/{expected}" in plot_error(capsys, str(run))


def test_plot_refuses_a_before_after_summary_with_an_accuracy_out_of_range(tmp_path, capsys):
    (tmp_path / "trainer_state.json").write_text(json.dumps(trainer_state(history())))
    (tmp_path / "summary.json").write_text(json.dumps({"before": {"accuracy": 0.2}, "after": {"accuracy": -3}}))
    expected = "summary.json: after.accuracy must be a held-out accuracy, a fraction in [0, 1], got -3."
    assert f"{tmp_path}/{expected}" in plot_error(capsys, str(tmp_path))


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (
            "{",
            "is not valid JSON (truncated or corrupt?): Expecting property name enclosed in double quotes at line 1",
        ),
        ("[1, 2]", ": the top level must be a JSON object, got list [1, 2]."),
    ],
)
def test_compare_names_a_truncated_or_wrong_run_summary(tmp_path, content, expected):
    """A finished run's summary decides whether compare skips the run: a bad one names its file."""
    from helpers import two_by_two

    from trl_aspo.cli.compare import finished_summary
    from trl_aspo.cli.experiment_file import apply_command_line, load_experiment

    config, _ = two_by_two(tmp_path)
    experiment = apply_command_line(load_experiment(config), seeds=[0], variants=["dapo"])
    path = experiment.run_dir("dapo", 0) / "run_summary.json"
    path.parent.mkdir(parents=True)
    path.write_text(content)
    with pytest.raises(ValueError) as error:
        finished_summary(experiment, "dapo", 0)
    assert str(error.value).startswith(f"{path}{'' if expected.startswith(':') else ' '}{expected}")


def weight_map(tmp_path, spoil) -> str:
    """A `weight_map.json` as `WeightMapLog.write` leaves it after one window, spoiled by `spoil(state)`."""
    import torch

    log = WeightMapLog("aspo")
    sums = torch.zeros(2, 2, 10, 10, dtype=torch.float64)
    sums[0, 0, 1, 2], sums[0, 1, 1, 2] = 3.0, 2.0
    log.add_window(1, 2, sums)
    path = log.write(str(tmp_path))
    with open(path) as handle:
        state = json.load(handle)
    spoil(state)
    with open(path, "w") as handle:
        json.dump(state, handle)
    return path


def set_cell(sign, quantity, value):
    def spoil(state):
        state["total"][sign][quantity][0][0] = value

    return spoil


@pytest.mark.parametrize(
    ("spoil", "expected"),
    [
        (
            lambda state: state.update(bins=-1),
            "bins must be an integer in [1, 100] (probability bins per axis), got -1.",
        ),
        (lambda state: state.update(bins=3), "total.positive.weight_sum must be 3 lists of 3 numbers (bins = 3)."),
        (lambda state: state.update(bins="abc"), "bins must be an integer in [1, 100] (probability bins per axis)"),
        (
            set_cell("negative", "count", -1),
            "total.negative.count[0][0] must be a token count, a whole number >= 0, got -1.",
        ),
        (set_cell("positive", "count", 0.5), "total.positive.count[0][0] must be a token count, a whole number"),
        (
            set_cell("positive", "weight_sum", "abc"),
            "total.positive.weight_sum[0][0] must be a sum of weights w >= 0, a finite number >= 0, got 'abc'.",
        ),
        (lambda state: state.pop("total"), "total must be a JSON object, got NoneType None."),
        (lambda state: state["total"].pop("negative"), "total.negative must be a JSON object, got NoneType None."),
        (lambda state: state.update(loss_type=None), "loss_type must be the training loss type (a string), got None."),
    ],
)
def test_plot_weights_refuses_a_bad_weight_map_naming_the_field(tmp_path, capsys, spoil, expected):
    path = weight_map(tmp_path, spoil)
    assert f"{path}: {expected}" in plot_error(capsys, str(tmp_path), "--weights")


def test_plot_weights_skips_checkpoint_folders_not_named_by_a_step(tmp_path, capsys):
    for name in ("checkpoint-abc", "checkpoint-3"):
        weight_map(tmp_path / name, lambda state: None)
    assert plot_main([str(tmp_path), "--weights", "--output", str(tmp_path / "map.png")]) == 0


@pytest.fixture
def saved_figures(monkeypatch):
    """The figures the plotting functions save, kept open for inspection."""
    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda figure=None: figures.append(figure))
    yield figures
    close("all")


def heldout_axis(figure):
    (axis,) = [axis for axis in figure.axes if axis.get_title() == "held-out accuracy"]
    return axis


def test_plot_draws_the_heldout_history_of_a_compare_run_over_the_training_range(tmp_path, saved_figures):
    """A compare run evaluated every 4 of 12 steps (8 completions a step): before training (the comparison's
    initial_evaluation.json, x 0), during (steps 4 and 8) and after (step 12), on an x range from 0 to 96
    completions like the training panels, not just around the last point."""
    rows = history(12)
    rows.insert(4, {"step": 4, "heldout/accuracy": 0.3})
    rows.insert(9, {"step": 8, "heldout/accuracy": 0.4})
    summary = {"history": rows, "completions_per_step": 8, "heldout": {"accuracy": 0.5}}
    run = compare_run(tmp_path, summary, initial={"accuracy": 0.2})
    assert plot_main([str(run), "--output", str(tmp_path / "figure.png")]) == 0
    axis = heldout_axis(saved_figures[-1])
    (container,) = axis.containers  # the errorbar: its data line, caps and bars
    line = container.lines[0]
    assert list(line.get_xdata()) == [0.0, 32, 64, 96]
    assert list(line.get_ydata()) == pytest.approx([0.2, 0.3, 0.4, 0.5])
    left, right = axis.get_xlim()
    reward_axis = [axis for axis in saved_figures[-1].axes if axis.get_title() == "training reward"][0]
    assert (left, right) == pytest.approx((min(0.0, reward_axis.get_xlim()[0]), reward_axis.get_xlim()[1]))
    assert left <= 0 and right >= 96


def test_a_single_final_heldout_point_sits_at_the_end_of_the_training_range(tmp_path, saved_figures):
    """The issue's figure: only the final evaluation (step 128), drawn alone on an x range of 122 to 134. Now it
    sits at the end of the training range, from 0."""
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": history(128)}))
    (tmp_path / "summary.json").write_text(json.dumps({"after": {"accuracy": 0.25}}))
    assert plot_main([str(tmp_path), "--output", str(tmp_path / "figure.png")]) == 0
    left, right = heldout_axis(saved_figures[-1]).get_xlim()
    assert left <= 0 and right >= 128


def test_heldout_tick_labels_are_distinct_on_a_narrow_range(tmp_path, saved_figures):
    """Held-out accuracies between 24.1% and 24.8%: whole percents labelled the ticks 24%, 24%, 25%, 25%; each
    label now writes its tick exactly (here with one decimal), so no two are alike."""
    from trl_aspo.cli.plot import plot_comparison

    accuracies = [0.241, 0.243, 0.244, 0.246, 0.248]
    rows = [{"step": 2 * index + 2, "heldout/accuracy": value} for index, value in enumerate(accuracies[1:-1])]
    runs = {
        "aspo": [
            {
                "history": [*history(8), *rows],
                "completions_per_step": None,
                "heldout": {"initial": accuracies[0], "final": accuracies[-1]},
            }
        ]
    }
    plot_comparison(runs, str(tmp_path / "figure.png"))
    figure = saved_figures[-1]
    figure.canvas.draw()
    axis = heldout_axis(figure)
    low, high = axis.get_ylim()
    ticks = [(tick.get_text(), value) for tick, value in zip(axis.get_yticklabels(), axis.get_yticks(), strict=True)]
    ticks = [(label, value) for label, value in ticks if low <= value <= high]
    assert len(ticks) >= 3
    assert len({label for label, _ in ticks}) == len(ticks), ticks
    for label, value in ticks:
        assert label.endswith("%") and float(label[:-1]) == pytest.approx(100 * value)


def test_a_cached_initial_evaluation_of_a_comparison_is_checked(tmp_path):
    """`compare` reuses `initial_evaluation.json`: a truncated file or an accuracy outside [0, 1] is named."""
    from trl_aspo.cli.compare import evaluate_initial
    from trl_aspo.cli.experiment_file import Evaluation

    experiment = type("Experiment", (), {"evaluation": Evaluation(initial=True), "output_dir": tmp_path})()
    cached = tmp_path / "initial_evaluation.json"
    cached.write_text('{"accuracy": 0.25, "n": 8}')
    assert evaluate_initial(experiment) == {"accuracy": 0.25, "n": 8}
    cached.write_text('{"accuracy": 7.5}')
    with pytest.raises(ValueError, match=r"initial_evaluation.json: .*accuracy.*\[0, 1\]"):
        evaluate_initial(experiment)
    cached.write_text('{"accuracy": 0.2')
    with pytest.raises(ValueError, match=r"initial_evaluation.json"):
        evaluate_initial(experiment)
