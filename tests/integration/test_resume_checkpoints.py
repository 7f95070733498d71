"""`trainer.train(resume_from_checkpoint=...)` through the Python API, for both trainers, follows the CLI's rule for
checkpoints a kill left half written: `True` passes over a newest checkpoint without `trainer_state.json` or with a
cut-short one (and logs which), an explicit path to such a checkpoint is refused naming the file, and an
asynchronous checkpoint whose `rollout_state.json` was deleted is refused instead of restarting the prompt stream,
and a checkpoint already at `max_steps` is refused where transformers' loop would train one step past it.

One real one-step run of each trainer, saved as checkpoint-1, is shared; each test adds a damaged checkpoint beside
it (or damages a copy) and resumes: the synchronous trainer that ran, a fresh asynchronous one (its local worker
stops when a train() ends). A resume trains at most one step more (seconds)."""

from __future__ import annotations

import logging
import shutil

import pytest
from helpers import async_fields, digit_share_reward, tiny_run_fields, trainer_with_local_worker

from trl_aspo.builtin.task import correctness_reward, make_dataset


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory, tiny_tokenizer, calculator_dataset):
    """(a function returning the ASPOTrainer that ran one step, output_dir holding its checkpoint-1)."""
    from trl_aspo import ASPOConfig, ASPOTrainer
    from trl_aspo.builtin import build_random_model

    output_dir = tmp_path_factory.mktemp("sync") / "out"
    fields = tiny_run_fields(output_dir, max_steps=1, save_strategy="steps", save_steps=1, dataloader_num_workers=0)
    trainer = ASPOTrainer(
        model=build_random_model(tiny_tokenizer, seed=0),
        reward_funcs=[digit_share_reward],
        args=ASPOConfig(**fields),
        train_dataset=calculator_dataset.select(range(8)),
        processing_class=tiny_tokenizer,
    )
    trainer.train()
    assert (output_dir / "checkpoint-1" / "trainer_state.json").is_file()
    return lambda: trainer, output_dir


def async_trainer(output_dir, tokenizer):
    """AsyncASPOTrainer with the local worker, one step of 2 groups of 2, saving every step into `output_dir` (a
    fresh one for each train(): the local worker is stopped when a train() ends)."""
    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer

    fields = async_fields(
        output_dir.parent, output_dir=output_dir, per_device_train_batch_size=4, num_generations=2, max_steps=1
    )
    args = AsyncASPOConfig(**{**fields, "max_inflight_tasks": 1, "save_strategy": "steps", "save_steps": 1})
    return trainer_with_local_worker(
        AsyncASPOTrainer, args, tokenizer, make_dataset("train", 32, seed=0), [correctness_reward]
    )


@pytest.fixture(scope="module")
def async_run(tmp_path_factory, calculator_tokenizer):
    """(a function building a fresh AsyncASPOTrainer on output_dir, output_dir holding checkpoint-1 of a one-step
    run)."""
    output_dir = tmp_path_factory.mktemp("async") / "out"
    async_trainer(output_dir, calculator_tokenizer).train()
    assert (output_dir / "checkpoint-1" / "rollout_state.json").is_file()
    return lambda: async_trainer(output_dir, calculator_tokenizer), output_dir


