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
