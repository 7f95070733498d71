"""The asynchronous resume files: `rollout_state.json` (the local worker's prompt position and model version) is
written atomically and checked on load against what the checkpoint's steps can hold, and the checkpointed
first-dispatch versions (`prompt_dispatches` of `aspo_state.json`) are bounded by the checkpoint's model version.

One real run of `AsyncASPOTrainer` (spo++, local worker, one step saved as checkpoint-1) is shared; each bad file is
written into a copy of that checkpoint and resumed from with the real trainer."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
from helpers import async_fields, digit_share_reward, trainer_with_local_worker

from trl_aspo.builtin.task import correctness_reward, make_dataset

# One step of 4 completions (groups of 2): bounds prompt_index <= 1 * 4 and model_version <= 1 + 1.
STEP_SAMPLES = 4


@pytest.fixture(scope="module")
def trained(tmp_path_factory, calculator_tokenizer):
    """(trainer, checkpoint-1 folder, the sentinel file its rollout_state.json was hard-linked to before saving)."""
    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer

    root = tmp_path_factory.mktemp("rollout_state")
    fields = async_fields(
        root,
        per_device_train_batch_size=STEP_SAMPLES,
        num_generations=2,
        max_steps=1,
        max_inflight_tasks=1,
        save_strategy="steps",
        save_steps=1,
    )
    args = AsyncASPOConfig(**fields, advantage_estimator="spo++", value_reward_range=[0.0, 2.0])
    assert not args.filter_zero_variance_groups  # else prompt_index has no step bound
    dataset = make_dataset("train", 32, seed=0)
    trainer = trainer_with_local_worker(
        AsyncASPOTrainer, args, calculator_tokenizer, dataset, [correctness_reward, digit_share_reward]
    )
    # A writer that opens the target in place writes through this hard link; an atomic replace swaps the name.
    checkpoint = root / "out" / "checkpoint-1"
    checkpoint.mkdir(parents=True)
    sentinel = root / "sentinel.json"
    sentinel.write_text('"sentinel"')
    os.link(sentinel, checkpoint / "rollout_state.json")
    trainer.train()
    return trainer, checkpoint, sentinel


def test_the_checkpoint_writes_rollout_state_atomically(trained):
    _, checkpoint, sentinel = trained
    assert sentinel.read_text() == '"sentinel"'
    state = json.loads((checkpoint / "rollout_state.json").read_text())
    # One step of 2 groups, both trained; the cold sync is version 1, the step's sync version 2.
    assert state == {"prompt_index": 2, "model_version": 2}
    assert not [name for name in os.listdir(checkpoint) if name.startswith(".tmp-")]


def resume_with(trained, tmp_path, name, write) -> str:
    """Resume the shared trainer from a copy of checkpoint-1 whose file `name` is rewritten by `write(path)`;
    returns the ValueError's message (the test fails if the resume does not raise one). The run resumes for a second
    step: a checkpoint already at max_steps is refused before its files are read."""
    trainer, checkpoint, _ = trained
    trainer.args.max_steps = 2
    copy = tmp_path / "checkpoint-1"
    shutil.copytree(checkpoint, copy)
    path = copy / name
    path.unlink()
    write(path)
    with pytest.raises(ValueError) as error:
        trainer.train(resume_from_checkpoint=str(copy))
    return str(error.value)


def text(content: str):
    return lambda path: path.write_text(content)


PROMPT_RANGE = (
    "prompt_index must be an integer in [0, 4] (global_step 1 x at most 4 trained completions a step with this run's "
    "batch settings, each completion of one group: resume with the checkpoint's batch settings if they differ)"
)
VERSION_RANGE = (
    "model_version must be an integer in [0, 2] (one cold sync, then at most one weight sync per optimizer step)"
)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ({"prompt_index": -5, "model_version": 2}, f"{PROMPT_RANGE}, got -5."),
        ({"prompt_index": 10**20, "model_version": 2}, f"{PROMPT_RANGE}, got 100000000000000000000."),
        ({"prompt_index": 1000, "model_version": 2}, f"{PROMPT_RANGE}, got 1000."),
        ({"prompt_index": 2.5, "model_version": 2}, f"{PROMPT_RANGE}, got 2.5."),
        ({"prompt_index": "abc", "model_version": 2}, f"{PROMPT_RANGE}, got 'abc'."),
        ({"prompt_index": 2, "model_version": 1e300}, f"{VERSION_RANGE}, got 1e+300."),
        ({"prompt_index": 2, "model_version": -7}, f"{VERSION_RANGE}, got -7."),
        ({"prompt_index": 2, "model_version": 3}, f"{VERSION_RANGE}, got 3."),
        ({"model_version": 2}, "prompt_index is missing (the first untrained prompt group, an integer >= 0)."),
        ([1, 2], "the top level must be a JSON object, got list [1, 2]."),
    ],
)
def test_a_bad_rollout_state_is_refused_naming_file_field_and_range(trained, tmp_path, content, expected):
    message = resume_with(trained, tmp_path, "rollout_state.json", text(json.dumps(content)))
    assert message == f"{tmp_path / 'checkpoint-1' / 'rollout_state.json'}: {expected}"


def test_a_truncated_rollout_state_names_the_file_and_the_place(trained, tmp_path):
    message = resume_with(trained, tmp_path, "rollout_state.json", text('{"prompt_index": 2, "model'))
    path = tmp_path / "checkpoint-1" / "rollout_state.json"
    assert message == (
        f"{path} is not valid JSON (truncated or corrupt?): Unterminated string starting at at line 1 column 21."
    )


def test_a_rollout_state_linked_to_a_device_is_refused_unread(trained, tmp_path):
    message = resume_with(trained, tmp_path, "rollout_state.json", lambda path: path.symlink_to("/dev/zero"))
    path = tmp_path / "checkpoint-1" / "rollout_state.json"
    assert message == f"{path} is a character device, not a regular file: refusing to read it as JSON."


def with_dispatch_version(original, version):
    """A writer of `original` (an `aspo_state.json`) with its first key's first-dispatch version set to `version`."""

    def write(path):
        document = json.loads(original.read_text())
        dispatches = document["state"]["prompt_dispatches"]
        dispatches[next(iter(dispatches))] = version
        path.write_text(json.dumps(document))

    return write


