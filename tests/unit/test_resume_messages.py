"""`--resume_from_checkpoint true` is the latest checkpoint, and the interrupt message with and without one (the
interrupted runs: tests/integration/test_interrupt_resume.py)."""

from __future__ import annotations

import shlex

from trl_aspo.trainers.resume import cli_command, interrupt_message, resolve_resume_checkpoint, resume_command


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


def test_interrupt_message_without_a_checkpoint_and_the_resume_command(tmp_path):
    assert interrupt_message(["--config", "x.yaml"], str(tmp_path), 3) == (
        f"Interrupted at step 3, with no checkpoint in {tmp_path} to resume from (save_strategy: steps and "
        "save_steps keep some)."
    )
    command = resume_command(["--config", "my run.yaml", "--resume_from_checkpoint", "old", "--seed", "1"], "out/c-4")
    assert command == shlex.join(
        [*cli_command(), "train", "--config", "my run.yaml", "--seed", "1", "--resume_from_checkpoint", "out/c-4"]
    )
