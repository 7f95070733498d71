"""`--file-progress` (tests/conftest.py, used by `make test`): one line per test file with its outcomes, its seconds
and the count so far, so a long run shows where it is (issue 25, item 14)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def progress_lines(arguments: list[str]) -> list[tuple[str, str, str, str]]:
    """(done, total, file, passed) of each `--file-progress` line of a pytest run of `arguments`."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--file-progress", *arguments],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:]
    return re.findall(r"^\[(\d+)/(\d+)\] (\S+): (\d+) passed in \d+ s$", result.stdout, re.MULTILINE)


def test_each_file_gets_a_line_with_its_outcomes_and_the_running_count():
    files = ["tests/unit/test_normalize.py", "tests/unit/test_packed.py"]
    lines = progress_lines(files)
    assert [line[2] for line in lines] == files
    (first_done, total, _, first_passed), (second_done, total_again, _, second_passed) = lines
    assert total == total_again == second_done
    assert int(first_done) == int(first_passed) and int(second_done) == int(first_passed) + int(second_passed)


def test_under_two_xdist_workers_each_file_gets_one_line_once_all_its_tests_reported():
    files = ["tests/unit/test_normalize.py", "tests/unit/test_packed.py", "tests/unit/test_sampler.py"]
    lines = progress_lines(["-n", "2", *files])
    assert sorted(line[2] for line in lines) == files
    totals = {int(line[1]) for line in lines}
    passed = [int(line[3]) for line in lines]
    assert totals == {sum(passed)}
    # The running count of each line is at least what its own and the earlier lines' files passed.
    done = [int(line[0]) for line in lines]
    assert done == sorted(done) and done[-1] == sum(passed)
    assert all(count >= sum(passed[: index + 1]) for index, count in enumerate(done))
