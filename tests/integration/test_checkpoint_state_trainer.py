"""Checkpoint state in real runs: written before the checkpoint counts as complete, a pickle beside it never read,
invalid values refused naming the file, and resumes that refuse or announce a changed configuration."""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil

import pytest
from helpers import digit_share_reward, tiny_run_fields

from trl_aspo import ASPOConfig, ASPOTrainer
from trl_aspo.trainers.checkpoint_state import STATE_JSON, load_checkpoint_state


def _mark_executed(path):
    with open(path, "w") as handle:
        handle.write("unpickling ran code")


class _Payload:
    """Unpickling this object calls `_mark_executed`: what a crafted checkpoint would do with `os.system`."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (_mark_executed, (self.marker,))


def _config(output_dir, **overrides) -> ASPOConfig:
    fields = dict(
        num_generations=1,
        advantage_estimator="spo++",
        max_completion_length=8,
        save_strategy="steps",
        save_steps=1,
        dataloader_num_workers=0,
    )
    return ASPOConfig(**tiny_run_fields(output_dir, **{**fields, **overrides}))


def _trainer(tiny_tokenizer, dataset, output_dir, **overrides) -> ASPOTrainer:
    from trl_aspo.builtin import build_random_model

    return ASPOTrainer(
        model=build_random_model(tiny_tokenizer, seed=0),
        reward_funcs=[digit_share_reward],
        args=_config(output_dir, **overrides),
        train_dataset=dataset,
        processing_class=tiny_tokenizer,
    )


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, tiny_tokenizer, calculator_dataset):
    """A two-step spo++ run with a checkpoint after each step; tests copy it before changing anything."""
    output_dir = tmp_path_factory.mktemp("run")
    trainer = _trainer(tiny_tokenizer, calculator_dataset.select(range(8)), output_dir)
    trainer.train()
    return output_dir, trainer._values.tracker.state_dict()


@pytest.fixture
def run_copy(trained_run, tmp_path):
    source, _ = trained_run
    target = tmp_path / "run"
    shutil.copytree(source, target)
    return target


def _resume(tiny_tokenizer, calculator_dataset, run_dir, rows=8, **overrides) -> ASPOTrainer:
    trainer = _trainer(tiny_tokenizer, calculator_dataset.select(range(rows)), run_dir, max_steps=3, **overrides)
    trainer.train(resume_from_checkpoint=str(run_dir / "checkpoint-2"))
    return trainer


@pytest.mark.slow
def test_state_exists_before_trainer_state_and_rotation(tiny_tokenizer, calculator_dataset, tmp_path, monkeypatch):
    import transformers.trainer as hf_trainer
    from transformers.trainer_callback import TrainerState

    seen = []
    save_to_json = TrainerState.save_to_json
    rotate = hf_trainer.rotate_checkpoints

    def checking_save_to_json(self, json_path):
        seen.append(("trainer_state", os.path.exists(os.path.join(os.path.dirname(json_path), STATE_JSON))))
        return save_to_json(self, json_path)

    def checking_rotate(output_dir, **kwargs):
        folders = sorted(name for name in os.listdir(output_dir) if name.startswith("checkpoint-"))
        seen.append(("rotate", all(os.path.exists(os.path.join(output_dir, name, STATE_JSON)) for name in folders)))
        return rotate(output_dir=output_dir, **kwargs)

    monkeypatch.setattr(TrainerState, "save_to_json", checking_save_to_json)
    monkeypatch.setattr(hf_trainer, "rotate_checkpoints", checking_rotate)
    _trainer(tiny_tokenizer, calculator_dataset.select(range(8)), tmp_path / "run", save_total_limit=1).train()
    assert seen == [("trainer_state", True), ("rotate", True)] * 2
    assert not [name for name in os.listdir(tmp_path / "run") if name.startswith(".tmp-")]


@pytest.mark.slow
def test_single_stream_resume_without_state_is_refused(run_copy, tiny_tokenizer, calculator_dataset, tmp_path):
    """The JSON state replaced by an `aspo_state.pt` (the pickle of unreleased builds, here a crafted one): no state,
    and the pickle never read."""
    checkpoint = run_copy / "checkpoint-2"
    os.remove(checkpoint / STATE_JSON)
    marker = tmp_path / "executed"
    with open(checkpoint / "aspo_state.pt", "wb") as handle:
        pickle.dump({"value_event": 2, "aspo_kl_coef": 0.0, "tracker": _Payload(str(marker))}, handle, protocol=2)
    with pytest.raises(ValueError, match=r"holds no trl-aspo state .*ASPOConfig\.value_reset_on_resume=True"):
        _resume(tiny_tokenizer, calculator_dataset, run_copy)
    resumed = _resume(tiny_tokenizer, calculator_dataset, run_copy, value_reset_on_resume=True)
    # The fresh tracker saw only the one round after the resume.
    assert resumed._value_event == 1 and resumed._values.tracker.num_tracked == 8
    assert not marker.exists()


def _rewrite_json(checkpoint, change) -> str:
    path = checkpoint / STATE_JSON
    document = json.loads(path.read_text())
    change(document["state"])
    path.write_text(json.dumps(document))
    return str(path)


def _set(key, value):
    def change(state):
        state[key] = value

    return change


def _set_tracker_alpha(value):
    def change(state):
        first = next(iter(state["tracker"]["state"]))
        state["tracker"]["state"][first][0] = value

    return change


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_set("value_event", 1e9), r"value_event must be a non-negative integer, got 1000000000\.0"),
        (_set("value_event", -1), "value_event must be a non-negative integer, got -1"),
        (_set("value_event", "2"), "value_event must be a non-negative integer, got '2'"),
        (_set("aspo_kl_coef", math.nan), "non-finite number nan"),
        (_set("aspo_kl_coef", -1.0), "aspo_kl_coef must be a finite number >= 0"),
        (_set_tracker_alpha(math.inf), "non-finite number inf"),
        (_set("tracker", [1, 2]), "tracker must be an object, got list"),
    ],
)
def test_invalid_state_values_are_refused_naming_the_file(run_copy, change, message):
    path = _rewrite_json(run_copy / "checkpoint-2", change)
    with pytest.raises(ValueError, match=rf"checkpoint state {path}.*{message}"):
        load_checkpoint_state(str(run_copy / "checkpoint-2"))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_set("value_event", 10**9), r"value_event=1000000000 exceeds the 2 micro-steps of its global_step=2"),
        (_set("tracker", {"type": "EventValueTracker"}), r"tracker.rho must be a number in \(0, 1\], got None"),
        (_set_tracker_alpha(-1.0), r"tracker.state of prompt key '.*': pseudo-counts alpha=-1\.0"),
    ],
)
def test_resume_refuses_a_state_that_does_not_fit(run_copy, tiny_tokenizer, calculator_dataset, change, message):
    path = _rewrite_json(run_copy / "checkpoint-2", change)
    with pytest.raises(ValueError, match=rf"checkpoint state {path}.*{message}"):
        _resume(tiny_tokenizer, calculator_dataset, run_copy)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            dict(advantage_estimator="group", num_generations=2),
            r"advantage_estimator='group', but the checkpoint was trained with advantage_estimator='spo\+\+'.*"
            r"value_reset_on_resume",
        ),
        (dict(seed=1), "seed=1, but the checkpoint was trained with seed=0"),
        (dict(prompt_id_column="answer"), "prompt_id_column='answer', but the checkpoint was trained with"),
        (
            dict(rows=16, prioritized_sampling=True),
            "training dataset of 16 rows, but the checkpoint was trained on 8 rows",
        ),
    ],
)
def test_resume_with_a_conflicting_setting_is_refused(
    run_copy, tiny_tokenizer, calculator_dataset, overrides, message
):
    with pytest.raises(ValueError, match=message):
        _resume(tiny_tokenizer, calculator_dataset, run_copy, **overrides)


@pytest.mark.slow
def test_resume_applies_a_changed_rho_and_says_so(run_copy, tiny_tokenizer, calculator_dataset, monkeypatch):
    import trl_aspo.trainers.project_state as project_state

    warnings = []
    monkeypatch.setattr(project_state.logger, "warning", warnings.append)
    resumed = _resume(tiny_tokenizer, calculator_dataset, run_copy, value_rho=0.5)
    assert resumed._values.tracker.rho == 0.5
    assert any("value_rho changes from 0.875 to 0.5; the new value applies" in line for line in warnings)


@pytest.mark.slow
def test_estimator_change_with_reset_starts_a_fresh_tracker(run_copy, tiny_tokenizer, calculator_dataset):
    resumed = _resume(
        tiny_tokenizer, calculator_dataset, run_copy, advantage_estimator="spo", value_reset_on_resume=True
    )
    assert resumed._value_event == 3 and resumed._values.tracker.num_tracked == 8
