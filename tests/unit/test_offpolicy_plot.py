"""`trl-aspo plot` draws the off-policy diagnostics (issue 30): one staleness panel and one rollout-IS-weight panel,
each metric a line, when a run logged them; none when it did not."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

from trl_aspo.cli.plot import GROUP_TITLES, plot_training_curves  # noqa: E402


def _history(with_offpolicy: bool) -> list[dict]:
    rows = []
    for step in range(1, 4):
        row = {"step": step, "loss": 0.1 * step, "reward": 0.2}
        if with_offpolicy:
            row.update(
                {
                    "offpolicy/staleness_mean": 1.0 + step,
                    "offpolicy/staleness_max": 2.0 + step,
                    "offpolicy/is_weight_mean": 0.98,
                    "offpolicy/ess": 0.9,
                    "offpolicy/clipped_frac_pos": 0.05,
                }
            )
        rows.append(row)
    return rows


def test_the_offpolicy_panels_hold_every_logged_diagnostic(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    drawn = {}
    savefig = plt.Figure.savefig

    def recording_savefig(figure, path, *args, **kwargs):
        drawn["axes"] = {axis.get_title(): [line.get_label() for line in axis.get_lines()] for axis in figure.axes}
        return savefig(figure, path, *args, **kwargs)

    monkeypatch.setattr(plt.Figure, "savefig", recording_savefig)
    plot_training_curves(_history(True), str(tmp_path))
    staleness, weight = GROUP_TITLES.values()
    assert drawn["axes"][staleness] == ["offpolicy/staleness_mean", "offpolicy/staleness_max"]
    # Only the logged ones among the panel's metrics (no clipped_frac_neg in this history).
    assert drawn["axes"][weight] == ["offpolicy/is_weight_mean", "offpolicy/ess", "offpolicy/clipped_frac_pos"]
    assert (tmp_path / "training_curves.png").stat().st_size > 0

    plot_training_curves(_history(False), str(tmp_path / "plain"))
    assert staleness not in drawn["axes"] and weight not in drawn["axes"]
