"""The two conductors, `ASPOTrainer` (TRL's `GRPOTrainer`) and `AsyncASPOTrainer` (TRL's `AsyncGRPOTrainer`), and what
both run the same way. Public paths: `from trl_aspo import ASPOTrainer, AsyncASPOTrainer`, and for a plain
`AsyncGRPOTrainer` with the local worker `from trl_aspo.trainers import LocalWorkerResumeMixin`."""

__all__ = ["ASPOTrainer", "AsyncASPOTrainer", "LocalWorkerResumeMixin"]


def __getattr__(name):
    if name == "ASPOTrainer":
        from trl_aspo.trainers.aspo_trainer import ASPOTrainer

        return ASPOTrainer
    if name == "AsyncASPOTrainer":
        from trl_aspo.trainers.async_aspo_trainer import AsyncASPOTrainer

        return AsyncASPOTrainer
    if name == "LocalWorkerResumeMixin":
        from trl_aspo.trainers.local_worker_resume import LocalWorkerResumeMixin

        return LocalWorkerResumeMixin
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
