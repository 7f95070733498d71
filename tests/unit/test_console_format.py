"""How `trl-aspo train` formats the numbers of its progress bar (the console of real runs:
tests/integration/test_console_output.py)."""

from __future__ import annotations

from trl_aspo.cli.progress import format_value


def test_format_value_keeps_three_significant_digits():
    assert format_value(0.123456) == "0.123"
    assert format_value(12.3456) == "12.3"
    assert format_value(1e-4) == "1.0e-04"
    assert format_value(0) == "0"
    assert format_value("n/a") == "n/a"
