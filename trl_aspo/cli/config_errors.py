"""How the `trl-aspo` commands tell a mistake in a command line or a config: every mistake found is one line of a
`ConfigurationError`, which `report` prints as one block with exit status 2 (no traceback). Values in messages are
shown bounded (`shown`), and a mistyped name gets the names it was probably meant to be (`suggestion`)."""

from __future__ import annotations

import difflib
import reprlib
import sys
from collections.abc import Iterable
from typing import Any, NoReturn

# A value in a message is shown at most this long (a repr is built only up to its bounds: see `shown`).
SHOWN_CHARACTERS = 120
_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxlevel, _SHORT_REPR.maxstring, _SHORT_REPR.maxother = 3, 80, 80
_SHORT_REPR.maxlist = _SHORT_REPR.maxtuple = _SHORT_REPR.maxdict = _SHORT_REPR.maxset = 6
# The most names one suggestion offers.
SUGGESTED_NAMES = 2


class ConfigurationError(ValueError):
    """Every mistake found in a configuration, one line each (key or flag first, then what is allowed)."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


def report(prog: str, error: ConfigurationError, hint: str | None = None) -> NoReturn:
    """Print `error` as one block on stderr (one line for one problem) and exit with status 2 (argparse's status for
    a bad command line)."""
    count = len(error.problems)
    if count == 1:
        lines = [f"{prog}: {error.problems[0]}"]
    else:
        lines = [f"{prog}: {count} configuration errors:", *(f"  {problem}" for problem in error.problems)]
    lines.append(hint or f"Run `{prog} --help` for every field.")
    print("\n".join(lines), file=sys.stderr)
    raise SystemExit(2)


def shown(value: Any) -> str:
    """A bounded repr of `value` for a message: nested containers are cut after a few items and levels while the repr
    is built (so an enormous value costs no memory), then the text after `SHOWN_CHARACTERS`."""
    text = _SHORT_REPR.repr(value)
    return text if len(text) <= SHOWN_CHARACTERS else text[: SHOWN_CHARACTERS - 3] + "..."


def suggestion(word: str, names: Iterable[Any], prefix: str = "") -> str:
    """'; did you mean X?' (or 'X or Y') for the mistyped `word` among `names`, each written after `prefix`; '' when
    no name is close.

    A word whose parts (split at '_') all appear, in order, among the parts of longer names is a shortened name: the
    first of those names in their given (declared) order are offered, so `per_device_batch_size` gets
    per_device_train_batch_size before per_device_eval_batch_size, which difflib alone ranks first (it is shorter).
    Any other word gets difflib's closest name."""
    names = [str(name) for name in names]
    parts = word.split("_")
    longer = [name for name in names if len(parts) > 1 and _holds_in_order(name.split("_"), parts)]
    matches = longer[:SUGGESTED_NAMES] or difflib.get_close_matches(word, names, n=1)
    if not matches:
        return ""
    return f"; did you mean {' or '.join(prefix + match for match in matches)}?"


def _holds_in_order(words: list[str], parts: list[str]) -> bool:
    """Whether `words` has more items than `parts` and holds every part, in order."""
    remaining = iter(words)
    return len(words) > len(parts) and all(part in remaining for part in parts)
