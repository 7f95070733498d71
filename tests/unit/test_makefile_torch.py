"""`make install` asks PyTorch's CPU wheel index for torch (plain `torch==2.13.0` from PyPI is the CUDA build on
Linux) where that index answers, falls back to pip's own indexes with a line saying so where it does not (or its
install fails), and both the index and the pin are overridable.

The recipe runs for real against a stand-in `python` in the environment's bin folder that records each call and
fails where the test says (no network, nothing installed)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from helpers import REPO_ROOT

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
STAND_IN = """#!/bin/sh
echo "$*" >> "$CALLS"
case "$*" in
  "-c import torch") exit 1 ;;
  *urlopen*) exit "$PROBE_EXIT" ;;
  *--index-url*) exit "$INDEX_EXIT" ;;
esac
exit 0
"""
FALLBACK = (
    "installing torch==2.13.0 from pip's own indexes (on Linux the CUDA build, a 527 MB wheel and its CUDA packages, "
    "unless a CPU wheel is offered)"
)


def probe(index: str) -> str:
    return f"-c import urllib.request; urllib.request.urlopen('{index}/torch/', timeout=10)"


def make_install(
    tmp_path, *overrides: str, probe_exit: int = 0, index_exit: int = 0, has_torch: bool = False
) -> tuple[list[str], str]:
    """(the stand-in python's torch calls, make's stderr) of `make install VENV=<tmp>/venv [overrides]`: the index
    probe exits with `probe_exit`, the pip call on the index with `index_exit`; `import torch` fails unless
    `has_torch`."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    import_torch_exit = '"-c import torch") exit 0' if has_torch else '"-c import torch") exit 1'
    (bin_dir / "python").write_text(STAND_IN.replace('"-c import torch") exit 1', import_torch_exit))
    (bin_dir / "python").chmod(0o755)
    calls = tmp_path / "calls.txt"
    env = {**os.environ, "CALLS": str(calls), "PROBE_EXIT": str(probe_exit), "INDEX_EXIT": str(index_exit)}
    for name in ("TORCH", "TORCH_INDEX", "MAKEFLAGS"):
        env.pop(name, None)
    result = subprocess.run(
        ["make", "-C", str(REPO_ROOT), "install", f"VENV={tmp_path / 'venv'}", *overrides],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return [line for line in calls.read_text().splitlines() if "torch" in line], result.stderr


def test_torch_comes_from_the_cpu_wheel_index(tmp_path):
    calls, stderr = make_install(tmp_path)
    assert calls == ["-c import torch", probe(CPU_INDEX), f"-m pip install -q torch==2.13.0 --index-url {CPU_INDEX}"]
    assert FALLBACK not in stderr


@pytest.mark.parametrize("failing", ["probe", "install"])
def test_where_the_cpu_index_fails_pip_s_own_indexes_are_asked_and_it_says_so(tmp_path, failing):
    """An index that does not answer is not asked at all (pip would retry every package there); one whose install
    fails falls back too."""
    calls, stderr = make_install(tmp_path, probe_exit=int(failing == "probe"), index_exit=int(failing == "install"))
    on_index = [] if failing == "probe" else [f"-m pip install -q torch==2.13.0 --index-url {CPU_INDEX}"]
    assert calls == ["-c import torch", probe(CPU_INDEX), *on_index, "-m pip install -q torch==2.13.0"]
    assert f"make: TORCH_INDEX='{CPU_INDEX}' is empty, did not answer, or its torch did not install; {FALLBACK}" in (
        stderr
    )


def test_the_index_and_the_pin_are_overridable(tmp_path):
    cuda = "https://download.pytorch.org/whl/cu130"
    calls, _ = make_install(tmp_path / "cuda", f"TORCH_INDEX={cuda}", "TORCH=torch==2.13.0+cu130")
    assert calls[1:] == [probe(cuda), f"-m pip install -q torch==2.13.0+cu130 --index-url {cuda}"]
    calls, _ = make_install(tmp_path / "plain", "TORCH_INDEX=")
    assert calls[1:] == ["-m pip install -q torch==2.13.0"]


def test_an_environment_with_torch_is_left_as_it_is(tmp_path):
    assert make_install(tmp_path, has_torch=True)[0] == ["-c import torch"]
