"""The training-curve and comparison figures and results.md, on synthetic log histories with known values."""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from trl_aspo.cli import plot as plotting  # noqa: E402
from trl_aspo.cli.results_table import results_table  # noqa: E402


def history(steps: int, reward_slope: float = 0.1) -> list[dict]:
    """A spo++-like run: rising reward, loss, tool-call rate, and a zero-advantage share that is 0 at every step."""
    rows = [
        {
            "step": step,
            "reward": reward_slope * step,
            "loss": 1.0 / step,
            "tools/tool_call_frac": 0.5,
            "zero_advantage_share": 0.0,
        }
        for step in range(1, steps + 1)
    ]
    return [*rows, {"step": steps, "train_runtime": 3.0}]


@pytest.fixture
def saved_figures(monkeypatch):
    """The figures the plotting functions save, kept open for inspection."""
    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda figure=None: figures.append(figure))
    yield figures
    close("all")


def test_training_curves_title_names_config_and_heldout_numbers_with_integer_ticks(tmp_path, saved_figures):
    path = plotting.plot_training_curves(
        history(4),
        str(tmp_path),
        title="quickstart: spo++ advantages, aspo loss, tool shaping, 4 steps",
        heldout={"initial": 0.242, "final": 0.634},
    )
    assert path == str(tmp_path / "training_curves.png")
    (figure,) = saved_figures
    assert figure._suptitle.get_text() == (
        "quickstart: spo++ advantages, aspo loss, tool shaping, 4 steps; held-out accuracy 24.2% before, 63.4% after"
    )
    titles = [axis.get_title() for axis in figure.axes if axis.get_title()]
    # Friendly names; the zero-advantage share is 0 at every step, so it is listed under the figure instead.
    assert titles == ["training reward", "loss", "tool-call rate"]
    assert "Not drawn, zero at every logged step: zero-advantage share." in [text.get_text() for text in figure.texts]
    for axis in figure.axes[:3]:
        ticks = [tick for tick in axis.get_xticks() if axis.get_xlim()[0] <= tick <= axis.get_xlim()[1]]
        assert ticks and all(float(tick).is_integer() for tick in ticks), ticks
    reward_line = figure.axes[0].lines[0]
    assert list(reward_line.get_xdata()) == [1, 2, 3, 4]
    assert list(reward_line.get_ydata()) == pytest.approx([0.1, 0.2, 0.3, 0.4])


def test_comparison_tells_coinciding_variants_apart_and_names_panels_alike(tmp_path, saved_figures):
    same = history(6)
    runs = {
        name: [{"history": same, "completions_per_step": None, "heldout": {"initial": 0.2, "final": 0.5}}]
        for name in ("off", "on")
    }
    plotting.plot_comparison(runs, str(tmp_path / "c.png"), extra_metrics=("tools/tool_call_frac",), smoothing=1)
    (figure,) = saved_figures
    titles = [axis.get_title() for axis in figure.axes if axis.get_title()]
    assert titles == ["training reward", "held-out accuracy", "tool-call rate"]
    reward_lines = figure.axes[0].lines
    assert [line.get_ydata().tolist() for line in reward_lines] == [[0.1 * s for s in range(1, 7)]] * 2
    # Identical curves stay distinguishable: different dashes and markers.
    assert len({(str(line.get_linestyle()), line.get_marker()) for line in reward_lines}) == 2
    (legend,) = figure.legends
    assert [text.get_text() for text in legend.get_texts()] == ["off (n=1)", "on (n=1)"]
    assert "zero-advantage share" in figure.texts[-1].get_text()
    ticks = figure.axes[0].get_xticks()
    assert all(float(tick).is_integer() for tick in ticks)


