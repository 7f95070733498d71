"""The checkpoint names trl_aspo.infra.checkpoint_files restates (so the CLI's resume checks run before torch loads)
agree with the ones transformers and TRL write, and importing them loads neither."""

from __future__ import annotations

import inspect
import subprocess
import sys

from transformers import trainer, trainer_utils
from trl.experimental.async_grpo import async_grpo_trainer

from trl_aspo.infra.checkpoint_files import CHECKPOINT_NAME, ROLLOUT_STATE_FILE, TRAINER_STATE_FILE


def test_the_names_are_those_transformers_writes():
    assert TRAINER_STATE_FILE == trainer.TRAINER_STATE_NAME
    folder = f"{trainer_utils.PREFIX_CHECKPOINT_DIR}-12"
    assert CHECKPOINT_NAME.match(folder)[1] == "12"
    assert trainer_utils._re_checkpoint.search(folder)[1] == "12"
    for other in ("checkpoint-12-tmp", "checkpoint-", "my-checkpoint-12", "checkpoint-1.5"):
        assert CHECKPOINT_NAME.match(other) is None, other


def test_the_rollout_state_file_is_the_one_trls_async_trainer_writes_and_reads():
    source = inspect.getsource(async_grpo_trainer.AsyncGRPOTrainer)
    assert source.count(f'"{ROLLOUT_STATE_FILE}"') >= 2


def test_importing_the_names_loads_no_torch():
    probe = "import sys, trl_aspo.trainers.resume; print('torch' in sys.modules, 'transformers' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "False"]
