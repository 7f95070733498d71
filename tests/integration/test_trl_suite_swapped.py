"""scripts/trl_suite_swapped.py, on a small tests folder laid out as TRL's: the swapped copy imports trl-aspo's
trainer, a test that tells the two trainers apart is reported as a difference, one that does not is not, a helper
that asks trl.import_utils for an availability check this TRL lacks gets "not available", and a file that does not
load as written is skipped."""

from __future__ import annotations

import textwrap

from helpers import load_script

SAME_ON_BOTH = """
def test_same_on_both():
    assert GRPOConfig(output_dir="out", report_to="none", bf16=False).num_generations == 8
"""
TELLS_APART = """
def test_tells_apart():
    assert GRPOTrainer.__name__ == "GRPOTrainer"
"""


def _trl_like_tests(root, body):
    tests = root / "tests"
    (tests / "experimental").mkdir(parents=True)
    (tests / "__init__.py").write_text("")
    (tests / "conftest.py").write_text("")
    (tests / "testing_utils.py").write_text("from trl.import_utils import is_no_such_package_available\n")
    (tests / "test_grpo_trainer.py").write_text(
        "from trl import GRPOConfig, GRPOTrainer\n\nfrom .testing_utils import is_no_such_package_available\n"
        + textwrap.dedent(body)
    )
    (tests / "experimental" / "test_async_grpo_trainer.py").write_text(
        "from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer\n"
        "from trl.experimental.async_grpo.async_grpo_trainer import a_name_this_trl_lacks\n"
    )
    return tests


def test_only_a_test_that_tells_the_trainers_apart_differs(tmp_path, capsys):
    script = load_script("trl_suite_swapped")
    trl_tests = _trl_like_tests(tmp_path / "trl", SAME_ON_BOTH + TELLS_APART)
    work = tmp_path / "work"
    work.mkdir()

    assert script.compare_swapped(trl_tests, work) == 1

    swapped = (work / "tests" / "test_grpo_trainer_trl_aspo.py").read_text()
    assert "from trl_aspo import ASPOConfig as GRPOConfig, ASPOTrainer as GRPOTrainer" in swapped
    printed = capsys.readouterr().out
    assert "DIFFERS tests.test_grpo_trainer::test_tells_apart" in printed
    assert "test_same_on_both" not in printed
    assert "TRL's trainer:      2 passed" in printed
    assert "trl-aspo's trainer: 1 failed, 1 passed" in printed
    assert "experimental/test_async_grpo_trainer.py" in printed
    assert "skipped: as written it does not load against the installed TRL" in printed
    assert printed.rstrip().endswith("1 test(s) differ")