def damaged_copy(output_dir, step: int, damage: str):
    """checkpoint-<step> beside checkpoint-1: a copy of it whose trainer_state.json is gone ('missing') or cut off
    in the middle of its JSON ('truncated'), as a kill during transformers' in-place write leaves it."""
    target = output_dir / f"checkpoint-{step}"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(output_dir / "checkpoint-1", target)
    state = target / "trainer_state.json"
    if damage == "missing":
        state.unlink()
    else:
        text = state.read_text()
        state.write_text(text[: len(text) // 2])
    return target


def with_max_steps(make_trainer, max_steps: int):
    def make():
        trainer = make_trainer()
        trainer.args.max_steps = max_steps
        return trainer

    return make


@pytest.fixture(params=["sync", "async"])
def run(request):
    """(a function building the trainer with max_steps=2, so that it resumes checkpoint-1 for one step, output_dir)."""
    make_trainer, output_dir = request.getfixturevalue(f"{request.param}_run")
    yield with_max_steps(make_trainer, 2), output_dir
    # The damaged checkpoint, or the one a resumed step saved in its place.
    for path in output_dir.glob("checkpoint-*"):
        if path.name != "checkpoint-1":
            shutil.rmtree(path)


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_resume_true_passes_over_a_half_written_newest_checkpoint(run, damage, caplog):
    """Before: `True` took checkpoint-2 by name and died with FileNotFoundError (missing) or a JSONDecodeError
    naming no file (truncated)."""
    make_trainer, output_dir = run
    damaged_copy(output_dir, 2, damage)
    with caplog.at_level(logging.WARNING, logger="trl_aspo.trainers.resume"):
        make_trainer().train(resume_from_checkpoint=True)
    skipped = [record.getMessage() for record in caplog.records if record.getMessage().startswith("Skipped")]
    reason = "no trainer_state.json" if damage == "missing" else "an unreadable trainer_state.json"
    assert skipped == [
        f"Skipped checkpoint-2 in {output_dir}: {reason}, so it was not saved to the end (a run stopped while "
        f"saving, or a full disk); resuming from the latest complete one, {output_dir / 'checkpoint-1'}."
    ]


def test_an_explicit_checkpoint_with_a_truncated_trainer_state_is_refused_naming_the_file(run):
    make_trainer, output_dir = run
    damaged = damaged_copy(output_dir, 2, "truncated")
    with pytest.raises(ValueError) as error:
        make_trainer().train(resume_from_checkpoint=str(damaged))
    message = str(error.value)
    assert message.startswith(f"resume_from_checkpoint={str(damaged)!r}: not a complete checkpoint (an unreadable ")
    assert f"{damaged / 'trainer_state.json'} is not valid JSON (truncated or corrupt?)" in message
    assert message.endswith(f"the latest complete one beside it is {output_dir / 'checkpoint-1'}.")


def test_an_asynchronous_checkpoint_without_rollout_state_is_refused(async_run, tmp_path):
    """Before: the resume went ahead with the prompt stream restarted at prompt 0 (a logged warning at most)."""
    make_trainer, output_dir = async_run
    copy = tmp_path / "checkpoint-1"
    shutil.copytree(output_dir / "checkpoint-1", copy)
    (copy / "rollout_state.json").unlink()
    trainer = with_max_steps(make_trainer, 2)()
    with pytest.raises(ValueError) as error:
        trainer.train(resume_from_checkpoint=str(copy))
    path = copy / "rollout_state.json"
    assert str(error.value) == (
        f"resume_from_checkpoint={str(copy)!r}: {path} is missing. The asynchronous trainer writes it into every "
        "checkpoint before trainer_state.json (the first untrained prompt group and the model version), so it was "
        "deleted, or the checkpoint is not the asynchronous trainer's; without it the prompt stream would restart "
        "at prompt 0 and train those prompts again. Resume from another checkpoint, or, to restart the stream on "
        f'purpose, write {{"prompt_index": 0, "model_version": 0}} into {path}.'
    )
    # The way out the message gives resumes.
    path.write_text('{"prompt_index": 0, "model_version": 0}')
    trainer.train(resume_from_checkpoint=str(copy))


@pytest.mark.parametrize("trainer_kind", ["sync", "async"])
def test_a_checkpoint_already_at_max_steps_is_refused(trainer_kind, request):
    """Before: the run resumed from checkpoint-1 with max_steps=1 trained step 2 and saved checkpoint-2."""
    make_trainer, output_dir = request.getfixturevalue(f"{trainer_kind}_run")
    for path in output_dir.glob("checkpoint-*"):
        if path.name != "checkpoint-1":
            shutil.rmtree(path)
    trainer = with_max_steps(make_trainer, 1)()
    with pytest.raises(ValueError) as error:
        trainer.train(resume_from_checkpoint=True)
    assert str(error.value) == (
        f"resume_from_checkpoint=True: {output_dir / 'checkpoint-1'} is at step 1, and max_steps=1: that run is "
        "finished (transformers' Trainer would train one step past max_steps). Raise max_steps to train on from it, "
        "or start afresh without resume_from_checkpoint."
    )
    assert sorted(path.name for path in output_dir.glob("checkpoint-*")) == ["checkpoint-1"]
