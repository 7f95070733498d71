"""`plugins`: the user's modules a `trl-aspo train` run imports before its configuration is checked, so that the
losses and advantage estimators they register (`register_policy_loss`, `register_advantage_estimator`) are names
`loss_type` and `advantage_estimator` accept, in the check before the model loads and in every training process.

A plugin is a dotted module name, found on the Python path or in the working folder (as the dotted paths of
`reward_funcs`). Importing one usually imports torch; once one is imported, the config modules that declare
registry-held fields are imported too, so the checks read the registries' names as they are now
(`trl_aspo.cli.value_checks.field_choices`).

Whatever a plugin's import raises is a problem naming it, `BaseException`s included: a module that calls `sys.exit(0)`
(or raises `KeyboardInterrupt` itself) made `trl-aspo train` exit 0 without training and without a word. Only the
user's own Ctrl-C (a SIGINT received during the import) stops the command: with status 130, naming the plugin."""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import sys
import traceback

# The exit status of a command stopped by SIGINT (128 + 2), as a shell reports it.
INTERRUPTED_STATUS = 128 + signal.SIGINT


def plugin_problems(names: list[str], fields: dict[str, dict]) -> list[str]:
    """Import each plugin (`names`), then the config modules of the registry-held `fields`; a line for each plugin
    that cannot be found or raised while it was imported, naming it."""
    if not names:
        return []
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    problems = []
    for name in names:
        with _sigint_seen() as seen:
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as error:
                problems.append(
                    f"plugins entry {name!r}: {error} (a dotted module name, found on the Python path or in the "
                    f"working folder {os.getcwd()})"
                )
            except KeyboardInterrupt as error:
                if seen:
                    print(f"interrupted (Ctrl-C) while importing plugins entry {name!r}", file=sys.stderr)
                    raise SystemExit(INTERRUPTED_STATUS) from None
                problems.append(_raised(name, error))
            except BaseException as error:  # noqa: BLE001 - the user's module: whatever it raised is reported, named
                problems.append(_raised(name, error))
    for module in sorted({field["registry"] for field in fields.values() if field.get("registry")}):
        importlib.import_module(module)
    return problems


def _raised(name: str, error: BaseException) -> str:
    """The problem line of a plugin whose import raised `error`: what, and where in the user's code."""
    where = traceback.extract_tb(error.__traceback__)[-1]
    what = f"{type(error).__name__}({error.code!r})" if isinstance(error, SystemExit) else type(error).__name__
    detail = "" if isinstance(error, SystemExit) or not str(error) else f": {error}"
    line = f"plugins entry {name!r}: importing it raised {what}{detail} ({where.filename}, line {where.lineno})"
    # Exiting or interrupting is not an error the module could have meant as one: say what a plugin is for.
    return line if isinstance(error, Exception) else f"{line}; a plugin must only define and register"


@contextlib.contextmanager
def _sigint_seen():
    """A list that holds an entry once SIGINT (the user's Ctrl-C) arrived inside the block; the handler in force still
    handles it (Python's raises KeyboardInterrupt), so a KeyboardInterrupt without an entry was raised by code. With
    SIGINT ignored or left to the system no KeyboardInterrupt comes from a Ctrl-C; outside the main thread (no handler
    can be set there) every KeyboardInterrupt counts as the user's."""
    seen: list[int] = []
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):
        yield seen
        return

    def record(signum, frame):
        seen.append(signum)
        previous(signum, frame)

    try:
        signal.signal(signal.SIGINT, record)
    except ValueError:  # not the main thread
        yield [signal.SIGINT]
        return
    try:
        yield seen
    finally:
        signal.signal(signal.SIGINT, previous)
