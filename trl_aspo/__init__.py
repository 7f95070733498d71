"""trl-aspo: asymmetric IS loss, tool-position shaping and single-stream value tracking for TRL's GRPOTrainer."""

from .config import ASPOConfig
from .trainer import ASPOTrainer

__version__ = "0.1.0"
__all__ = ["ASPOConfig", "ASPOTrainer", "AsyncASPOConfig", "AsyncASPOTrainer", "__version__"]

# Imported on first use: they load TRL's experimental async package, which the synchronous trainer never needs.
_LAZY = {"AsyncASPOConfig": ".async_config", "AsyncASPOTrainer": ".async_trainer"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
