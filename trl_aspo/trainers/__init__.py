"""The two conductors, `ASPOTrainer` (TRL's `GRPOTrainer`) and `AsyncASPOTrainer` (TRL's `AsyncGRPOTrainer`), and what
both run the same way. Public path: `from trl_aspo import ASPOTrainer, AsyncASPOTrainer`."""

__all__ = ["ASPOTrainer", "AsyncASPOTrainer"]


def __getattr__(name):
    if name == "ASPOTrainer":
        from trl_aspo.trainers.aspo_trainer import ASPOTrainer

        return ASPOTrainer
    if name == "AsyncASPOTrainer":
        from trl_aspo.trainers.async_aspo_trainer import AsyncASPOTrainer

        return AsyncASPOTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
