"""trl-aspo: asymmetric IS loss, tool-position shaping and single-stream value tracking for TRL's GRPOTrainer."""

__version__ = "0.1.0"
__all__ = ["ASPOConfig", "ASPOTrainer", "AsyncASPOConfig", "AsyncASPOTrainer", "__version__"]

# Imported on first use: they load torch and TRL (the async ones TRL's experimental package), which the `trl-aspo`
# command's help and configuration checks never need.
_LAZY = {
    "ASPOConfig": ".config",
    "ASPOTrainer": ".trainer",
    "AsyncASPOConfig": ".async_config",
    "AsyncASPOTrainer": ".async_trainer",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
