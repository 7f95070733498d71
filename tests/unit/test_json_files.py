"""`trl_aspo.infra.json_files`: the bounded JSON reader refuses what is not a small regular file without reading
it, and the atomic writer leaves the old file whole when a write fails."""

from __future__ import annotations

import json
import os

import pytest

from trl_aspo.infra import json_files
from trl_aspo.infra.json_files import read_json, write_json_atomic


def test_a_file_over_the_cap_is_refused_with_the_cap(tmp_path):
    path = tmp_path / "big.json"
    path.write_text(json.dumps(list(range(100))))
    assert read_json(path, max_bytes=os.path.getsize(path)) == list(range(100))
    with pytest.raises(ValueError) as error:
        read_json(path, max_bytes=os.path.getsize(path) - 1)
    assert str(error.value) == (
        f"{path} is larger than {os.path.getsize(path) - 1} bytes, the most read from a JSON file here."
    )


def test_a_fifo_and_a_folder_are_refused_without_blocking(tmp_path):
    fifo = tmp_path / "state.json"
    os.mkfifo(fifo)  # opening it for reading would wait for a writer forever
    with pytest.raises(ValueError, match=r"state\.json is a FIFO, not a regular file: refusing to read it as JSON\."):
        read_json(fifo)
    with pytest.raises(ValueError, match=r"is a folder, not a regular file"):
        read_json(tmp_path)


def test_a_failed_atomic_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "rollout_state.json"
    write_json_atomic(path, {"prompt_index": 1})

    def broken_fsync(descriptor):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(json_files.os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="No space left"):
        write_json_atomic(path, {"prompt_index": 2})
    assert json.loads(path.read_text()) == {"prompt_index": 1}
    assert os.listdir(tmp_path) == ["rollout_state.json"]


def test_expansion_is_bounded_before_parsing(tmp_path, monkeypatch):
    """Issue 45 item 7: 120 MB of `[],` was parsed at a 3.2 GB peak. The bound (the code reward judge's) is counted on
    the bytes: 3 MB of `[],` (3,000,004 bytes, 1,000,002 lists) bounds at 2 * 3,000,004 + 40 * 1,000,000 + 120 *
    1,000,002 bytes."""
    path = tmp_path / "trainer_state.json"
    path.write_bytes(b"[" + b"[]," * 1_000_000 + b"[]]")
    assert json_files.expanded_size(path.read_bytes()) == 2 * 3_000_004 + 40 * 1_000_000 + 120 * 1_000_002
    monkeypatch.setattr(json_files, "MAX_JSON_EXPANDED", 64 * 2**20)
    with pytest.raises(ValueError) as error:
        read_json(path)
    assert str(error.value) == (
        f"{path} would take up to 158 MiB once parsed (3000004 bytes, mostly containers and separators), more than "
        "the 64 MiB a JSON file may take here: refusing to read it."
    )
    assert len(read_json(path, max_expanded=200 * 2**20)) == 1_000_001
    # The run-file reader (trl-aspo plot, compare, values) names the file too.
    from trl_aspo.cli.run_files import read_trainer_state

    with pytest.raises(ValueError, match=r"trainer_state\.json would take up to 158 MiB once parsed"):
        read_trainer_state(path, ())


def test_an_integer_beyond_pythons_digit_limit_names_the_file(tmp_path):
    path = tmp_path / "trainer_state.json"
    path.write_text('{"global_step": ' + "9" * 5000 + "}")
    with pytest.raises(
        ValueError, match=r"^" + str(path).replace(".", r"\.") + r" holds a value that cannot be read: "
    ):
        read_json(path)
