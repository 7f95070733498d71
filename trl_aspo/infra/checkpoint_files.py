"""The names of a checkpoint's folder and files, in one place for the code that runs before torch loads (the CLI's
resume checks) and the trainers.

transformers names the folder `checkpoint-<global step>` (`PREFIX_CHECKPOINT_DIR`) and writes `trainer_state.json`
(`TRAINER_STATE_NAME`) last, after the weights, optimizer, scheduler, random states and trl-aspo's own state, so a
folder without it was not finished. TRL's `AsyncGRPOTrainer`, and trl-aspo's local worker, write `rollout_state.json`
before it: the first untrained prompt group and the model version. They are restated here because importing them
from transformers would load torch; tests/unit/test_checkpoint_files.py checks that they agree.
"""

from __future__ import annotations

import re

CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")
TRAINER_STATE_FILE = "trainer_state.json"
ROLLOUT_STATE_FILE = "rollout_state.json"
