"""The signal handling that `stop_signals` shares between a training process (`trl_aspo.trainers.graceful_stop`) and
`trl-aspo train`'s launcher (`trl_aspo.cli.main`): which signals, the exit status, and the rule for repeats. Imports
neither torch nor TRL, so the launcher answers a signal without loading them."""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from collections.abc import Callable

# `stop_signals: None` (the config's help text says the same).
DEFAULT_STOP_SIGNALS = ("TERM", "USR1", "INT")
# The exit status of a run stopped on a signal, with or without a new checkpoint: EX_TEMPFAIL of sysexits.h ("a
# temporary failure; the user is invited to retry"), which a batch script reads as "requeue and resume".
EXIT_STOPPED = 75
# A second SIGINT sooner than this after the first signal is the same keypress delivered twice (the terminal's to
# every process of its group, and the launcher's forwarded copy), not a second request.
SECOND_SIGINT_S = 1.0


def signal_numbers(names: list[str] | tuple[str, ...] | None) -> list[signal.Signals]:
    """The signals of `stop_signals` names ('TERM' -> SIGTERM); None: `DEFAULT_STOP_SIGNALS`."""
    return [signal.Signals[f"SIG{name}"] for name in (DEFAULT_STOP_SIGNALS if names is None else names)]


def note(text: str) -> None:
    """One line on stderr, written with os.write: a signal handler may run while `print` holds stderr's buffer."""
    os.write(2, f"\n{text}\n".encode())


def _raise_interrupt() -> None:
    raise KeyboardInterrupt


class StopRequest:
    """The signal handlers of one process: the first of `signals` is recorded in `signum` (and `on_first(signum)`
    called); a SIGINT `SECOND_SIGINT_S` or more after it restores the previous handlers and calls `on_second()`
    (default: raise KeyboardInterrupt); every other repeat is ignored, since launchers and SLURM deliver one signal
    more than once."""

    def __init__(
        self,
        signals: list[signal.Signals],
        on_first: Callable[[int], None] | None = None,
        on_second: Callable[[], None] = _raise_interrupt,
    ):
        self.signals, self.on_first, self.on_second = signals, on_first, on_second
        self.signum: int | None = None
        self.since: float | None = None
        self.previous: dict[int, object] = {}

    def install(self, who: str) -> bool:
        """Install the handlers; False (nothing installed, with a warning) outside the main thread, where Python
        cannot. A handler someone else installed is replaced with a warning naming it."""
        if threading.current_thread() is not threading.main_thread():
            warnings.warn(
                f"{who}: not in the main thread, where alone Python installs signal handlers; a stop signal acts as "
                "without trl-aspo.",
                RuntimeWarning,
                stacklevel=3,
            )
            return False
        for number in self.signals:
            previous = signal.signal(number, self.handle)
            self.previous[number] = previous
            if callable(previous) and previous is not signal.default_int_handler:
                warnings.warn(
                    f"{who} replaces the {number.name} handler {getattr(previous, '__qualname__', previous)} until "
                    "training ends (stop_signals lists it; stop_signals=[] keeps yours).",
                    RuntimeWarning,
                    stacklevel=3,
                )
        return True

    def restore(self) -> None:
        for number, previous in self.previous.items():
            # None: a handler installed outside Python (faulthandler.register), which Python cannot reinstall.
            signal.signal(number, signal.SIG_DFL if previous is None else previous)
        self.previous = {}

    def handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self.signum is None:
            self.signum, self.since = signum, now
            if self.on_first is not None:
                self.on_first(signum)
        elif signum == signal.SIGINT and now - self.since >= SECOND_SIGINT_S:
            self.restore()
            self.on_second()
