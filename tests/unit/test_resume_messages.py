"""`--resume_from_checkpoint true` is the latest checkpoint, and the interrupt message with and without one (the
interrupted runs: tests/integration/test_interrupt_resume.py)."""

from __future__ import annotations

import shlex

import pytest

from trl_aspo.trainers.resume import (
    cli_command,
    interrupt_message,
    resolve_resume_checkpoint,
    resume_command,
    skipped_checkpoints_note,
    with_absolute_paths,
)


def test_resume_from_checkpoint_true_is_the_latest_checkpoint(tmp_path):
    for step in (2, 10, 4):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-x").mkdir()
    assert resolve_resume_checkpoint("true", str(tmp_path)) == str(tmp_path / "checkpoint-10")
    assert resolve_resume_checkpoint(True, str(tmp_path)) == str(tmp_path / "checkpoint-10")
    assert resolve_resume_checkpoint("false", str(tmp_path)) is None
    assert resolve_resume_checkpoint(None, str(tmp_path)) is None
    assert resolve_resume_checkpoint("some/checkpoint-3", str(tmp_path)) == "some/checkpoint-3"


def test_a_checkpoint_at_max_steps_is_refused_and_one_below_it_or_without_a_limit_resumes(tmp_path):
    checkpoint = tmp_path / "checkpoint-4"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text('{"global_step": 4}')
    for max_steps in (5, -1, 0, None):
        assert resolve_resume_checkpoint("true", str(tmp_path), max_steps) == str(checkpoint)
    for max_steps in (4, 3):
        with pytest.raises(ValueError) as error:
            resolve_resume_checkpoint(str(checkpoint), str(tmp_path), max_steps)
        assert str(error.value) == (
            f"resume_from_checkpoint={str(checkpoint)!r}: {checkpoint} is at step 4, and max_steps={max_steps}: that "
            "run is finished (transformers' Trainer would train one step past max_steps). Raise max_steps to train "
            "on from it, or start afresh without resume_from_checkpoint."
        )


def test_interrupt_message_without_a_checkpoint_and_the_resume_command(tmp_path):
    assert interrupt_message(["--config", "x.yaml"], str(tmp_path), 3) == (
        f"Interrupted at step 3, with no checkpoint in {tmp_path} to resume from (save_strategy: steps and "
        "save_steps keep some)."
    )
    command = resume_command(["--config", "my run.yaml", "--resume_from_checkpoint", "old", "--seed", "1"], "out/c-4")
    assert command == shlex.join(
        [*cli_command(), "train", "--config", "my run.yaml", "--seed", "1", "--resume_from_checkpoint", "out/c-4"]
    )


def test_a_cut_short_trainer_state_makes_a_checkpoint_incomplete(tmp_path):
    """transformers writes trainer_state.json in place, so a kill or a full disk can leave it cut short: such a
    checkpoint is passed over by `true` and named with the file's error when given explicitly (before: complete,
    and the resume died with a JSONDecodeError naming no file)."""
    for step in (2, 4, 6):
        (tmp_path / f"checkpoint-{step}").mkdir()
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text('{"global_step": 2}')
    (tmp_path / "checkpoint-4" / "trainer_state.json").write_text('{"global_step": 4, "log_hi')
    assert resolve_resume_checkpoint(True, str(tmp_path)) == str(tmp_path / "checkpoint-2")
    assert skipped_checkpoints_note(str(tmp_path), str(tmp_path / "checkpoint-2")) == (
        f"Skipped checkpoint-4, checkpoint-6 in {tmp_path}: an unreadable trainer_state.json (checkpoint-4); no "
        "trainer_state.json (checkpoint-6), so they were not saved to the end (a run stopped while saving, or a full "
        f"disk); resuming from the latest complete one, {tmp_path / 'checkpoint-2'}."
    )
    state = tmp_path / "checkpoint-4" / "trainer_state.json"
    with pytest.raises(ValueError) as error:
        resolve_resume_checkpoint(str(tmp_path / "checkpoint-4"), str(tmp_path))
    assert str(error.value) == (
        f"resume_from_checkpoint={str(tmp_path / 'checkpoint-4')!r}: not a complete checkpoint (an unreadable "
        f"trainer_state.json: {state} is not valid JSON (truncated or corrupt?): Unterminated string starting at at "
        "line 1 column 20: a run stopped while saving it, or a full disk); the latest complete one beside it is "
        f"{tmp_path / 'checkpoint-2'}."
    )
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text("[2]")
    with pytest.raises(ValueError) as error:
        resolve_resume_checkpoint("true", str(tmp_path))
    assert str(error.value) == (
        f"resume_from_checkpoint=true: no checkpoint-* folder in output_dir {str(tmp_path)!r} is complete "
        "(checkpoint-2, checkpoint-4 have an unreadable trainer_state.json; checkpoint-6 has no trainer_state.json: a "
        "run stopped while saving, or a full disk). Start afresh without resume_from_checkpoint."
    )


def test_the_printed_resume_command_names_every_path_absolutely(tmp_path, monkeypatch):
    """Before: only the executable was absolute, so the printed command run from another folder exited 2 (`--config
    'configs/quickstart.yaml': no such file`) or, with the YAML's relative output_dir, resumed nothing there."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TRL_ASPO_RELAUNCH", raising=False)
    (tmp_path / "outputs" / "run" / "checkpoint-4").mkdir(parents=True)
    (tmp_path / "outputs" / "run" / "checkpoint-4" / "trainer_state.json").write_text("{}")
    checkpoint = str(tmp_path / "outputs" / "run" / "checkpoint-4")
    # output_dir from the YAML: added to the command.
    message = interrupt_message(["--config", "configs/q.yaml", "--seed", "1"], "outputs/run", 5)
    assert message == (
        f"Interrupted at step 5; latest checkpoint {checkpoint}. Resume with: "
        + shlex.join(
            [*cli_command(), "train", "--config", str(tmp_path / "configs" / "q.yaml"), "--seed", "1"]
            + ["--output_dir", str(tmp_path / "outputs" / "run"), "--resume_from_checkpoint", checkpoint]
        )
    )
    # Given on the command line, in either spelling: replaced where it stands.
    argv = ["--config=configs/q.yaml", "--output_dir", "outputs/run", "--resume_from_checkpoint=true"]
    assert with_absolute_paths(argv, "outputs/run") == [
        f"--config={tmp_path / 'configs' / 'q.yaml'}",
        "--output_dir",
        str(tmp_path / "outputs" / "run"),
        "--resume_from_checkpoint=true",
    ]
    assert with_absolute_paths(["--output_dir=./outputs/run"], "./outputs/run") == [
        f"--output_dir={tmp_path / 'outputs' / 'run'}"
    ]


def test_a_launched_run_resumes_with_its_accelerate_config_named_absolutely(tmp_path, monkeypatch):
    from trl_aspo.cli.main import launch_words

    monkeypatch.chdir(tmp_path)
    argv = ["--accelerate_config", "configs/accelerate/ddp.yaml", "--num_processes", "2", "--config", "a.yaml"]
    assert launch_words(argv) == [
        "--accelerate_config",
        str(tmp_path / "configs" / "accelerate" / "ddp.yaml"),
        "--num_processes",
        "2",
    ]
