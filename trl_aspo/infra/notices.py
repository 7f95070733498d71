"""Notices of TRL's and transformers' code that a user cannot act on, kept off the console (standard library only,
so the CLI can call it before anything heavy is imported)."""

from __future__ import annotations

import contextlib
import logging
import warnings


def ignore_known_notices() -> None:
    """Ignore the deprecation notices of TRL's and transformers' code that a user cannot act on (each named here).

    TRL 1.16 still calls transformers' renamed gradient-checkpointing API (`gradient_checkpointing` ->
    `activation_checkpointing`) whenever a TRL config is built. The asynchronous trainer is TRL's experimental
    `AsyncGRPOTrainer`, which warns at import that experimental APIs may change: docs/async.md says so once."""
    warnings.filterwarnings("ignore", message=r".*gradient_checkpointing.*deprecated", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"You are importing from 'trl\.experimental'")


class _DropMessages(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


@contextlib.contextmanager
def dropped_log_messages(logger_name: str, *prefixes: str):
    """Drop, while the block runs, the records of logger `logger_name` whose message starts with one of `prefixes`
    (each use says why the message is harmless); every other record of that logger passes."""
    logger = logging.getLogger(logger_name)
    drop = _DropMessages(prefixes)
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)
