"""`trl-aspo compare` trains `trainer: async` variants and tabulates them."""

from __future__ import annotations

import json

import pytest
from helpers import write_async_experiment

from trl_aspo.cli.compare import compare
from trl_aspo.cli.experiment_file import load_experiment


@pytest.mark.slow
def test_compare_trains_async_variants_and_tabulates_them(tmp_path):
    path = write_async_experiment(
        tmp_path,
        f"""
        output_dir: {tmp_path / "out"}
        seeds: [0]
        evaluation: {{samples_per_problem: 1, temperature: 1.0, initial: false}}
        variants:
          spo++ 4x1: {{num_generations: 1, advantage_estimator: spo++, loss_type: aspo}}
          group 2x2: {{num_generations: 2, advantage_estimator: group}}
        """,
    )
    results = compare(load_experiment(path))
    for variant, runs in results.items():
        (summary,) = runs
        assert summary["completions_per_step"] == 4, variant
        assert summary["config"]["trainer"] == "async"
        assert summary["heldout"]["num_problems"] == 2
        assert len([row for row in summary["history"] if "loss" in row]) == 2
    table = json.loads((tmp_path / "out" / "results.json").read_text())["mean_sd"]
    assert set(table) == {"spo++ 4x1", "group 2x2"}
    assert (tmp_path / "out" / "comparison.png").stat().st_size > 0