def test_the_legend_sits_above_the_note_of_the_panels_not_drawn(tmp_path, saved_figures):
    """The experiments' figure drew the legend over a long note (both on the figure's bottom line)."""
    zero_metrics = ("offpolicy/clipped_frac_pos", "offpolicy/clipped_frac_neg", "aspo/hard_clip_pos_frac")
    rows = [{**row, **dict.fromkeys(zero_metrics, 0.0)} if "reward" in row else row for row in history(6)]
    runs = {
        name: [{"history": rows, "completions_per_step": 16, "heldout": {"initial": 0.2, "final": 0.5}}]
        for name in ("no correction", "token_truncate max 2", "token_mask [0.5, 2]")
    }
    plotting.plot_comparison(runs, str(tmp_path / "c.png"), extra_metrics=zero_metrics, smoothing=1)
    (figure,) = saved_figures
    renderer = figure.canvas.get_renderer()
    (legend,) = figure.legends
    note = figure.texts[-1]
    assert note.get_text().startswith("Not drawn, zero at every logged step: zero-advantage share, ")
    assert not legend.get_window_extent(renderer).overlaps(note.get_window_extent(renderer))


def test_results_md_shows_heldout_fractions_as_percentages():
    summaries = [
        {"history": history(4), "train_minutes": 1.0, "heldout": {"accuracy": accuracy, "tool_call_rate": 0.9}}
        for accuracy in (0.40, 0.50)
    ]
    table, numbers = results_table({"on": summaries}, [], {"accuracy": 0.242, "tool_call_rate": 0.402})
    rows = {
        line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]] for line in table.splitlines()
    }
    # mean 45.0%, sample sd of (40, 50) = 7.07 points
    assert rows["held-out accuracy"] == ["24.2%", "45.0% ± 7.1"]
    assert rows["held-out tool-call rate"] == ["40.2%", "90.0% ± 0.0"]
    assert rows["reward-curve area (mean training reward)"] == ["n/a", "0.250 ± 0.000"]
    assert numbers["mean_sd"]["on"]["held-out accuracy"][0] == pytest.approx(0.45)
    assert math.isclose(numbers["mean_sd"]["on"]["held-out accuracy"][1], math.sqrt(0.005))


def test_step_seconds_interpolates_between_logged_rows_by_hand():
    from trl_aspo.cli.plot import step_seconds

    history = [
        {"step": 2, "train_seconds": 4.0},
        {"step": 3, "heldout/accuracy": 0.5},
        {"step": 4, "train_seconds": 10.0},
    ]
    assert step_seconds(history) == {0: 0.0, 1: 2.0, 2: 4.0, 3: 7.0, 4: 10.0}
    assert step_seconds([{"step": 1, "loss": 0.1}]) == {}


def test_heldout_panel_draws_the_points_logged_during_training():
    """Before (x 0), during (`heldout/accuracy` rows) and after training: mean and sd over the runs at each point."""
    from trl_aspo.cli.plot import _plot_heldout

    class Axis:
        def errorbar(self, xs, means, yerr, **kwargs):
            self.points = (list(xs), list(means), list(yerr))

        @property
        def yaxis(self):
            return type("Y", (), {"set_major_formatter": lambda self, formatter: None})()

    def run(initial, during, final):
        history = [{"step": 4, "heldout/accuracy": during}, {"step": 4, "loss": 0.0}, {"step": 8, "loss": 0.0}]
        return {"history": history, "heldout": {"initial": initial, "final": final}}

    axis = Axis()
    _plot_heldout(axis, [run(0.2, 0.3, 0.6), run(0.4, 0.5, 0.8)], lambda step: 10 * step, "C0", "aspo")
    xs, means, spreads = axis.points
    assert xs == [0.0, 40, 80]
    assert means == pytest.approx([0.3, 0.4, 0.7])
    assert spreads == pytest.approx([2**0.5 * 0.1] * 3)


def test_comparison_against_seconds_needs_train_seconds(tmp_path):
    from trl_aspo.cli.plot import plot_comparison

    runs = {"a": [{"history": [{"step": 1, "reward": 0.5}], "completions_per_step": 4, "heldout": {}}]}
    with pytest.raises(ValueError, match="x_axis='seconds' needs train_seconds"):
        plot_comparison(runs, str(tmp_path / "c.png"), x_axis="seconds")
    with pytest.raises(ValueError, match="x_axis must be 'completions' or 'seconds', got 'time'"):
        plot_comparison(runs, str(tmp_path / "c.png"), x_axis="time")
    runs["a"][0]["history"][0]["train_seconds"] = 3.0
    assert plot_comparison(runs, str(tmp_path / "c.png"), x_axis="seconds").endswith("c.png")


