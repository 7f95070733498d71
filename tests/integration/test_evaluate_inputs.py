"""`trl-aspo evaluate` refuses what would evaluate nothing or run out of memory, and keeps its results when the output
file cannot be written (issue 45 item 7)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trl_aspo.cli.evaluate import write_results
from trl_aspo.cli.main import main as cli_main


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--temperature", "nan"], "--temperature must be a finite number >= 0, got nan"),
        (["--temperature", "inf"], "--temperature must be a finite number >= 0, got inf"),
        (["--success_threshold", "nan"], "--success_threshold must be a finite number"),
        (["--success_threshold=-inf"], "--success_threshold must be a finite number"),
        (["--num_samples", "1000000000"], "--num_samples must be <= 10000 (every completion is kept in memory"),
        (["--num_samples", "10001"], "--num_samples must be <= 10000"),
    ],
)
def test_evaluate_refuses_non_finite_values_and_huge_counts(flags, message, capsys):
    with pytest.raises(SystemExit) as exited:
        cli_main(["evaluate", *flags])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (writes fail with ENOSPC)")
def test_a_failed_write_prints_the_results_and_names_the_path(capsys):
    written = {"model": "m", "metrics": {"accuracy": 0.5, "mean_first_call_position": float("nan")}}
    assert write_results(Path("/dev/full"), written) is False
    out, err = capsys.readouterr()
    assert json.loads(out) == {"model": "m", "metrics": {"accuracy": 0.5, "mean_first_call_position": None}}
    assert err.strip() == (
        "trl-aspo evaluate: could not write --output '/dev/full': [Errno 28] No space left on device; the results are "
        "on stdout."
    )


def test_a_failed_write_exits_1_after_the_evaluation(tmp_path, capsys):
    """The whole command, on a path whose folder cannot be made (a file is in the way)."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    output = blocker / "evaluation.json"
    flags = ["--model", "builtin:tiny-random", "--limit", "1", "--max_completion_length", "2", "--output", str(output)]
    assert cli_main(["evaluate", *flags]) == 1
    out, err = capsys.readouterr()
    written = json.loads(out[out.index("{") :])
    assert written["metrics"]["num_problems"] == 1 and written["settings"]["num_samples"] == 1
    assert f"trl-aspo evaluate: could not write --output {str(output)!r}: [Errno 17] File exists" in err


def test_a_budget_beyond_the_models_context_is_refused_by_name(capsys):
    with pytest.raises(SystemExit) as exited:
        cli_main(["evaluate", "--model", "builtin:tiny-random", "--limit", "1", "--max_completion_length", "100000"])
    assert exited.value.code == 2
    assert (
        "trl-aspo evaluate: max_completion_length=100000 must be smaller than the model's context of 512 tokens "
        "(--model builtin:tiny-random's config)"
    ) in capsys.readouterr().err
