"""Prompt ids must identify one prompt each: missing and container ids are refused."""

from __future__ import annotations

import math

import pytest

from trl_aspo.values.prompt_ids import prompt_keys


@pytest.mark.parametrize("missing", [None, math.nan])
def test_missing_prompt_ids_are_refused(missing):
    rows = [{"prompt": "a", "pid": 1.0}, {"prompt": "b", "pid": missing}]
    with pytest.raises(ValueError, match=rf"prompt id column 'pid' holds {missing}: every row needs a prompt id"):
        prompt_keys(rows, "pid")
    assert prompt_keys(rows[:1], "pid") == ["1.0"]


def test_container_prompt_ids_are_refused():
    with pytest.raises(ValueError, match=r"prompt id column 'pid' holds a list \(\[1, 2\]\)"):
        prompt_keys([{"pid": [1, 2]}], "pid")