def timed_history(steps: int) -> list[dict]:
    """`history` with `log_timing`'s columns: a 2 s step, the advantages 0.2 s of every other step (a round spans
    two steps), the loss 0.1 s, the value pre-pass once; the off-policy correction logged from step 2 on."""
    rows = history(steps)
    for row in rows[:-1]:
        step = row["step"]
        row.update({"timing/step_s": 2.0, "timing/advantages_s": 0.2 * (step % 2), "timing/policy_loss_s": 0.1})
        if step >= 2:
            row["timing/offpolicy_correction_s"] = 0.05
    rows[0]["timing/value_prepass_s"] = 30.0
    return rows


def test_timing_shares_are_each_region_over_the_step_by_hand():
    shares = plotting.timing_shares(timed_history(3))
    assert shares == {
        "timing/advantages_s": {1: pytest.approx(0.1), 2: 0.0, 3: pytest.approx(0.1)},
        "timing/offpolicy_correction_s": {1: 0.0, 2: 0.025, 3: 0.025},  # not run yet at step 1
        "timing/policy_loss_s": {1: 0.05, 2: 0.05, 3: 0.05},
    }
    assert plotting.timing_shares(history(3)) == {}
    assert plotting.timing_label("timing/offpolicy_correction_s") == "offpolicy_correction"


def test_the_comparison_stacks_each_timed_variants_own_work_as_a_share_of_the_step(tmp_path, saved_figures):
    """A variant whose runs log `timing/*` gets a stacked panel (the pre-pass, before training, is not in it); one
    without (a plain GRPOTrainer run, timing off) gets none."""
    runs = {
        "timed": [{"history": timed_history(4), "completions_per_step": None, "heldout": {}}],
        "untimed": [{"history": history(4), "completions_per_step": None, "heldout": {}}],
    }
    plotting.plot_comparison(runs, str(tmp_path / "c.png"), smoothing=1)
    (figure,) = saved_figures
    titles = [axis.get_title() for axis in figure.axes if axis.get_title()]
    assert titles == ["training reward", "timed: trl-aspo's own time, share of the step"]
    shares = figure.axes[1]
    assert [text.get_text() for text in shares.get_legend().get_texts()] == [
        "advantages",
        "offpolicy_correction",
        "policy_loss",
    ]
    # The top band's edges: below it the other regions, above it all three together, at steps 1-4.
    edges = shares.collections[-1].get_paths()[0].vertices[:, 1].tolist()
    for total in (0.15, 0.075, 0.175, 0.075, 0.1, 0.025, 0.125):
        assert any(math.isclose(edge, total) for edge in edges), (total, edges)
    assert max(edges) == pytest.approx(0.175)


def test_training_curves_of_a_timed_run_end_with_its_regions_stacked_as_shares_of_the_step(tmp_path, saved_figures):
    plotting.plot_training_curves(timed_history(3), str(tmp_path))
    (figure,) = saved_figures
    titles = [axis.get_title() for axis in figure.axes if axis.get_title()]
    assert titles[-1] == "trl-aspo's own time, share of the step"
    shares = [axis for axis in figure.axes if axis.get_title() == titles[-1]][0]
    assert [text.get_text() for text in shares.get_legend().get_texts()] == [
        "advantages",
        "offpolicy_correction",
        "policy_loss",
    ]
    # The top band's upper edge at steps 1-3: all three regions' shares (timing_shares' test above) added.
    edges = shares.collections[-1].get_paths()[0].vertices[:, 1].tolist()
    for total in (0.15, 0.075, 0.175):
        assert any(math.isclose(edge, total) for edge in edges), (total, edges)
    plotting.plot_training_curves(history(3), str(tmp_path))
    untimed = saved_figures[-1]
    assert "trl-aspo's own time, share of the step" not in [axis.get_title() for axis in untimed.axes]
