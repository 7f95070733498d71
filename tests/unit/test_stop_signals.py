"""`stop_signals`, `stop_at`, `stop_grace_s` (issue 43 item 1) without training: the fields refused by name in both
configs and by `trl-aspo train` before torch; the handlers' rule for repeated signals; the handlers opt-in in the
Python API and restored after `train`, with a warning for a user's own handler."""

from __future__ import annotations

import signal
import threading
import time
import warnings

import pytest

from trl_aspo.infra.stop_signals import SECOND_SIGINT_S, StopRequest, signal_numbers


@pytest.mark.parametrize("config_name", ["ASPOConfig", "AsyncASPOConfig"])
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"stop_signals": ["KILL"]}, r"stop_signals=\['KILL'\] is invalid: each entry must be one of"),
        ({"stop_signals": "TERM"}, r"stop_signals='TERM' is invalid: must be a list of names or None"),
        ({"stop_at": "epoch"}, r"stop_at='epoch' is invalid: must be one of \('round', 'step'\)"),
        ({"stop_grace_s": 0}, r"stop_grace_s=0 is invalid: must lie in \(0, 86400\]"),
        (
            {"stop_signals": ["TERM"], "enable_jit_checkpoint": True},
            r"stop_signals=\['TERM'\] is invalid: transformers' enable_jit_checkpoint=True installs its own SIGTERM",
        ),
    ],
)
def test_a_stop_field_out_of_its_domain_is_refused_by_name(tmp_path, config_name, fields, message):
    import trl_aspo

    config = getattr(trl_aspo, config_name)
    with pytest.raises(ValueError, match=message):
        config(output_dir=str(tmp_path), use_cpu=True, report_to="none", **fields)
    defaults = config(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    assert (defaults.stop_signals, defaults.stop_at, defaults.stop_grace_s) == (None, "round", 300.0)
    assert [number.name for number in signal_numbers(defaults.stop_signals)] == ["SIGTERM", "SIGUSR1", "SIGINT"]


def test_trl_aspo_train_refuses_enable_jit_checkpoint_with_the_stop_signals_before_torch(tmp_path):
    from trl_aspo.cli.config_errors import ConfigurationError
    from trl_aspo.cli.run_checks import check_train_command_line

    argv = [
        "--model_name_or_path", "builtin:tiny-calculator", "--dataset_name", "builtin:calculator",
        "--reward_funcs", "builtin:correctness", "--output_dir", str(tmp_path), "--enable_jit_checkpoint", "true",
    ]  # fmt: skip
    with pytest.raises(ConfigurationError, match=r"enable_jit_checkpoint: true installs transformers' own SIGTERM"):
        check_train_command_line(argv)
    # stop_signals: [] leaves SIGTERM to transformers' handler.
    config = tmp_path / "run.yaml"
    config.write_text("stop_signals: []\nenable_jit_checkpoint: true\n")
    check_train_command_line(["--config", str(config), *argv[:-2]])


class Interrupted(Exception):
    pass


def test_the_first_signal_is_recorded_repeats_are_ignored_and_a_later_sigint_stops_at_once():
    """TERM then TERM, USR1 and a SIGINT within 1 s (a launcher's forwarded copy of a terminal's Ctrl-C) are
    ignored; a SIGINT 1 s or more after the first signal calls on_second, after restoring the previous handlers."""
    first = []

    def second():
        raise Interrupted

    request = StopRequest(signal_numbers(["TERM", "USR1", "INT"]), on_first=first.append, on_second=second)
    before = {number: signal.getsignal(number) for number in request.signals}
    assert request.install("test")
    try:
        for number in request.signals:
            assert signal.getsignal(number) == request.handle
        request.handle(signal.SIGTERM, None)
        request.handle(signal.SIGTERM, None)
        request.handle(signal.SIGUSR1, None)
        request.handle(signal.SIGINT, None)
        assert first == [signal.SIGTERM] and request.signum == signal.SIGTERM
        request.since = time.monotonic() - SECOND_SIGINT_S
        with pytest.raises(Interrupted):
            request.handle(signal.SIGINT, None)
        assert {number: signal.getsignal(number) for number in request.signals} == before
    finally:
        request.restore()


def test_a_users_handler_is_replaced_with_a_warning_and_restored():
    def users_handler(signum, frame):
        pass

    previous = signal.signal(signal.SIGUSR2, users_handler)
    try:
        request = StopRequest(signal_numbers(["USR2"]))
        with pytest.warns(RuntimeWarning, match="replaces the SIGUSR2 handler .*users_handler"):
            request.install("GracefulStop")
        request.restore()
        assert signal.getsignal(signal.SIGUSR2) is users_handler
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_outside_the_main_thread_nothing_is_installed_and_a_warning_says_so():
    caught = []

    def install():
        with warnings.catch_warnings(record=True) as found:
            warnings.simplefilter("always")
            caught.append((StopRequest(signal_numbers(["TERM"])).install("GracefulStop"), found))

    thread = threading.Thread(target=install)
    thread.start()
    thread.join()
    installed, found = caught[0]
    assert installed is False and "not in the main thread" in str(found[0].message)


@pytest.mark.slow
def test_the_handlers_are_opt_in_in_the_python_api_and_restored_after_train(tmp_path):
    """Without a GracefulStop callback train() installs nothing; with one, its handlers are in place during train
    and the previous ones after it."""
    from helpers import tiny_run_fields
    from transformers import TrainerCallback

    from trl_aspo import ASPOConfig, ASPOTrainer, GracefulStop

    seen = []

    class Watch(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append(signal.getsignal(signal.SIGTERM))

    def build(callbacks):
        args = ASPOConfig(**tiny_run_fields(tmp_path, max_steps=1, num_generations=2, per_device_train_batch_size=2))
        from datasets import Dataset

        data = Dataset.from_dict({"prompt": ["1+1=", "2+2="] * 2})
        return ASPOTrainer(
            "builtin:tiny-calculator", reward_funcs=lambda completions, **_: [0.0] * len(completions),
            args=args, train_dataset=data, callbacks=callbacks,
        )  # fmt: skip

    before = signal.getsignal(signal.SIGTERM)
    build([Watch()]).train()
    stop = GracefulStop()
    build([Watch(), stop]).train()
    assert seen[0] == before and seen[1] == stop.request.handle
    assert signal.getsignal(signal.SIGTERM) == before and stop.stopped is None


def test_a_process_that_reaches_no_boundary_within_stop_grace_s_exits_75_naming_the_latest_checkpoint(tmp_path):
    """A hung training loop (here: sleeping after the signal): the timer started by the first signal ends the process
    stop_grace_s later with status 75, without a new checkpoint, naming the latest complete one."""
    import json
    import subprocess
    import sys

    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    (tmp_path / "checkpoint-4").mkdir()  # cut short by a kill: no trainer_state.json
    script = f"""
import os, signal, time
from types import SimpleNamespace
from trl_aspo.trainers.graceful_stop import GracefulStop
args = SimpleNamespace(stop_signals=None, stop_at="round", stop_grace_s=0.5, enable_jit_checkpoint=False,
                       output_dir={str(tmp_path)!r})
stop = GracefulStop()
stop.begin(SimpleNamespace(args=args, accelerator=SimpleNamespace(is_main_process=True)))
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(30)
"""
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 75, result.stderr[-2000:]
    assert time.monotonic() - started < 25
    assert (
        "No stop boundary within stop_grace_s=0.5 s: exited without a new checkpoint; latest complete checkpoint: "
        f"{tmp_path / 'checkpoint-2'}"
    ) in result.stderr
