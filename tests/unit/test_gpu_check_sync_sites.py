"""scripts/gpu_check.py counts only the package's own host synchronizations (the script's runs:
tests/integration/test_gpu_check.py)."""

from __future__ import annotations

import warnings

from helpers import load_script


def test_package_sync_sites_counts_only_the_package_synchronizations(tmp_path):
    gpu_check = load_script("gpu_check")
    package = tmp_path / "trl_aspo"

    def record(message, filename, lineno):
        return warnings.WarningMessage(message, UserWarning, str(filename), lineno)

    records = [
        record("called a synchronizing CUDA operation", package / "trainer.py", 10),
        record("called a synchronizing CUDA operation", package / "trainer.py", 10),
        record("called a synchronizing CUDA operation", package / "losses.py", 7),
        record("called a synchronizing CUDA operation", tmp_path / "trl" / "grpo_trainer.py", 99),
        record("some deprecation", package / "trainer.py", 12),
    ]
    assert gpu_check.package_sync_sites(records, package) == {"trl_aspo/trainer.py:10": 2, "trl_aspo/losses.py:7": 1}
    assert [gpu_check.is_sync_warning(r) for r in records] == [True, True, True, True, False]