@pytest.mark.parametrize("version", [10**30, 2**63 - 1, 3, -1, 1.5, "abc"])
def test_dispatch_versions_later_than_the_checkpoints_model_version_are_refused(trained, tmp_path, version):
    original = trained[1] / "aspo_state.json"
    saved = json.loads(original.read_text())["state"]
    assert saved["value_event"] == 2 and set(saved["prompt_dispatches"].values()) <= {0, 1, 2}
    message = resume_with(trained, tmp_path, "aspo_state.json", with_dispatch_version(original, version))
    path = tmp_path / "checkpoint-1" / "aspo_state.json"
    assert re.fullmatch(
        re.escape(f"checkpoint state {path}: prompt_dispatches[")
        + r"'[0-9a-f]+'"
        + re.escape(
            "] must be an integer model version in [0, 2] (value_event, the checkpoint's model version: no prompt "
            f"is dispatched at a later one), got {version!r}."
        ),
        message,
    )


def test_rollout_state_bounds_follow_the_steps_and_the_restarts():
    from trl_aspo.infra.rollout_state import rollout_state_bounds

    def numbers(*args, **kwargs):
        return tuple(rollout_state_bounds(*args, **kwargs)[:2])

    assert numbers(3, samples_per_step=8, drops_groups=False, republishes=True) == (24, 4)
    assert numbers(3, samples_per_step=8, drops_groups=False, republishes=False) == (24, 7)
    assert numbers(3, samples_per_step=8, drops_groups=True, republishes=True) == (None, 4)
    assert numbers(None, samples_per_step=8, drops_groups=False, republishes=True) == (None, None)
